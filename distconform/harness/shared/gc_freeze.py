"""Keeping long-lived objects out of the garbage collector's full collections.

A process that has imported torch and DTensor holds a few hundred thousand objects that
live until it exits. Each full (generation 2) collection walks all of them again, and the
allocations of every test trigger such collections: in the pytest process and in a warm
rank alike, that walk costs more than a trivial test's own work. ``gc.freeze()`` moves
what exists now into a permanent generation that collections skip; objects made later,
the tests' own, are collected as usual.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect what is garbage now, then freeze the rest (idempotent)."""
    gc.collect()
    gc.freeze()
