"""The ``threaded`` c10d backend: a Python ProcessGroup whose ranks are threads of one process.

Each collective is a *meeting* keyed by (group name, position in that group's sequence of
collectives): every rank deposits its tensors, the last one to arrive moves the data for
all of them (it holds the baton, so nothing else runs meanwhile), and the others' work
handles complete. The ranks must agree on the collective at each position; a mismatch
(rank 0 all-reduces while rank 1 broadcasts) fails every participant with both calls named
instead of hanging. Reductions run in group-rank order, so results are deterministic.

Only tensors' data moves; autograd never sees the copies (they run under ``no_grad``),
like any real backend, whose c10d ops are opaque to autograd.

Operation names follow torch 2.13's c10d: ``all_gather_single`` / ``reduce_scatter_single``
/ ``all_to_all_single`` and their ``_coalesced`` forms are what ``dist.*`` and the
functional collectives (DTensor) call. torch 2.11 and 2.12 call the older names
(``_allgather_base``, ``allgather_into_tensor_coalesced``, ``_reduce_scatter_base``,
``reduce_scatter_tensor_coalesced``, ``alltoall_base``: from Python in ``distributed_c10d``, and
from C++ for the functional collectives), so each is an alias of its 2.13 method.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distconform.harness.backends.python_group import PythonProcessGroup
from distconform.harness.threads import observe
from distconform.harness.threads.world import (
    CollectiveMismatchError,
    Meeting,
    ThreadWorld,
    copy_error,
    current_rank,
)

BACKEND_NAME = "threaded"

_RED = dist.ReduceOp.RedOpType
_FLOAT_ONLY = {_RED.AVG}


#: Reduced in float32 and cast once: summing in the low-precision type itself rounds after
#: every addition, less accurate than the precision contract the backend suite checks.
_WIDENED = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _reduce(tensors: Sequence[torch.Tensor], op: Any) -> torch.Tensor:
    """Reduce in rank order into a fresh tensor (sequential, hence deterministic)."""
    dtype = tensors[0].dtype
    acc = tensors[0].detach().to(_WIDENED.get(dtype, dtype), copy=True)
    if op in _FLOAT_ONLY and not (acc.is_floating_point() or acc.is_complex()):
        raise TypeError(f"ReduceOp.{op.name} needs a floating dtype, got {acc.dtype}")
    for t in tensors[1:]:
        t = t.to(device=acc.device, dtype=acc.dtype)
        if op in (_RED.SUM, _RED.AVG):
            acc.add_(t)
        elif op == _RED.PRODUCT:
            acc.mul_(t)
        elif op == _RED.MAX:
            torch.maximum(acc, t, out=acc)
        elif op == _RED.MIN:
            torch.minimum(acc, t, out=acc)
        elif op == _RED.BAND:
            acc.bitwise_and_(t)
        elif op == _RED.BOR:
            acc.bitwise_or_(t)
        elif op == _RED.BXOR:
            acc.bitwise_xor_(t)
        else:
            raise NotImplementedError(f"the threaded backend does not implement {op}")
    if op == _RED.AVG:
        acc.div_(len(tensors))
    return acc.to(dtype)


def _red_op(opts: Any) -> Any:
    op = opts.reduceOp.op
    if op == _RED.PREMUL_SUM:
        raise NotImplementedError("the threaded backend does not implement PREMUL_SUM")
    return op


def _check_numel(what: str, tensor: torch.Tensor, expected: int) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"{what}: expected {expected} elements, got {tuple(tensor.shape)}")


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    # view(-1) rather than reshape: a copy would silently drop the written result.
    return tensor.view(-1)


def _check_same_numel(payloads: dict[int, Any], get: Callable[[Any], torch.Tensor]) -> int:
    sizes = {rank: get(p).numel() for rank, p in payloads.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"ranks contribute different element counts: {sizes}")
    return next(iter(sizes.values()))


class ThreadedWork(dist.Work):
    """Handle of one rank's part in a meeting; ``wait`` gives the baton up until it completes."""

    def __init__(
        self,
        world: ThreadWorld,
        rank: int,
        meeting: Meeting,
        result: list,
        group_timeout: timedelta | None = None,
    ) -> None:
        super().__init__()
        self._world = world
        self._rank = rank
        self._meeting = meeting
        self._result = result
        self._group_timeout = group_timeout

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # No timeout given (c10d passes 0): the group's, as every c10d backend does.
        if not timeout and self._group_timeout is not None:
            timeout = self._group_timeout
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        meeting = self._meeting
        try:
            self._world.wait_until(self._rank, meeting.settled, meeting.what, seconds or None)
        except TimeoutError as error:
            # The collective is abandoned, as a real backend's communicator is after a
            # timeout: a rank joining it later gets this error instead of a result.
            with self._world.lock:
                if not meeting.settled():
                    meeting.error = error
                    for future, _ in meeting.futures:
                        future.set_exception(error)
            raise
        if meeting.error is not None:
            if isinstance(meeting.error, CollectiveMismatchError):
                # Already names both sides: every rank reports the same words.
                raise copy_error(meeting.error, str(meeting.error))
            raise copy_error(meeting.error, f"{meeting.what} failed: {meeting.error}")
        return True

    def is_completed(self) -> bool:
        return self._meeting.settled()

    def is_success(self) -> bool:
        return self._meeting.done

    def exception(self) -> BaseException | None:
        return self._meeting.error

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future completed when the meeting completes.

        The rank yields first (:meth:`ThreadWorld.yield_until`): c10d's C++ may wait for
        this future without returning to Python, holding the baton the missing ranks need.
        If they cannot join yet, the future is completed later by the rank thread that
        completes the meeting, so ``then`` callbacks run on that thread.
        """
        future: torch.futures.Future = torch.futures.Future()
        meeting = self._meeting
        self._world.yield_until(self._rank, meeting.settled, meeting.what)
        with self._world.lock:
            if meeting.done:
                future.set_result(self._result)
            elif meeting.error is not None:
                future.set_exception(meeting.error)
            else:
                meeting.futures.append((future, self._result))
        return future


class ThreadedProcessGroup(PythonProcessGroup):
    """One rank's handle on one group (the default group or a subgroup)."""

    def __init__(
        self,
        world: ThreadWorld,
        global_rank: int,
        group_rank: int,
        group_size: int,
        group_name: str,
        global_ranks: tuple[int, ...],
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(group_rank, group_size, name=group_name, backend_name=BACKEND_NAME)
        self._timeout = timeout
        self._world = world
        self._global_rank = global_rank
        self._group_rank = group_rank
        self._group_size = group_size
        self._ranks = global_ranks
        self._seq = 0
        self._aborted = False

    # --- identity ------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"ThreadedProcessGroup(name={self._name!r}, rank={self._group_rank}, "
            f"size={self._group_size}, global_ranks={list(self._ranks)})"
        )

    def abort(self) -> None:
        """Refuse every later operation on this handle (other ranks' handles are theirs)."""
        self._aborted = True

    def _refuse_if_aborted(self, what: str) -> None:
        if self._aborted:
            raise RuntimeError(f"{what} on group {self._name!r}: the group was aborted")

    # --- plumbing ------------------------------------------------------------------------

    def _meet(
        self,
        op: str,
        params: tuple[Any, ...],
        payload: Any,
        execute: Callable[[dict[int, Any]], None],
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        result: list,
    ) -> ThreadedWork:
        self._refuse_if_aborted(op)
        seq = self._seq
        self._seq += 1
        what = f"{op} #{seq} on group {self._name!r}"
        observe.notify(
            op=op,
            group_name=self._name,
            group_ranks=self._ranks,
            rank=self._global_rank,
            group_rank=self._group_rank,
            seq=seq,
            inputs=inputs,
            outputs=outputs,
        )
        meeting = self._world.join(
            self._global_rank,
            self._name,
            seq,
            op,
            params,
            self._group_size,
            self._group_rank,
            payload,
            execute,
            what,
        )
        return ThreadedWork(self._world, self._global_rank, meeting, result, self._timeout)

    @staticmethod
    def _single(what: str, tensors: Sequence[Any]) -> Any:
        if len(tensors) != 1:
            raise ValueError(f"{what}: the threaded backend takes one tensor per rank")
        return tensors[0]

    # --- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadedWork:
        op = _red_op(opts or dist.AllreduceOptions())

        def execute(p: dict[int, list[torch.Tensor]]) -> None:
            for i in range(len(p[0])):
                reduced = _reduce([p[r][i] for r in range(len(p))], op)
                for r in range(len(p)):
                    p[r][i].copy_(reduced)

        # Shapes and dtypes are part of what every rank must agree on, so a mismatch is
        # reported as such instead of surfacing as an arithmetic error.
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        return self._meet(
            "allreduce", (op, len(tensors), signature), tensors, execute, tensors, tensors, tensors
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadedWork:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadedWork:
        opts = opts or dist.ReduceOptions()
        op, root = _red_op(opts), opts.rootRank
        tensor = self._single("reduce", tensors)

        def execute(p: dict[int, torch.Tensor]) -> None:
            p[root].copy_(_reduce([p[r] for r in range(len(p))], op))

        return self._meet("reduce", (op, root), tensor, execute, tensors, tensors, tensors)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> ThreadedWork:
        op = _red_op(opts or dist.ReduceScatterOptions())
        out = self._single("reduce_scatter", outputs)
        pieces = self._single("reduce_scatter", inputs)
        if len(pieces) != self._group_size:
            raise ValueError(f"reduce_scatter: need {self._group_size} inputs, got {len(pieces)}")

        def execute(p: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
            for dst in range(len(p)):
                p[dst][0].copy_(_reduce([p[src][1][dst] for src in range(len(p))], op))

        return self._meet("reduce_scatter", (op,), (out, pieces), execute, pieces, outputs, outputs)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ThreadedWork:
        return self.reduce_scatter_single_coalesced(
            [output], [input], opts, "reduce_scatter_single"
        )

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any = None,
        _op_name: str = "reduce_scatter_single_coalesced",
    ) -> ThreadedWork:
        op = _red_op(opts or dist.ReduceScatterOptions())
        size = self._group_size
        for out, inp in zip(outputs, inputs, strict=True):
            _check_numel(_op_name, inp, out.numel() * size)

        def execute(p: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
            for i in range(len(p[0])):
                n = _check_same_numel(p, lambda pairs, i=i: pairs[i][0])
                for dst in range(size):
                    chunks = [_flat(p[src][i][1])[dst * n : (dst + 1) * n] for src in range(size)]
                    _flat(p[dst][i][0]).copy_(_reduce(chunks, op))

        pairs = list(zip(outputs, inputs, strict=True))
        return self._meet(_op_name, (op, len(pairs)), pairs, execute, inputs, outputs, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- gathers ---------------------------------------------------------------------------

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadedWork:
        out_list = self._single("allgather", outputs)
        tensor = self._single("allgather", inputs)
        if len(out_list) != self._group_size:
            raise ValueError(f"allgather: need {self._group_size} outputs, got {len(out_list)}")

        def execute(p: dict[int, tuple[list[torch.Tensor], torch.Tensor]]) -> None:
            for dst in range(len(p)):
                for src in range(len(p)):
                    p[dst][0][src].copy_(p[src][1])

        return self._meet("allgather", (), (out_list, tensor), execute, inputs, out_list, outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadedWork:
        """``outputs[src][i]`` receives rank ``src``'s ``inputs[i]`` (the deprecated
        ``dist.all_gather_coalesced``)."""
        if len(outputs) != self._group_size:
            raise ValueError(
                f"allgather_coalesced: need {self._group_size} output lists, got {len(outputs)}"
            )
        signature = tuple((t.dtype, tuple(t.shape)) for t in inputs)

        def execute(p: dict[int, tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for dst in range(len(p)):
                for src in range(len(p)):
                    for target, source in zip(p[dst][0][src], p[src][1], strict=True):
                        target.copy_(source)

        written = [t for per_rank in outputs for t in per_rank]
        return self._meet(
            "allgather_coalesced",
            (signature,),
            (outputs, inputs),
            execute,
            inputs,
            written,
            written,
        )

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ThreadedWork:
        return self.all_gather_single_coalesced([output], [input], opts, "all_gather_single")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: Any = None,
        _op_name: str = "all_gather_single_coalesced",
    ) -> ThreadedWork:
        size = self._group_size
        for out, inp in zip(outputs, inputs, strict=True):
            _check_numel(_op_name, out, inp.numel() * size)

        def execute(p: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
            for i in range(len(p[0])):
                n = _check_same_numel(p, lambda pairs, i=i: pairs[i][1])
                for dst in range(size):
                    flat_out = _flat(p[dst][i][0])
                    for src in range(size):
                        flat_out[src * n : (src + 1) * n].copy_(p[src][i][1].reshape(-1))

        pairs = list(zip(outputs, inputs, strict=True))
        return self._meet(_op_name, (len(pairs),), pairs, execute, inputs, outputs, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadedWork:
        root = (opts or dist.GatherOptions()).rootRank
        tensor = self._single("gather", inputs)
        out_list = self._single("gather", outputs) if self._group_rank == root else []

        def execute(p: dict[int, tuple[list[torch.Tensor], torch.Tensor]]) -> None:
            for src in range(len(p)):
                p[root][0][src].copy_(p[src][1])

        return self._meet("gather", (root,), (out_list, tensor), execute, inputs, out_list, outputs)

    # --- one-to-many -------------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> ThreadedWork:
        opts = opts or dist.BroadcastOptions()
        root, index = opts.rootRank, opts.rootTensor

        def execute(p: dict[int, list[torch.Tensor]]) -> None:
            for dst in range(len(p)):
                if dst != root:
                    p[dst][index].copy_(p[root][index])

        sent = tensors if self._group_rank == root else []
        return self._meet("broadcast", (root, index), tensors, execute, sent, tensors, tensors)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> ThreadedWork:
        root = (opts or dist.ScatterOptions()).rootRank
        out = self._single("scatter", outputs)
        pieces = self._single("scatter", inputs) if self._group_rank == root else []

        def execute(p: dict[int, tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
            for dst in range(len(p)):
                p[dst][0].copy_(p[root][1][dst])

        return self._meet("scatter", (root,), (out, pieces), execute, pieces, outputs, outputs)

    # --- all-to-all --------------------------------------------------------------------------

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ThreadedWork:
        def execute(p: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            for dst in range(len(p)):
                for src in range(len(p)):
                    p[dst][0][src].copy_(p[src][1][dst])

        return self._meet("alltoall", (), (outputs, inputs), execute, inputs, outputs, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> ThreadedWork:
        size = self._group_size

        def splits(tensor: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
            if not sizes:
                if tensor.shape[0] % size:
                    raise ValueError(f"all_to_all_single: dim 0 of {what} not divisible by {size}")
                sizes = [tensor.shape[0] // size] * size
            if len(sizes) != size or sum(sizes) != tensor.shape[0]:
                raise ValueError(
                    f"all_to_all_single: {what} splits {list(sizes)} do not cover "
                    f"dim 0 = {tensor.shape[0]} in {size} parts"
                )
            return list(tensor.split(list(sizes), dim=0))

        out_parts = splits(output, list(output_split_sizes), "output")
        in_parts = splits(input, list(input_split_sizes), "input")

        def execute(p: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            for dst in range(size):
                for src in range(size):
                    p[dst][0][src].copy_(p[src][1][dst])

        return self._meet(
            "all_to_all_single", (), (out_parts, in_parts), execute, [input], [output], [output]
        )

    alltoall_base = all_to_all_single

    # --- point to point and barrier ------------------------------------------------------

    def _p2p(
        self, tensors: list[torch.Tensor], src: int, dst: int, tag: int, sending: bool
    ) -> ThreadedWork:
        self._refuse_if_aborted("send" if sending else "recv")
        tensor = self._single("send" if sending else "recv", tensors)
        if not 0 <= (dst if sending else src) < self._group_size:
            raise ValueError(
                f"peer rank {dst if sending else src} not in group of {self._group_size}"
            )
        index = self._world.next_p2p_index((self._name, src, dst, tag, sending))
        kind = "send" if sending else "recv"
        what = f"{kind} #{index} {src}->{dst} tag {tag} on group {self._name!r}"
        observe.notify(
            op=kind,
            group_name=self._name,
            group_ranks=self._ranks,
            rank=self._global_rank,
            group_rank=self._group_rank,
            seq=index,
            inputs=tensors if sending else [],
            outputs=[] if sending else tensors,
        )

        def execute(p: dict[int, torch.Tensor]) -> None:
            p[1].copy_(p[0])

        meeting = self._world.join(
            self._global_rank,
            self._name,
            ("p2p", src, dst, tag, index),
            "p2p",
            (),
            2,
            0 if sending else 1,
            tensor,
            execute,
            what,
        )
        return ThreadedWork(self._world, self._global_rank, meeting, tensors, self._timeout)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> ThreadedWork:
        return self._p2p(tensors, self._group_rank, dst, tag, sending=True)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> ThreadedWork:
        return self._p2p(tensors, src, self._group_rank, tag, sending=False)

    def barrier(self, opts: Any = None) -> ThreadedWork:
        return self._meet("barrier", (), None, lambda p: None, [], [], [])


_register_lock = threading.Lock()


def _create(backend_opts: Any, backend_options: Any) -> ThreadedProcessGroup:
    here = current_rank()
    if here is None:
        raise RuntimeError(
            "the 'threaded' backend only works on rank threads started by "
            "distconform.harness.threads.ThreadRunner (no thread world is bound to this thread); a "
            "MultiThreadedTestCase of torch's harness runs on them with --dist-adopt"
        )
    world, global_rank = here
    ranks = tuple(backend_opts.global_ranks_in_group) or tuple(range(backend_opts.group_size))
    return ThreadedProcessGroup(
        world,
        global_rank,
        backend_opts.group_rank,
        backend_opts.group_size,
        str(backend_opts.group_id),
        ranks,
        backend_opts.timeout,
    )


def register_threaded_backend() -> None:
    """Register ``threaded`` with c10d as distconform.harness.threads' backend.

    Called before every world is joined, it also takes the name back from a module that
    registered its own since: torch's multi-threaded test process group registers
    ``threaded`` whenever torch's test package is imported, which any test module written
    for torch's harness does (adopted with ``--dist-adopt`` or not). The two cannot serve
    one process: once a runner started here, torch's own ``MultiThreadedTestCase`` runner in
    this process gets this backend and fails with :func:`_create`'s message, which says to
    adopt the class instead.
    """
    with _register_lock:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
