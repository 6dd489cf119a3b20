"""Running one task inside a rank and turning whatever happens into a RankResult."""

from __future__ import annotations

import random
import sys
import time
import traceback
import unittest
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.comm import flight
from distconform.harness.rank import hygiene
from distconform.harness.rank.device_audit import device_audit
from distconform.harness.rank.memory_limit import limited_memory
from distconform.harness.rank.stream_safety import stream_safety
from distconform.harness.rank.warning_capture import rank_warning_capture
from distconform.harness.shared.memory_sizes import format_size, looks_like_out_of_memory
from distconform.harness.shared.outcomes import Outcome, RankResult
from distconform.harness.shared.rank_context import RankContext, RankLocal, active_rank_context
from distconform.harness.shared.task import RankTask, ensure_modules, unpack_call

# Text that gloo, NCCL and the store put in errors raised because *another* rank
# went away or never arrived. Such errors are reactions, not causes.
_PEER_ERROR_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "aborted",
    "remote process exited",
    "ncclremoteerror",
)


def is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _PEER_ERROR_MARKERS)


def reseed(seed: int, device_type: str = "cpu") -> None:
    """The same seed on every rank: tests that need per-rank randomness derive it from rank.

    On CPU ranks only the CPU generator exists; ``torch.manual_seed`` would also queue
    a lazy seed for every device type, which costs half a millisecond per test.
    """
    random.seed(seed)
    if device_type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _build_rank_locals(value: Any, ctx: RankContext) -> Any:
    return value.build(ctx) if isinstance(value, RankLocal) else value


def run_task(task: RankTask, ctx: RankContext) -> RankResult:
    result = RankResult(rank=ctx.rank, outcome=Outcome.PASSED, started_at=time.monotonic())
    try:
        with active_rank_context(ctx), rank_warning_capture(task.warning_filters) as caught:
            result.warnings = caught  # filled in when the capture ends
            _call(task, ctx, result)
    except BaseException as exc:  # every outcome, SystemExit included, is reported
        _record_exception(result, exc)
    finally:
        result.finished_at = time.monotonic()
    return result


def run_task_in_process(task: RankTask, ctx: RankContext, trace_dir: str | None) -> RankResult:
    """``run_task`` for a rank that owns its process: memory limit, flight trace, hygiene,
    and the default timeout of the groups the test creates.

    Used by the process launcher's ranks and by ranks started by torchrun; thread
    ranks share a process, so none of this can be per rank for them.
    """
    left = hygiene.destroy_the_last_tests_groups(ctx.device_type)
    before = hygiene.take_snapshot()
    with (
        limited_memory(task.memory_limit),
        flight.recording(trace_dir, ctx.rank, task.task_id) as recorder,
        # The groups the test creates without a timeout of their own time out with the
        # default group's pg_timeout, before the parent's deadline, not after c10d's 30
        # minutes: a rank stuck in a sub-group (a rendezvous whose peer failed) then raises
        # instead of running until the parent kills it (issue 52). Per process: see there.
        _torch_private.bound_default_group_timeout(timedelta(seconds=task.pg_timeout)),
    ):
        result = run_task(task, ctx)
    if recorder is not None:
        result.ledger = recorder.ledger()
    if task.memory_limit and looks_like_out_of_memory(result.error_type, result.error_message):
        result.note = (
            f"rank {result.rank} exceeded its memory limit of {format_size(task.memory_limit)}"
        )
    result.group_naming = hygiene.group_naming()
    result.hygiene = left + hygiene.clean_up_after_test(before)
    return result


def _call(task: RankTask, ctx: RankContext, result: RankResult) -> None:
    ensure_modules(task)
    fn, args, kwargs = unpack_call(task.payload)
    args = tuple(_build_rank_locals(a, ctx) for a in args)
    kwargs = {k: _build_rank_locals(v, ctx) for k, v in kwargs.items()}
    reseed(task.seed, ctx.device_type)
    if dist.is_initialized():
        dist.group.WORLD.set_timeout(timedelta(seconds=task.pg_timeout))
    # Around the test body only: the harness's own set-up above (rank-local fixtures,
    # reseeding) and its teardown may create tensors wherever they need to.
    with (
        stream_safety(task.stream_check, ctx.device, ctx.rank),
        device_audit(task.device_audit, ctx.device),
    ):
        result.value = fn(*args, **kwargs)


def _outcome_exception_kind(exc: BaseException) -> Outcome | None:
    """Skip and xfail raised inside the rank; pytest's classes are matched only if loaded."""
    if isinstance(exc, unittest.SkipTest):
        return Outcome.SKIPPED
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is None:
        return None
    if isinstance(exc, outcomes.Skipped):
        return Outcome.SKIPPED
    if isinstance(exc, outcomes.XFailed):
        return Outcome.XFAILED
    return None


def _record_exception(result: RankResult, exc: BaseException) -> None:
    kind = _outcome_exception_kind(exc)
    if kind is not None:
        result.outcome = kind
        result.reason = str(getattr(exc, "msg", None) or exc)
        return
    result.outcome = Outcome.FAILED
    result.error_type = type(exc).__qualname__
    result.error_message = str(getattr(exc, "msg", None) or exc)
    result.comm_error = is_comm_error(exc)
    tb = _user_frames(exc.__traceback__)
    result.traceback = "".join(traceback.format_exception(type(exc), exc, tb))


def _user_frames(tb: Any) -> Any:
    """Drop the harness's own frames (and importlib's) from the top of a traceback."""
    while tb is not None and _is_harness_frame(tb.tb_frame):
        tb = tb.tb_next
    return tb


def _is_harness_frame(frame: Any) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name.startswith(
        ("distconform.harness.", "importlib")
    ) or frame.f_code.co_filename.startswith("<frozen importlib")
