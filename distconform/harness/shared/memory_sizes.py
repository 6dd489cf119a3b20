"""Memory sizes as users write them, and recognising a rank that ran out of memory.

The parent's side of per-rank memory limits; the rank applies them with
:mod:`distconform.harness.rank.memory_limit`.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}
_OOM_MARKERS = ("can't allocate memory", "not enough memory", "out of memory", "bad_alloc")


def parse_size(text: str | int) -> int:
    """``"512MiB"``, ``"2 GB"``, ``1048576`` → bytes."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {text!r} as a memory size; write e.g. 512MiB, 2GiB or 1000000"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory limit must be positive, got {text!r}")
    return size


def format_size(size: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size / factor:g} {unit}"
    return f"{size} B"


def looks_like_out_of_memory(error_type: str | None, message: str | None) -> bool:
    if error_type == "MemoryError":
        return True
    text = (message or "").lower()
    return any(marker in text for marker in _OOM_MARKERS)
