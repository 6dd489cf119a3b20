"""``python -m harness bench-collectives``: time and bandwidth of a c10d backend's collectives.

For each collective, world size and message size it measures the time of one call and the
two bandwidths nccl-tests reports (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests):

- ``S``, the size, is the full buffer: the all-reduced or broadcast tensor, the gathered
  output of all_gather, the input of reduce_scatter, the whole send buffer of all_to_all;
- ``algbw = S / t``;
- ``busbw = algbw * factor``, the factor being ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
  all_gather, reduce_scatter and all_to_all, ``1`` for broadcast and reduce. It undoes the
  part of ``algbw`` that falls as ranks are added, so busbw is comparable across world
  sizes and with a link's peak bandwidth.

``t`` is the time of one call on the slowest rank: each rank times ``iters`` calls after a
barrier (and a device synchronisation off the CPU) and the maximum of the ranks' means is
reported, since a collective is done only when its last rank is done. nccl-tests averages
over ranks by default (its ``-a 3`` takes the maximum); every rank's mean is kept in the
JSON records, so either can be derived.

Why: a conformance pass says a backend computes the right values, not that it is fast
enough to train with. A vendor's absolute numbers mean little on their own, so unless
``--no-peer`` is given (or the backend is gloo) the same sizes and world sizes are also
measured with gloo on CPU process ranks in the same run, interleaved op by op, and the table
shows both side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PROG = "python -m harness bench-collectives"
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
PEER_BACKEND = "gloo"
PEER_LAUNCHER = "process"
PEER_DEVICE = "cpu"
# 16 B times powers of 4 lands exactly on 16 MiB, and 16 B is one float32 per rank at ws 4,
# so the default ladder needs no rounding at world sizes 2 and 4.
DEFAULT_MIN_BYTES = "16"
DEFAULT_MAX_BYTES = "16M"
DEFAULT_STEP_FACTOR = 4
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
DEFAULT_TIME_BUDGET_S = 0.5
# Fewer calls than this and one scheduler hiccup on a shared CPU decides the mean.
MIN_ITERS = 5
DEFAULT_DEADLINE_S = 300.0

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


# --- pure arithmetic and parsing ------------------------------------------------------------


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
        if size < 2:
            raise ValueError(f"world size {size}: a collective on one rank moves no data")
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


# --- on the ranks ---------------------------------------------------------------------------


def measure_collective(
    op: str,
    layouts: Sequence[tuple[int, int, int]],
    dtype_name: str,
    iters: int,
    warmup: int,
    budget_s: float,
) -> list[dict[str, Any]]:
    """Run on every rank: time ``op`` at each ``(input_numel, output_numel, size_bytes)``;
    return this rank's mean seconds per call and the number of timed calls, per size."""
    import torch
    import torch.distributed as dist

    from harness import get_rank_context

    ctx = get_rank_context()
    device = ctx.device
    dtype = getattr(torch, dtype_name)
    on_accelerator = device.type != "cpu"

    def synchronize() -> None:
        # Device collectives return once queued; only a synchronisation says they are done.
        if on_accelerator:
            torch.accelerator.synchronize(device)

    # As nccl-tests does before a sweep: warm up at the largest size and then the smallest,
    # so the first sizes measured do not pay for a freshly started rank (page faults,
    # lazily made connections, cold caches).
    ends = [layouts[-1], layouts[0]] if len(layouts) > 1 else list(layouts)
    for input_numel, output_numel, _ in ends if warmup else ():
        call = _collective(op, input_numel, output_numel, dtype, device, ctx.rank)
        for _ in range(warmup):
            call()
        synchronize()
        del call
    results = []
    for input_numel, output_numel, size_bytes in layouts:
        call = _collective(op, input_numel, output_numel, dtype, device, ctx.rank)
        estimate = None
        if warmup:
            # The first call may pay for connections and allocations: it is timed only when
            # it is the whole warm-up, and then overestimates, which errs on fewer calls.
            started = time.perf_counter()
            call()
            synchronize()
            mine = time.perf_counter() - started
            if warmup > 1:
                started = time.perf_counter()
                for _ in range(warmup - 1):
                    call()
                synchronize()
                mine = (time.perf_counter() - started) / (warmup - 1)
            # Every rank must time the same number of calls or the last ones never meet: all
            # choose from the ranks' mean (through SUM, which every backend implements).
            agreed = torch.tensor([mine], dtype=torch.float32, device=device)
            dist.all_reduce(agreed)
            estimate = float(agreed.item()) / ctx.world_size
        count = choose_iters(iters, estimate, budget_s)
        dist.barrier()
        synchronize()
        started = time.perf_counter()
        for _ in range(count):
            call()
        synchronize()
        elapsed = time.perf_counter() - started
        results.append({"size_bytes": size_bytes, "iters": count, "mean_s": elapsed / count})
        del call
    return results


def _collective(
    op: str,
    input_numel: int,
    output_numel: int,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    if op in ("all_reduce", "reduce"):
        # In-place sums of zeros stay zero: repeated sums of anything else overflow to inf
        # within a few dozen calls, and non-finite values can take slower paths.
        buffer = torch.zeros(input_numel, dtype=dtype, device=device)
        if op == "all_reduce":
            return lambda: dist.all_reduce(buffer)
        return lambda: dist.reduce(buffer, dst=0)
    source = torch.full((input_numel,), rank + 1, dtype=dtype, device=device)
    if op == "broadcast":
        return lambda: dist.broadcast(source, src=0)
    target = torch.empty(output_numel, dtype=dtype, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_single(target, source)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(target, source)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(target, source)
    raise ValueError(f"unknown collective {op!r}")


# --- in the parent --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A backend as it is run: the launcher that starts its ranks and their device type."""

    backend: str
    launcher: str
    device: str

    def describe(self) -> str:
        return f"{self.backend} ({self.launcher} launcher, {self.device})"


@dataclass
class Record:
    backend: str
    launcher: str
    device: str
    op: str
    world_size: int
    size_bytes: int
    input_elements: int
    output_elements: int
    dtype: str
    iters: int
    warmup: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    rank_time_us: list[float] = field(default_factory=list)


@dataclass
class Failure:
    backend: str
    launcher: str
    device: str
    op: str
    world_size: int
    error: str
    report: str


@dataclass(frozen=True)
class Settings:
    target: Target
    peer: Target | None
    world_sizes: tuple[int, ...]
    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    dtype: str
    iters: int
    warmup: int
    time_budget_s: float
    deadline_s: float
    backend_plugins: tuple[str, ...] = ()


def make_records(
    target: Target,
    op: str,
    world_size: int,
    shapes: Sequence[Layout],
    dtype: str,
    warmup: int,
    per_rank: Sequence[Sequence[dict[str, Any]]],
) -> list[Record]:
    """Combine every rank's timings of one sweep: the slowest rank's mean is the time."""
    records = []
    for index, shape in enumerate(shapes):
        timings = [rank_results[index] for rank_results in per_rank]
        seconds = max(timing["mean_s"] for timing in timings)
        records.append(
            Record(
                backend=target.backend,
                launcher=target.launcher,
                device=target.device,
                op=op,
                world_size=world_size,
                size_bytes=shape.size_bytes,
                input_elements=shape.input_numel,
                output_elements=shape.output_numel,
                dtype=dtype,
                iters=timings[0]["iters"],
                warmup=warmup,
                time_us=seconds * 1e6,
                algbw_gbps=algbw_gbps(shape.size_bytes, seconds),
                busbw_gbps=busbw_gbps(op, shape.size_bytes, seconds, world_size),
                rank_time_us=[timing["mean_s"] * 1e6 for timing in timings],
            )
        )
    return records


def _progress(message: str) -> None:
    print(f"bench-collectives: {message}", file=sys.stderr, flush=True)


def _failure_headline(exc: BaseException) -> str:
    run = getattr(exc, "run", None)
    primary = run.primary_failure() if run is not None else None
    if primary is not None:
        return f"rank {primary.rank} {primary.outcome.value}: {primary.summary()}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


@contextlib.contextmanager
def _flight_recorder_off() -> Iterator[None]:
    """The harness's always-on collective trace writes a JSON line per call in the ranks
    (about 0.2 ms per call with thread ranks on a small machine): diagnostics a benchmark
    must not time. Ranks inherit the parent's environment; the caller's is restored."""
    from harness.comm.flight import FLIGHT_ENV

    saved = os.environ.get(FLIGHT_ENV)
    os.environ[FLIGHT_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FLIGHT_ENV, None)
        else:
            os.environ[FLIGHT_ENV] = saved


def run_benchmark(settings: Settings) -> tuple[list[Record], list[Failure]]:
    """Measure every (world size, op) on the target and then on the peer, alternating, so
    a slow spell of the machine does not land on one backend only."""
    with _flight_recorder_off():
        return _run_benchmark(settings)


def _run_benchmark(settings: Settings) -> tuple[list[Record], list[Failure]]:
    from harness import ConfigError, DistributedFailure, run_on_ranks

    itemsize = DTYPE_SIZES[settings.dtype]
    targets = [settings.target] + ([settings.peer] if settings.peer else [])
    records: list[Record] = []
    failures: list[Failure] = []
    for world_size in settings.world_sizes:
        for op in settings.ops:
            shapes = layouts_for(op, settings.sizes, world_size, itemsize)
            for target in targets:
                started = time.monotonic()
                try:
                    per_rank = run_on_ranks(
                        measure_collective,
                        world_size,
                        (
                            op,
                            [(s.input_numel, s.output_numel, s.size_bytes) for s in shapes],
                            settings.dtype,
                            settings.iters,
                            settings.warmup,
                            settings.time_budget_s,
                        ),
                        launcher=target.launcher,
                        backend=target.backend,
                        device=target.device,
                        deadline=settings.deadline_s,
                        # One torch thread per rank everywhere (the thread launcher's host
                        # always runs one), so the backends differ only in how they move data.
                        threads_per_rank=1,
                    )
                except (DistributedFailure, ConfigError) as exc:
                    headline = _failure_headline(exc)
                    failures.append(
                        Failure(
                            target.backend,
                            target.launcher,
                            target.device,
                            op,
                            world_size,
                            headline,
                            str(exc),
                        )
                    )
                    _progress(f"{target.backend} ws {world_size} {op}: FAILED: {headline}")
                    continue
                records += make_records(
                    target, op, world_size, shapes, settings.dtype, settings.warmup, per_rank
                )
                plural = "s" if len(shapes) != 1 else ""
                _progress(
                    f"{target.backend} ws {world_size} {op}: {len(shapes)} size{plural} in "
                    f"{time.monotonic() - started:.1f} s"
                )
    return records, failures


# --- output ---------------------------------------------------------------------------------


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


def _load_average() -> list[float] | None:
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def environment(settings: Settings) -> dict[str, Any]:
    """Where and how the numbers were taken, as the run starts. The load average is kept
    because other work on the host skews the times, small messages most."""
    import torch

    from harness.config import available_cores

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
        "load_average_at_start": _load_average(),
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


# --- command line ---------------------------------------------------------------------------


def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError: its message, no traceback."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise ValueError("expected a positive number of seconds, got 0")
    return value


def _dtype(text: str) -> str:
    if text not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {text!r}: choose from {', '.join(DTYPE_SIZES)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Bandwidth and latency of a c10d backend's collectives, reported as "
        "nccl-tests does (time, algbw, busbw), with gloo measured alongside as a baseline.",
    )
    parser.add_argument(
        "--backend", help="c10d backend to measure (default: the launcher's and device's)"
    )
    parser.add_argument(
        "--backend-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers a c10d backend; imported in every rank (repeatable)",
    )
    parser.add_argument(
        "--launcher", default="process", choices=("process", "thread"), help="default: process"
    )
    parser.add_argument("--device", default="cpu", help="device type of the ranks (default: cpu)")
    parser.add_argument(
        "--world-sizes",
        type=_argument(parse_world_sizes),
        default=(2, 4),
        metavar="N[,N...]",
        help="default: 2,4",
    )
    parser.add_argument(
        "--ops",
        type=_argument(parse_ops),
        default=DEFAULT_OPS,
        metavar="OP[,OP...]",
        help=f"from {', '.join(OPS)}; 'all' for the first five (default)",
    )
    parser.add_argument(
        "--min-bytes",
        type=_argument(parse_bytes),
        default=parse_bytes(DEFAULT_MIN_BYTES),
        metavar="SIZE",
        help=f"smallest message; K, M, G are powers of 1024 (default: {DEFAULT_MIN_BYTES})",
    )
    parser.add_argument(
        "--max-bytes",
        type=_argument(parse_bytes),
        default=parse_bytes(DEFAULT_MAX_BYTES),
        metavar="SIZE",
        help=f"largest message (default: {DEFAULT_MAX_BYTES})",
    )
    parser.add_argument(
        "--step-factor",
        type=_argument(_positive_int),
        default=DEFAULT_STEP_FACTOR,
        metavar="F",
        help=f"multiply the size by F between steps (default: {DEFAULT_STEP_FACTOR})",
    )
    parser.add_argument(
        "--iters",
        type=_argument(_positive_int),
        default=DEFAULT_ITERS,
        metavar="N",
        help=f"timed calls per size, at most (default: {DEFAULT_ITERS})",
    )
    parser.add_argument(
        "--warmup",
        type=_argument(_count),
        default=DEFAULT_WARMUP,
        metavar="N",
        help=f"untimed calls per size first (default: {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--time-budget",
        type=_argument(_seconds),
        default=DEFAULT_TIME_BUDGET_S,
        metavar="SECONDS",
        help=f"per size, time the calls that fit (estimated from the warm-up), at least "
        f"{MIN_ITERS}; 0 always times --iters (default: {DEFAULT_TIME_BUDGET_S:g})",
    )
    parser.add_argument(
        "--dtype",
        type=_argument(_dtype),
        default="float32",
        help=f"one of {', '.join(DTYPE_SIZES)} (default: float32)",
    )
    parser.add_argument(
        "--deadline",
        type=_argument(_positive_seconds),
        default=DEFAULT_DEADLINE_S,
        metavar="SECONDS",
        help=f"limit for one op's sweep at one world size (default: {DEFAULT_DEADLINE_S:g})",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every record as JSON")
    parser.add_argument(
        "--no-peer", action="store_true", help=f"do not measure {PEER_BACKEND} alongside"
    )
    return parser


class UsageError(ValueError):
    """The command line asks for something that cannot run; nothing was measured."""


def resolve_settings(options: argparse.Namespace) -> Settings:
    """Check everything that can be checked before a rank starts. Raises UsageError."""
    # torch only from here: --help and argument errors answer before it loads.
    from harness.backend_plugins import BackendPluginError, activate
    from harness.config import ConfigError, check_device_type, device_count, resolve_backend

    try:
        sizes = size_ladder(options.min_bytes, options.max_bytes, options.step_factor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if options.json:
        folder = Path(options.json).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--json {options.json}: the folder {folder} does not exist")
    try:
        plugins = activate(options.backend_plugin)
        device = check_device_type(options.device)
        backend = resolve_backend(options.launcher, options.backend, device)
        peer_backend = resolve_backend(PEER_LAUNCHER, PEER_BACKEND, PEER_DEVICE)
    except (ConfigError, BackendPluginError) as exc:
        raise UsageError(str(exc)) from None
    available = device_count(device)
    if available is not None and available < max(options.world_sizes):
        largest = max(options.world_sizes)
        raise UsageError(
            f"world size {largest} needs {largest} {device} devices (one per rank), this "
            f"machine has {available}"
        )
    peer = None
    if not options.no_peer and backend != PEER_BACKEND:
        peer = Target(peer_backend, PEER_LAUNCHER, PEER_DEVICE)
    return Settings(
        target=Target(backend, options.launcher, device),
        peer=peer,
        world_sizes=options.world_sizes,
        ops=options.ops,
        sizes=tuple(sizes),
        dtype=options.dtype,
        iters=options.iters,
        warmup=options.warmup,
        time_budget_s=options.time_budget,
        deadline_s=options.deadline,
        backend_plugins=tuple(plugins),
    )


def main(argv: list[str]) -> int:
    """Exit status: 0 when every measurement ran, 1 when one failed, 2 for a usage error."""
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argument error (2), already printed
        return int(exc.code or 0)
    try:
        settings = resolve_settings(options)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    measured = settings.target.describe()
    if settings.peer:
        measured += f" and {settings.peer.describe()}"
    _progress(
        f"measuring {measured} at ws {','.join(map(str, settings.world_sizes))}: "
        f"{len(settings.ops)} ops, {format_bytes(settings.sizes[0])} to "
        f"{format_bytes(settings.sizes[-1])}"
    )
    env = environment(settings)
    started = time.monotonic()
    records, failures = run_benchmark(settings)
    env["wall_s"] = round(time.monotonic() - started, 1)
    env["load_average_at_end"] = _load_average()
    _progress(f"done in {env['wall_s']} s")
    sys.stdout.write(render_table(settings, records, failures))
    sys.stdout.flush()
    if options.json:
        document = json_document(settings, env, records, failures)
        Path(options.json).write_text(json.dumps(document, indent=2) + "\n")
        _progress(f"wrote {options.json}")
    if failures:
        hint = (
            f"the full reports are in {options.json}"
            if options.json
            else "--json FILE keeps the full reports"
        )
        _progress(f"{len(failures)} sweep(s) failed; {hint}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
