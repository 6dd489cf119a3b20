"""The output of ``bench-collectives``: the plain-text table, and the JSON document with
the environment the numbers were taken in.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from distconform.suites.backend.bandwidth.arithmetic import (
    DTYPE_SIZES,
    MIN_ITERS,
    format_bytes,
    layouts_for,
)
from distconform.suites.backend.bandwidth.measure import Failure, Record, Settings

PROG = "python -m distconform bench-collectives"


def _time_text(us: float) -> str:
    # nccl-tests' precision: fewer decimals as the time grows.
    if us >= 10000:
        return f"{us:.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _cells(record: Record | None, failed: bool) -> list[str]:
    if record is None:
        return ["failed" if failed else "-", "", ""]
    return [_time_text(record.time_us), f"{record.algbw_gbps:.3f}", f"{record.busbw_gbps:.3f}"]


def render_table(settings: Settings, records: Sequence[Record], failures: Sequence[Failure]) -> str:
    """The plain-text table: one row per (op, ws, size), the peer's columns beside."""
    target, peer = settings.target, settings.peer
    found = {(r.backend, r.op, r.world_size, r.size_bytes): r for r in records}
    failed = {(f.backend, f.op, f.world_size) for f in failures}
    itemsize = DTYPE_SIZES[settings.dtype]
    widths = [14, 3, 9] + [10, 8, 8] + ([10, 8, 8, 7] if peer else [])
    aligns = ["<"] + [">"] * (len(widths) - 1)

    def row(cells: Sequence[str]) -> str:
        text = "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, aligns, widths, strict=True))
        return text.rstrip()

    iterations = f"{settings.iters} timed calls per size after {settings.warmup} warm-up calls"
    if settings.time_budget_s > 0:
        iterations += f" (fewer past {settings.time_budget_s:g} s, at least "
        iterations += f"{min(MIN_ITERS, settings.iters)})"
    lines = [
        f"# {PROG}: {target.describe()}" + (f" vs {peer.describe()}" if peer else ""),
        f"# {settings.dtype}; {iterations}; 1 torch thread per rank",
        "# time: slowest rank's mean per call; algbw = size / time; "
        "busbw = algbw * nccl-tests' factor",
    ]
    if peer:
        lines.append(
            f"# ratio: {peer.backend} time / {target.backend} time "
            f"(above 1: {target.backend} is faster)"
        )
    lines.append("#")
    # Each backend's name centred over its three columns (time, algbw, busbw).
    block = sum(widths[3:6]) + 2 * 2
    groups = " " * (sum(widths[:3]) + 3 * 2) + f"{target.backend:^{block}}"
    if peer:
        groups += "  " + f"{peer.backend:^{block}}"
    lines.append(groups.rstrip())
    header = ["op", "ws", "size", "time", "algbw", "busbw"]
    units = ["", "", "", "(us)", "(GB/s)", "(GB/s)"]
    if peer:
        header += ["time", "algbw", "busbw", "ratio"]
        units += ["(us)", "(GB/s)", "(GB/s)", ""]
    lines += [row(header), row(units)]
    for world_size in settings.world_sizes:
        for op in settings.ops:
            lines.append("")
            for shape in layouts_for(op, settings.sizes, world_size, itemsize):
                mine = found.get((target.backend, op, world_size, shape.size_bytes))
                cells = [op, str(world_size), format_bytes(shape.size_bytes)]
                cells += _cells(mine, (target.backend, op, world_size) in failed)
                if peer:
                    theirs = found.get((peer.backend, op, world_size, shape.size_bytes))
                    cells += _cells(theirs, (peer.backend, op, world_size) in failed)
                    ratio = f"{theirs.time_us / mine.time_us:.2f}" if mine and theirs else "-"
                    cells.append(ratio)
                lines.append(row(cells))
    return "\n".join(lines) + "\n"


def load_average() -> list[float] | None:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def environment(settings: Settings) -> dict[str, Any]:
    """Where and how the numbers were taken, as the run starts. The load average is kept
    because other work on the host skews the times, small messages most."""
    import torch

    from distconform.extension import available_cores

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host_cpu_count": os.cpu_count(),
        "available_cores": available_cores(),
        "threads_per_rank": 1,
        "harness_flight_recorder": "off",
        "backend": settings.target.backend,
        "launcher": settings.target.launcher,
        "device": settings.target.device,
        "backend_plugins": list(settings.backend_plugins),
        "peer": asdict(settings.peer) if settings.peer else None,
        "load_average_at_start": load_average(),
    }


def json_document(
    settings: Settings,
    env: dict[str, Any],
    records: Sequence[Record],
    failures: Sequence[Failure],
) -> dict[str, Any]:
    return {
        "environment": env,
        "settings": {
            "world_sizes": list(settings.world_sizes),
            "ops": list(settings.ops),
            "sizes_requested": list(settings.sizes),
            "dtype": settings.dtype,
            "iters": settings.iters,
            "min_iters": min(MIN_ITERS, settings.iters),
            "warmup": settings.warmup,
            "time_budget_s": settings.time_budget_s,
            "time": "max over ranks of each rank's mean seconds per call",
        },
        "records": [asdict(record) for record in records],
        "failures": [asdict(failure) for failure in failures],
    }
