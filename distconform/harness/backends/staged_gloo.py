"""``staged_gloo``: a c10d backend that carries device tensors through CPU gloo.

Importing this module registers the backend, as a vendor's plug-in would
(``--backend-plugin distconform.harness.backends.staged_gloo``; ``--backend staged_gloo`` imports it
by itself). Every collective copies the device tensors it reads to the CPU, runs gloo's own
collective on the copies, waits for it, and copies the results back into the device tensors it
writes. Device data never takes a path gloo does not test on the CPU, so any number of ranks can
share one device: NCCL refuses two ranks of one communicator on one GPU, and gloo's own device
support covers only a few collectives (no all-gather into one tensor, no reduce-scatter), which
FSDP2 needs.

It is for correctness runs, not speed: each collective costs two host copies. Its work is
gloo's: asynchronous as gloo's is, and the results are on the device once it is waited for
(or its future completes).

On a device with streams it keeps the stream semantics torch documents for NCCL process
groups, so that code which forgets a wait is wrong here as it is there:

- a collective waits for the issuing thread's current stream (its inputs are ready);
- it reads its inputs and writes its outputs on the group's own stream, one per device;
- ``Work.wait()`` makes the waiting thread's current stream wait for that work;
- a blocking call (``async_op=False``) is that wait, done by c10d itself;
- the work holds its tensors until it is waited for, so memory a caller drops early is not
  freed under the collective (NCCL's work stashes them, ``TORCH_NCCL_AVOID_RECORD_STREAMS``);
  once waited, a tensor's memory goes back to the stream that allocated it, which is
  ordered after the collective only if that stream waited;
- a completed ``get_future()`` means the host waited for the work.

On a device that checks stream safety (:func:`distconform.harness.devices.stream_checker`, the fake
device), the collective is reported to the checker as one kernel on the group's stream at
issue, reading the inputs and writing the outputs; the host copies that carry it are not
checked, being that kernel's own work. A read of an output on the current stream with no
``wait()`` before it is then an unordered read of the collective's write.

Operation names follow the installed
torch's c10d: 2.13's ``all_gather_single`` / ``reduce_scatter_single`` /
``all_to_all_single`` and the names older releases call (``_allgather_base``...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distconform.api import current_stream_set
from distconform.extension import StreamChecker, stream_checker
from distconform.harness.backends.python_group import PythonProcessGroup

BACKEND_NAME = "staged_gloo"

Tensors = Sequence[torch.Tensor]


class StagedWork(dist.Work):
    """The handle of gloo's work on the host copies; waiting copies the results back.

    The copy back happens once, on whichever comes first: ``wait`` on the issuing thread,
    or the completion of ``get_future``'s future. ``done`` are the events recorded on the
    group's stream after the collective (none on the CPU): ``wait`` makes the current
    stream wait for them. ``held`` are the device tensors the collective uses, kept alive
    until then.
    """

    def __init__(
        self,
        inner: Sequence[dist.Work],
        copy_back: Callable[[bool], None],
        result: list,
        done: Sequence[torch.Event] = (),
        held: Sequence[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self._inner = list(inner)
        self._copy_back = copy_back
        self._result = result
        self._done = list(done)
        self._held = list(held)
        self._lock = threading.Lock()
        self._copied = False

    def _finish(self, synchronize: bool) -> None:
        with self._lock:
            if not self._copied:
                self._copy_back(synchronize)
                self._copied = True
            self._held = []

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for work in self._inner:
            work.wait(timeout)
        for event in self._done:
            torch.accelerator.current_stream(event.device).wait_event(event)
        # On the waiting stream, after its wait: whoever reads the outputs next orders
        # itself after this stream, as after an NCCL wait.
        self._finish(synchronize=False)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._inner)

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        futures = [work.get_future() for work in self._inner]

        def finish(completed: torch.futures.Future) -> list:
            for future in completed.value():
                future.value()  # raises gloo's error, if any
            # On gloo's thread, whose stream nobody waits for: the copies are complete when
            # this returns, and the host has waited for the collective.
            for event in self._done:
                event.synchronize()
            self._finish(synchronize=True)
            return self._result

        return torch.futures.collect_all(futures).then(finish)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor gloo works on: the tensor itself on the CPU, else a copy."""
    if tensor.device.type == "cpu":
        return tensor
    return tensor.detach().to("cpu", copy=True)


def _back(device_tensors: Tensors, host_tensors: Tensors, synchronize: bool) -> None:
    """Copy results gloo wrote on the CPU into the device tensors they stand for, on the
    current stream; with ``synchronize``, complete when this returns."""
    devices = set()
    with torch.no_grad():
        for device_tensor, host in zip(device_tensors, host_tensors, strict=True):
            if host is not device_tensor:
                device_tensor.copy_(host)
                devices.add(device_tensor.device)
    if synchronize:
        for device in devices:
            torch.accelerator.current_stream(device).synchronize()


def _device_of(tensors: Tensors) -> torch.device | None:
    """The accelerator the tensors are on, or None for host tensors."""
    return next((t.device for t in tensors if t.device.type != "cpu"), None)


def _unchecked(checker: StreamChecker | None) -> AbstractContextManager[None]:
    """The checker's pause for the backend's own copies (nothing without a checker)."""
    return nullcontext() if checker is None else checker.stream_check_paused()


class StagedGlooProcessGroup(PythonProcessGroup):
    """One rank's handle on one group, backed by a gloo group over the same store."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        group_name: str,
    ) -> None:
        super().__init__(rank, size, name=group_name, backend_name=BACKEND_NAME)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("staged/", store), rank, size, timeout)
        self._streams: dict[torch.device, torch.Stream] = {}

    # --- identity ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"StagedGlooProcessGroup(name={self._name!r}, rank={self.rank()}, size={self.size()})"
        )

    # --- plumbing ----------------------------------------------------------------------------

    def _run(
        self,
        issue: Callable[..., dist.Work],
        reads: Tensors,
        writes: Tensors,
        build: Callable[[list[torch.Tensor], list[torch.Tensor]], tuple[Any, ...]],
    ) -> StagedWork:
        """Stage ``reads`` and ``writes`` on the CPU and issue gloo's call with the arguments
        ``build(host_reads, host_writes)`` returns; the work copies ``writes`` back."""
        staged: dict[int, torch.Tensor] = {}

        def stage(tensor: torch.Tensor) -> torch.Tensor:
            # An in-place collective reads and writes one tensor: one host copy for both.
            if id(tensor) not in staged:
                staged[id(tensor)] = _to_host(tensor)
            return staged[id(tensor)]

        device = _device_of([*reads, *writes])
        if device is None:
            work = issue(*build([stage(t) for t in reads], [stage(t) for t in writes]))
            return StagedWork([work], lambda _: None, list(writes))
        checker = stream_checker(device.type)
        stream = self._stream_for(device)
        stream.wait_stream(torch.accelerator.current_stream(device))
        with current_stream_set(stream):
            if checker is not None:
                checker.record_kernel(f"c10d::{issue.__name__}", list(reads), list(writes))
            with _unchecked(checker):
                host_reads = [stage(t) for t in reads]
                host_writes = [stage(t) for t in writes]
            done = stream.record_event()
        work = issue(*build(host_reads, host_writes))

        def copy_back(synchronize: bool) -> None:
            with _unchecked(checker):
                _back(writes, host_writes, synchronize)

        return StagedWork([work], copy_back, list(writes), [done], [*reads, *writes])

    def _stream_for(self, device: torch.device) -> torch.Stream:
        """The group's own stream on ``device``, as an NCCL group has one per device."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.Stream(device=device)
        return stream

    # --- collectives (``opts`` is passed on only when given: gloo has its own defaults) ----

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> StagedWork:
        return self._run(self._gloo.allreduce, tensors, tensors, lambda r, w: (w, *_given(opts)))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> StagedWork:
        issue = self._gloo.allreduce_coalesced
        return self._run(issue, tensors, tensors, lambda r, w: (w, *_given(opts)))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> StagedWork:
        return self._run(self._gloo.broadcast, tensors, tensors, lambda r, w: (w, *_given(opts)))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> StagedWork:
        return self._run(self._gloo.reduce, tensors, tensors, lambda r, w: (w, *_given(opts)))

    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        flat, regroup = _flatten(output_lists)
        build = lambda r, w: (regroup(w), r, *_given(opts))  # noqa: E731
        return self._run(self._gloo.allgather, inputs, flat, build)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        flat, regroup = _flatten(output_lists)
        build = lambda r, w: (regroup(w), r, *_given(opts))  # noqa: E731
        return self._run(self._gloo.allgather_coalesced, inputs, flat, build)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> StagedWork:
        build = lambda r, w: (w[0], r[0], *_given(opts))  # noqa: E731
        return self._run(self._gloo._allgather_base, [input], [output], build)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _joined(works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        flat, regroup = _flatten(output_lists)
        build = lambda r, w: (regroup(w), r, *_given(opts))  # noqa: E731
        return self._run(self._gloo.gather, inputs, flat, build)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> StagedWork:
        flat, regroup = _flatten(input_lists)
        build = lambda r, w: (w, regroup(r), *_given(opts))  # noqa: E731
        return self._run(self._gloo.scatter, flat, outputs, build)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> StagedWork:
        flat, regroup = _flatten(input_lists)
        build = lambda r, w: (w, regroup(r), *_given(opts))  # noqa: E731
        return self._run(self._gloo.reduce_scatter, flat, outputs, build)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> StagedWork:
        build = lambda r, w: (w[0], r[0], *_given(opts))  # noqa: E731
        return self._run(self._gloo._reduce_scatter_base, [input], [output], build)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        pairs = zip(outputs, inputs, strict=True)
        works = [self.reduce_scatter_single(o, i, opts) for o, i in pairs]
        return _joined(works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> StagedWork:
        def build(r: list[torch.Tensor], w: list[torch.Tensor]) -> tuple[Any, ...]:
            return (w[0], r[0], output_split_sizes, input_split_sizes, *_given(opts))

        return self._run(self._gloo.alltoall_base, [input], [output], build)

    alltoall_base = all_to_all_single

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> StagedWork:
        return self._run(self._gloo.alltoall, inputs, outputs, lambda r, w: (w, r, *_given(opts)))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> StagedWork:
        return self._run(self._gloo.send, tensors, [], lambda r, w: (r, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> StagedWork:
        return self._run(self._gloo.recv, [], tensors, lambda r, w: (w, src, tag))

    def barrier(self, opts: Any = None) -> StagedWork:
        return StagedWork([self._gloo.barrier(*_given(opts))], lambda _: None, [])


def _given(opts: Any) -> tuple[Any, ...]:
    return () if opts is None else (opts,)


def _flatten(
    nested: list[list[torch.Tensor]],
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], list[list[torch.Tensor]]]]:
    """The tensors of a list of lists in order, and how to regroup stand-ins for them."""
    sizes = [len(inner) for inner in nested]

    def regroup(flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        out, start = [], 0
        for size in sizes:
            out.append(flat[start : start + size])
            start += size
        return out

    return [t for inner in nested for t in inner], regroup


def _joined(works: list[StagedWork], result: list) -> StagedWork:
    """One handle for several staged works: waiting it waits (and copies back) each."""

    def copy_back(synchronize: bool) -> None:
        for work in works:
            work._finish(synchronize)

    inner = [w for work in works for w in work._inner]
    done = [e for work in works for e in work._done]
    return StagedWork(inner, copy_back, result, done, [t for work in works for t in work._held])


def _create(backend_opts: Any, backend_options: Any) -> StagedGlooProcessGroup:
    return StagedGlooProcessGroup(
        backend_opts.store,
        backend_opts.group_rank,
        backend_opts.group_size,
        backend_opts.timeout,
        str(backend_opts.group_id),
    )


def device_types() -> list[str]:
    """The CPU and this process's accelerator, if it has one: what the backend serves."""
    accelerator = torch.accelerator.current_accelerator()
    return ["cpu"] if accelerator is None else ["cpu", accelerator.type]


def register() -> None:
    """Register ``staged_gloo`` with c10d (again: a later registration replaces ours)."""
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=device_types())


register()
