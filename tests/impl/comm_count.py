"""Count the collectives an implementation issues, by wrapping ``torch.distributed`` functions.

An interim tool for tests/impl until the harness's comm counter (issue 9) lands. It counts
calls of the three functions FSDP2-style implementations use in torch 2.13, in this rank
only, while the context is active.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch.distributed as dist

COUNTED = ("all_gather_single", "reduce_scatter_single", "all_reduce")


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter({name: 0 for name in COUNTED})
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name: str):
        original = originals[name]

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
