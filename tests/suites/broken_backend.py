"""c10d backends that wrap gloo, each broken in one way, for tests/suites/test_broken_backend.py.

Loaded with ``--backend-plugin tests.suites.broken_backend``, it registers ``<breakage>_gloo``
for every entry of :data:`BREAKAGES`; ``wrapped_gloo`` is the unbroken control, so what fails
on the others fails because of their breakage, not because of the wrapping.

The wrapper is a Python ``ProcessGroup`` forwarding each operation the rows use to a
``ProcessGroupGloo`` built on the same store; a breakage overrides one method.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed does not export it

#: breakage -> what it gets wrong.
BREAKAGES = {
    "wrapped": "nothing (the control)",
    "wrong_op": "all_reduce with MAX computes MIN",
    "early_async": "an all_reduce's work reports completion, and wait() returns, at once",
    "wrong_split": "all_to_all_single with explicit splits delivers pieces in reverse order",
    "wrong_root": "broadcast and reduce always use rank 0 as the root",
    "dropped_tail": "all_gather_single leaves the last element of its output unwritten",
    "rotated_blocks": "reduce_scatter_single hands rank r the reduction of block r + 1",
    "reversed_gather": "gather fills the root's list in reverse rank order",
    "no_barrier": "barrier returns without waiting",
    "ignored_tags": "send and recv ignore their tags (messages match in posting order)",
    "late_timeout": "a collective times out after 4.5 times the group's timeout",
    "coalesced_first_only": "allreduce_coalesced reduces only the first tensor",
    "storage_order_gather": "all_gather_single reads a non-contiguous input in storage order",
    "local_subgroups": "an all_reduce on a sub-group never leaves the rank",
    "offset_blind_reduce_scatter": "reduce_scatter_single reads its input from the start of "
    "its storage, ignoring the storage offset",
}


class _CompletedWork(dist.Work):
    """A work that has finished (the wrapper already waited for it)."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _EarlyWork(_CompletedWork):
    """Claims completion at once; the real work is only waited for when the group runs
    anything but an all_reduce, so data read after ``wait()`` may not be reduced yet."""

    def __init__(self, inner: dist.Work, result: list[torch.Tensor]) -> None:
        super().__init__(result)
        self.inner = inner


def _waited(works: list[dist.Work], result: list[torch.Tensor]) -> _CompletedWork:
    for work in works:
        work.wait()
    return _CompletedWork(result)


class WrappedGloo(dist.ProcessGroup):
    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        breakage: str,
        group_name: str,
    ) -> None:
        super().__init__(rank, size)
        self._group_name = group_name
        if breakage == "late_timeout":
            timeout = timeout * 4.5
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._breakage = breakage
        self._pending: list[_EarlyWork] = []

    def getBackendName(self) -> str:
        return f"{self._breakage}_gloo"

    @property
    def group_name(self) -> str:
        # c10d uses a Python ProcessGroup as the group itself and never names it; the
        # functional collectives look groups up by this name.
        return self._group_name

    def _settle(self) -> None:
        for work in self._pending:
            work.inner.wait()
        self._pending.clear()

    # --- reductions ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        # No settling here: gloo queues a group's works in order, and waiting would block
        # the caller on peers that have not joined yet.
        opts = opts or dist.AllreduceOptions()
        if self._breakage == "local_subgroups" and self.size() < dist.get_world_size():
            return _CompletedWork(tensors)
        if self._breakage == "wrong_op" and opts.reduceOp.op == dist.ReduceOp.RedOpType.MAX:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MIN
        work = self._inner.allreduce(tensors, opts)
        if self._breakage == "early_async":
            early = _EarlyWork(work, tensors)
            self._pending.append(early)
            return early
        return work

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._settle()
        if self._breakage == "coalesced_first_only":
            tensors = tensors[:1]
        return self._inner.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions())

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._settle()
        opts = opts or dist.ReduceOptions()
        if self._breakage == "wrong_root":
            opts.rootRank = 0
        return self._inner.reduce(tensors, opts)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        self._settle()
        if self._breakage == "offset_blind_reduce_scatter" and input.storage_offset():
            input = input.as_strided(input.shape, input.stride(), 0)
        if self._breakage == "rotated_blocks" and input.numel():
            input = input.reshape(self.size(), -1).roll(-1, dims=0).reshape(input.shape)
        return self._inner._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None):
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return _waited(works, outputs)

    # --- gathers and one-to-many -----------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._settle()
        opts = opts or dist.BroadcastOptions()
        if self._breakage == "wrong_root":
            opts.rootRank = 0
        return self._inner.broadcast(tensors, opts)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.allgather(outputs, inputs, opts or AllgatherOptions())

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        self._settle()
        if self._breakage == "storage_order_gather" and not input.is_contiguous():
            dense = input.as_strided((input.numel(),), (1,), input.storage_offset())
            input = dense.view(input.shape)
        work = self._inner._allgather_base(output, input, opts or AllgatherOptions())
        if self._breakage != "dropped_tail" or output.numel() == 0:
            return work
        work.wait()
        output.view(-1)[-1] = 0
        return _CompletedWork([output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.allgather_coalesced(outputs, inputs, opts or AllgatherOptions())

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _waited(works, outputs)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        work = self._inner.gather(outputs, inputs, opts or dist.GatherOptions())
        if self._breakage != "reversed_gather" or not outputs:
            return work
        work.wait()
        gathered = [t.clone() for t in outputs[0]]
        for target, source in zip(outputs[0], reversed(gathered), strict=True):
            target.copy_(source)
        return _CompletedWork(outputs[0])

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.scatter(outputs, inputs, opts or dist.ScatterOptions())

    # --- all-to-all, point to point, barrier -----------------------------------------------

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.alltoall(outputs, inputs, opts or dist.AllToAllOptions())

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, opts=None
    ) -> dist.Work:
        self._settle()
        work = self._inner.alltoall_base(
            output, input, out_splits, in_splits, opts or dist.AllToAllOptions()
        )
        if self._breakage != "wrong_split" or not out_splits:
            return work
        work.wait()
        pieces = [piece.clone() for piece in output.split(list(out_splits))]
        torch.cat(pieces[::-1], out=output)
        return _CompletedWork([output])

    all_to_all_single = alltoall_base

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        self._settle()
        return self._inner.send(tensors, dst, 0 if self._breakage == "ignored_tags" else tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        self._settle()
        return self._inner.recv(tensors, src, 0 if self._breakage == "ignored_tags" else tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        self._settle()
        if self._breakage == "no_barrier":
            return _CompletedWork([])
        return self._inner.barrier(opts or dist.BarrierOptions())


def _creator(breakage: str):
    def create(backend_opts: Any, backend_options: Any) -> WrappedGloo:
        return WrappedGloo(
            backend_opts.store,
            backend_opts.group_rank,
            backend_opts.group_size,
            backend_opts.timeout,
            breakage,
            str(backend_opts.group_id),
        )

    return create


for _breakage in BREAKAGES:
    if f"{_breakage}_gloo" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            f"{_breakage}_gloo", _creator(_breakage), extended_api=True, devices=["cpu"]
        )
