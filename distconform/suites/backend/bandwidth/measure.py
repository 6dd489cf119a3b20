"""The measurement of ``bench-collectives``: ``measure_collective`` times the collectives
inside the ranks; ``run_benchmark`` sweeps backends, world sizes and ops from the parent
through ``harness.run_on_ranks`` and combines the ranks' timings into records.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distconform.suites.backend.bandwidth.arithmetic import (
    DTYPE_SIZES,
    Layout,
    algbw_gbps,
    busbw_gbps,
    choose_iters,
    layouts_for,
)

if TYPE_CHECKING:
    import torch


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

    from distconform.api import get_rank_context

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

    from distconform.api import torch_api

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
        return lambda: torch_api.all_gather_single(target, source)
    if op == "reduce_scatter":
        return lambda: torch_api.reduce_scatter_single(target, source)
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
    share_devices: bool = False


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


def progress(message: str) -> None:
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
    from distconform.extension import FLIGHT_ENV

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
    from distconform.api import ConfigError, DistributedFailure, run_on_ranks

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
                        share_devices=settings.share_devices,
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
                    progress(f"{target.backend} ws {world_size} {op}: FAILED: {headline}")
                    continue
                records += make_records(
                    target, op, world_size, shapes, settings.dtype, settings.warmup, per_rank
                )
                plural = "s" if len(shapes) != 1 else ""
                progress(
                    f"{target.backend} ws {world_size} {op}: {len(shapes)} size{plural} in "
                    f"{time.monotonic() - started:.1f} s"
                )
    return records, failures
