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


def _wrap(name: str, original: Callable) -> Callable:
    def counting(*args, **kwargs):
        counts = getattr(_per_thread, "counts", None)
        if counts is not None:
            counts[name] += 1
        return original(*args, **kwargs)

    return counting


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    global _active
    counts: Counter[str] = Counter({name: 0 for name in COUNTED})
    with _lock:
        if _active == 0:
            for name in COUNTED:
                _originals[name] = getattr(dist, name)
                setattr(dist, name, _wrap(name, _originals[name]))
        _active += 1
    previous = getattr(_per_thread, "counts", None)
    _per_thread.counts = counts
    try:
        yield counts
    finally:
        _per_thread.counts = previous
        with _lock:
            _active -= 1
            if _active == 0:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()
