"""c10d backends that wrap gloo, each broken in one way, for tests/suites/test_broken_backend.py.

Loaded with ``--backend-plugin tests.suites.broken_backend``; it registers

* ``wrapped_gloo``: gloo behind the wrapper, unbroken (the control: what fails below fails
  because of the breakage, not the wrapping);
* ``wrong_op_gloo``: all_reduce with MAX computes MIN;
* ``early_async_gloo``: an all_reduce's work says it is complete, and ``wait()`` returns,
  before the collective has finished;
* ``wrong_split_gloo``: all_to_all_single with explicit splits delivers the pieces in
  reverse source order.

The wrapper is a Python ``ProcessGroup`` forwarding every operation the backend suite's fast
items use to a ``ProcessGroupGloo`` built on the same store.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BREAKAGES = ("wrapped", "wrong_op", "early_async", "wrong_split")


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


class WrappedGloo(dist.ProcessGroup):
    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, breakage: str):
        super().__init__(rank, size)
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._breakage = breakage
        self._pending: list[_EarlyWork] = []

    def getBackendName(self) -> str:
        return f"{self._breakage}_gloo"

    def _settle(self) -> None:
        for work in self._pending:
            work.inner.wait()
        self._pending.clear()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        # No settling here: gloo queues a group's works in order, and waiting would block
        # the caller on peers that have not joined yet.
        opts = opts or dist.AllreduceOptions()
        if self._breakage == "wrong_op" and opts.reduceOp.op == dist.ReduceOp.RedOpType.MAX:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MIN
        work = self._inner.allreduce(tensors, opts)
        if self._breakage == "early_async":
            early = _EarlyWork(work, tensors)
            self._pending.append(early)
            return early
        return work

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.broadcast(tensors, opts or dist.BroadcastOptions())

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.allgather(outputs, inputs, opts or dist.AllgatherOptions())

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner._allgather_base(output, input, opts or dist.AllgatherOptions())

    _allgather_base = all_gather_single

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

    def barrier(self, opts: Any = None) -> dist.Work:
        self._settle()
        return self._inner.barrier(opts or dist.BarrierOptions())


def _creator(breakage: str):
    def create(backend_opts: Any, backend_options: Any) -> WrappedGloo:
        return WrappedGloo(
            backend_opts.store,
            backend_opts.group_rank,
            backend_opts.group_size,
            backend_opts.timeout,
            breakage,
        )

    return create


for _breakage in BREAKAGES:
    if f"{_breakage}_gloo" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            f"{_breakage}_gloo", _creator(_breakage), extended_api=True, devices=["cpu"]
        )
