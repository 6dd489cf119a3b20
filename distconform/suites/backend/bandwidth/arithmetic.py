"""The arithmetic of ``bench-collectives``: sizes and their parsing, the size ladder, each
collective's buffers, nccl-tests' bandwidths, and how many calls to time. No torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
DEFAULT_OPS = OPS[:5]
# Element sizes, so buffer layouts are computed without importing torch.
DTYPE_SIZES = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}
# Fewer calls than this and one scheduler hiccup on a shared CPU decides the mean.
MIN_ITERS = 5

_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
# Binary multiples, as nccl-tests' -b/-e read them (64M is 64 MiB).
_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
}


def parse_bytes(text: str) -> int:
    """``"16"``, ``"4K"``, ``"64M"``, ``"1GiB"`` -> bytes; K, M, G are powers of 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 8, 4K, 64M or 1G")
    unit = match.group(2).lower()
    if unit in ("kb", "mb", "gb"):
        # KB reads as 1000 in some tools and 1024 in others: refuse to guess.
        raise ValueError(
            f"{text!r} is ambiguous; write {match.group(1)}{unit[0].upper()} or "
            f"{match.group(1)}{unit[0].upper()}iB (both powers of 1024)"
        )
    if unit not in _UNITS:
        raise ValueError(f"unknown unit in {text!r}; use B, K, M, G (or KiB, MiB, GiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value)


def format_bytes(size: int) -> str:
    """Exact sizes only: ``1 KiB`` and ``1536 B``, never a rounded ``1.5 KiB``."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


def size_ladder(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes * factor**k`` up to ``max_bytes`` included, as nccl-tests' -b/-e/-f."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min-bytes <= max-bytes, got {min_bytes} and {max_bytes}")
    if factor < 2:
        raise ValueError(f"the step factor must be at least 2, got {factor}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' correction from algorithm bandwidth to bus bandwidth."""
    if op not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}: choose from {', '.join(OPS)}")
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    return _BUS_FACTORS[op](world_size)


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10**9 bytes per second, as nccl-tests)."""
    if seconds <= 0:
        raise ValueError(f"a time must be positive, got {seconds}")
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, size_bytes: int, seconds: float, world_size: int) -> float:
    return algbw_gbps(size_bytes, seconds) * bus_factor(op, world_size)


@dataclass(frozen=True)
class Layout:
    """One message size of one collective: element counts of its buffers and its size ``S``."""

    input_numel: int
    output_numel: int
    size_bytes: int


def layout(op: str, size_bytes: int, world_size: int, itemsize: int) -> Layout:
    """The buffers for a requested size ``S``, rounded down like nccl-tests: the ops that
    split ``S`` into one chunk per rank use whole elements per chunk, at least one."""
    bus_factor(op, world_size)  # validates both
    if op in ("all_reduce", "broadcast", "reduce"):
        numel = max(1, size_bytes // itemsize)
        return Layout(numel, numel, numel * itemsize)
    chunk = max(1, size_bytes // (itemsize * world_size))
    full = chunk * world_size
    if op == "all_gather":
        return Layout(chunk, full, full * itemsize)
    if op == "reduce_scatter":
        return Layout(full, chunk, full * itemsize)
    return Layout(full, full, full * itemsize)  # all_to_all


def layouts_for(op: str, sizes: Iterable[int], world_size: int, itemsize: int) -> list[Layout]:
    """One layout per distinct rounded size (tiny sizes can round to the same buffers)."""
    seen: dict[int, Layout] = {}
    for size in sizes:
        shape = layout(op, size, world_size, itemsize)
        seen.setdefault(shape.size_bytes, shape)
    return sorted(seen.values(), key=lambda shape: shape.size_bytes)


def choose_iters(max_iters: int, estimate_s: float | None, budget_s: float) -> int:
    """Timed calls for one size: ``max_iters``, fewer when they would exceed ``budget_s``
    (by the warm-up's estimate of one call), never fewer than MIN_ITERS (or max_iters)."""
    if estimate_s is None or estimate_s <= 0 or budget_s <= 0:
        return max_iters
    fitting = math.floor(budget_s / estimate_s)
    return min(max_iters, max(min(MIN_ITERS, max_iters), fitting))


def parse_world_sizes(text: str) -> tuple[int, ...]:
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise ValueError(f"world sizes are comma-separated integers, got {text!r}")
        size = int(part)
        if size < 1:
            raise ValueError(f"world size {size}: a world has at least one rank")
        # One rank is allowed, as nccl-tests allows one GPU: the time is the backend's local
        # path (one device's copy), and the bus bandwidth is 0 by the formula.
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise ValueError("no world size given")
    return tuple(sizes)


def parse_ops(text: str) -> tuple[str, ...]:
    ops: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name == "all":
            names = list(DEFAULT_OPS)
        elif name in OPS:
            names = [name]
        else:
            raise ValueError(f"unknown collective {name!r}: choose from {', '.join(OPS)}, all")
        ops += [op for op in names if op not in ops]
    if not ops:
        raise ValueError("no collective given")
    return tuple(ops)
