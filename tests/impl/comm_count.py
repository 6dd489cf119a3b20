"""Count the collectives an implementation issues, by wrapping ``torch.distributed`` functions.

An interim tool for tests/impl until the harness's comm counter (issue 9) lands. It counts
calls of the three functions FSDP2-style implementations use in torch 2.13, made by the
calling rank while the context is active.

Ranks may be threads of one process (``--launcher thread``), so the module attributes are
wrapped once for all active contexts (installed by the first, restored by the last) and each
call is credited to the counters of the thread that made it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import torch.distributed as dist

COUNTED = ("all_gather_single", "reduce_scatter_single", "all_reduce")

_lock = threading.Lock()
_active = 0
_originals: dict[str, Callable] = {}
_per_thread = threading.local()


def _group_of(name: str, args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
    if "group" in kwargs:
        return kwargs["group"]
    # Positional group: all_gather_single(out, in, group), all_reduce(t, op, group),
    # reduce_scatter_single(out, in, op, group).
    index = {"all_gather_single": 2, "all_reduce": 2, "reduce_scatter_single": 3}[name]
    return args[index] if len(args) > index else None


def _wrap(name: str, original: Callable) -> Callable:
    def counting(*args, **kwargs):
        record = getattr(_per_thread, "record", None)
        if record is not None:
            record(name, dist.get_world_size(_group_of(name, args, kwargs)))
        return original(*args, **kwargs)

    return counting


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Calls per function name."""
    counts: Counter[str] = Counter({name: 0 for name in COUNTED})

    def record(name: str, group_size: int) -> None:
        counts[name] += 1

    with _recording(record):
        yield counts


@contextlib.contextmanager
def trace_collectives() -> Iterator[list[tuple[str, int]]]:
    """``(function name, group size)`` per call, in call order."""
    calls: list[tuple[str, int]] = []
    with _recording(lambda name, size: calls.append((name, size))):
        yield calls


@contextlib.contextmanager
def _recording(record: Callable[[str, int], None]) -> Iterator[None]:
    global _active
    with _lock:
        if _active == 0:
            for name in COUNTED:
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _wrap(name, _originals[name]))
        _active += 1
    previous = getattr(_per_thread, "record", None)
    _per_thread.record = record
    try:
        yield
    finally:
        _per_thread.record = previous
        with _lock:
            _active -= 1
            if _active == 0:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()
