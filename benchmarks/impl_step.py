"""Training-step time, memory and traffic of the reference implementation next to torch's FSDP2.

For every world size (gloo process ranks, one torch thread per rank), model (the 4-layer
Transformer and ``MLPStack(256)``) and ``reshard_after_forward`` value, three *arms* train the
same model (same seed, same data) with AdamW, sharded the same way (each block, then the root):

* ``reference``: ``distconform.impl.reference``;
* ``torch``: torch's ``fully_shard``;
* ``torch_aa``: a second, independent torch instance. ``torch_aa / torch`` is the A/A ratio:
  the spread a ratio shows when nothing differs, i.e. the noise floor of this machine now.

Time. The arms run in interleaved blocks (one run of each arm per block; the order rotates
through the six permutations so no arm always goes first). A run is ``--warmup-per-run`` untimed
steps (caches and the allocator settle after the other arms ran) and ``--steps`` timed steps
between two barriers; a run's time is the slowest rank's mean step. Per block the paired ratio is
``reference / torch``; the table gives the median over blocks and a bootstrap 95 % interval of
that median (pairs resampled with replacement). Pairing cancels what drifts slowly (other load on
the machine); the A/A row shows what is left.

Why ``harness.run_on_ranks`` and not a fresh ``torch.multiprocessing`` world per run: all arms
of one world size run in the same rank processes, so A and B see the same interpreter, allocator
and gloo connections, and nothing is started between timed runs. The harness gives each rank
one torch thread and a private rendezvous; its per-collective flight recorder is switched off
(``DISTCONFORM_COMM_FLIGHT=0``) so that nothing but the arms runs in the ranks.

Memory on the CPU, measured after all timing (it changes the allocator's settings): glibc's
``malloc`` is told to serve every block of 64 KiB or more with ``mmap`` (``mallopt``), so freed
tensors go back
to the OS and RSS follows live memory; then, for each arm in turn, the model is built and
sharded and its optimizer made (the post-init baseline, ``VmRSS``), the peak RSS counter is reset
(``/proc/self/clear_refs``) and ``--mem-steps`` steps run; peak above baseline = ``VmHWM`` minus
the baseline, the largest over ranks. The implementations alternate ``--mem-repeats`` times and
the median counts (small allocations still come from the heap: a few MiB of run-to-run noise).
Sharded parameter bytes per rank: the bytes of the distinct storages behind the sharded
parameters' local tensors (padding included), against ``ceil(N / ws)`` parameters' worth (``N``
= distinct parameter elements of the model).

Traffic: one extra step per arm inside ``distconform.harness.comm.CommTracer``. Bytes moved per rank
are taken from the sizes of the tensors the collectives were called with, not from the tracer's
``wire_bytes``: an all-gather moves what its output has beyond its input, a reduce-scatter what its
input has beyond its output. The expectation is ``distconform.harness.comm.min_bytes_per_rank``
applied to the parameter shapes of each ``fully_shard`` call, read from the unsharded model before
sharding, with the all-gather counted once more for every group that reshards after forward.

    python benchmarks/impl_step.py --out impl_step.json            # the full benchmark
    python benchmarks/impl_step.py --world-sizes 2 --models mlp --raf true --pairs 3 --steps 3

On an accelerator (``--device cuda``, any device type torch.accelerator knows), the model, data
and mesh live on each rank's device, every timed run ends with ``torch.accelerator.synchronize``,
and memory is the device allocator's: the peak of ``max_memory_allocated`` over the steps above
``memory_allocated`` after init (per rank process, so ranks sharing one device with
``--share-devices`` each count their own). ``--backend`` picks the process-group backend
(default: the device's).

``--profile DIR`` also runs ``--profile-steps`` steps of each implementation under cProfile on
rank 0 and writes ``DIR/<ws>-<model>-raf<value>-<impl>.pstats`` plus the top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import datetime
import gc
import itertools
import json
import math
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("transformer", "mlp")
ARMS = ("torch", "reference", "torch_aa")
IMPL_OF_ARM = {"torch": "torch", "reference": "reference", "torch_aa": "torch"}
# Each block runs the arms in one of these orders, cycling.
ORDERS = tuple(itertools.permutations(ARMS))
BATCH, SEQ_LEN, DIM, VOCAB, LAYERS, HEADS = 4, 64, 256, 1024, 4, 4
MMAP_THRESHOLD_BYTES = 64 * 1024
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


@dataclass(frozen=True)
class Case:
    model: str
    raf: bool

    @property
    def label(self) -> str:
        return f"{self.model}-raf{str(self.raf).lower()}"


@dataclass(frozen=True)
class Options:
    cases: tuple[Case, ...]
    pairs: int
    steps: int
    warmup: int
    warmup_per_run: int
    mem_steps: int
    mem_repeats: int
    profile_dir: str | None
    profile_steps: int
    device_type: str = "cpu"


# --- the workload ------------------------------------------------------------------------


class Workload:
    """One arm: a model sharded by one implementation, its optimizer and its data."""

    def __init__(self, case: Case, impl_spec: str, mesh: Any, rank: int, device: Any) -> None:
        import torch

        from distconform.impl.api import load_implementation

        impl = load_implementation(impl_spec)
        with torch.device(device):
            self.model, self.blocks = build_model(case.model)
        self.groups = parameter_groups(self.model, self.blocks)
        self.param_elements = sum(p.numel() for p in _distinct(self.model.parameters()))
        for block in self.blocks:
            impl.fully_shard(block, mesh=mesh, reshard_after_forward=case.raf)
        impl.fully_shard(self.model, mesh=mesh, reshard_after_forward=case.raf)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        # Different data per rank (so gradient averaging is real), the same for every arm.
        data = torch.Generator().manual_seed(1000 + rank)
        # Drawn on the CPU (one generator for every device type), then moved.
        if case.model == "transformer":
            inputs = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=data, device="cpu")
            targets = torch.randint(0, VOCAB, (BATCH * SEQ_LEN,), generator=data, device="cpu")
        else:
            inputs = torch.randn(BATCH * SEQ_LEN, DIM, generator=data, device="cpu")
            targets = torch.randn(BATCH * SEQ_LEN, DIM, generator=data, device="cpu")
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.is_transformer = case.model == "transformer"

    def step(self) -> None:
        import torch.nn.functional as F

        output = self.model(self.inputs)
        if self.is_transformer:
            loss = F.cross_entropy(output.view(-1, VOCAB), self.targets)
        else:
            loss = F.mse_loss(output, self.targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sharded_storage_bytes(self) -> int:
        """Bytes of the distinct storages behind this rank's sharded parameters."""
        storages: dict[int, int] = {}
        for param in self.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def build_model(name: str) -> tuple[Any, list[Any]]:
    """The model (seeded, so every arm starts from the same weights) and its blocks."""
    import torch

    from distconform.suites.models import MLPStack, ModelArgs, Transformer

    torch.manual_seed(0)
    if name == "transformer":
        args = ModelArgs(
            n_layers=LAYERS,
            vocab_size=VOCAB,
            max_seq_len=SEQ_LEN,
            dim=DIM,
            n_heads=HEADS,
            # Dropout only adds the same random-number work to every arm.
            dropout_p=0.0,
        )
        model = Transformer(args)
        return model, list(model.layers)
    if name == "mlp":
        model = MLPStack(DIM)
        return model, list(model)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def parameter_groups(model: Any, blocks: Sequence[Any]) -> list[list[tuple[int, ...]]]:
    """Parameter shapes per ``fully_shard`` call (blocks first, then what the root keeps)."""
    seen: set[int] = set()
    groups = []
    for module in [*blocks, model]:
        shapes = []
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                shapes.append(tuple(param.shape))
        if shapes:
            groups.append(shapes)
    return groups


def _distinct(params: Any) -> list[Any]:
    unique: dict[int, Any] = {}
    for param in params:
        unique.setdefault(id(param), param)
    return list(unique.values())


# --- inside every rank -------------------------------------------------------------------


def run_rank(options: Options) -> dict[str, Any]:
    """Everything one rank measures, for every case: times, traffic, memory, profiles."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distconform.harness import get_rank_context

    ctx = get_rank_context()
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    mesh = init_device_mesh(ctx.device_type, (world_size,))
    results: dict[str, Any] = {"threads": torch.get_num_threads(), "cases": {}}
    for case in options.cases:
        arms = {arm: Workload(case, IMPL_OF_ARM[arm], mesh, rank, device) for arm in ARMS}
        for workload in arms.values():
            for _ in range(options.warmup):
                workload.step()
        traffic = {arm: measure_traffic(workload, mesh) for arm, workload in arms.items()}
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for block in range(options.pairs):
            for arm in ORDERS[block % len(ORDERS)]:
                times[arm].append(timed_run(arms[arm], options, dist, device))
        profile = None
        if options.profile_dir is not None:
            profile = {
                impl: profile_run(arms[impl], options, case, world_size, impl, rank)
                for impl in ("torch", "reference")
            }
        results["cases"][case.label] = {
            "times_s": times,
            "traffic": traffic,
            "groups": arms["reference"].groups,
            "param_elements": arms["reference"].param_elements,
            "sharded_storage_bytes": {
                arm: arms[arm].sharded_storage_bytes() for arm in ("torch", "reference")
            },
            "profile": profile,
        }
        del arms
        gc.collect()
    if device.type == "cpu":
        _serve_large_blocks_with_mmap()
    for case in options.cases:
        peaks: dict[str, list[int]] = {"torch": [], "reference": []}
        # Alternating repeats: what the allocator keeps from one run lands on both sides.
        for _ in range(options.mem_repeats):
            for impl in peaks:
                peaks[impl].append(
                    measure_memory(case, impl, mesh, rank, options.mem_steps, dist, device)
                )
        results["cases"][case.label]["peak_rss_above_baseline"] = peaks
    return results


def timed_run(workload: Workload, options: Options, dist: Any, device: Any) -> float:
    """Mean seconds per step of one run, as seen by the slowest rank."""
    import torch

    for _ in range(options.warmup_per_run):
        workload.step()
    _settle(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(options.steps):
        workload.step()
    _settle(device)
    dist.barrier()
    # On the rank's device: NCCL reduces device tensors only.
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / options.steps


def measure_traffic(workload: Workload, mesh: Any) -> dict[str, int]:
    """Calls and bytes moved by this rank in one step, from the collectives' tensor sizes."""
    from distconform.harness.comm import CommTracer

    with CommTracer(mesh=mesh, functional=False) as trace:
        workload.step()
    moved = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "other": 0}
    calls = {kind: 0 for kind in moved}
    for call in trace.calls:
        if call.kind == "barrier":
            continue
        if call.kind == "all_gather":
            # What this rank lacked: every other rank's piece.
            moved["all_gather"] += call.out_nbytes - call.nbytes
        elif call.kind == "reduce_scatter":
            # What this rank must hand over: every other rank's piece.
            moved["reduce_scatter"] += call.nbytes - call.out_nbytes
        elif call.kind == "all_reduce":
            size = mesh.size()
            moved["all_reduce"] += 2 * call.nbytes * (size - 1) // size
        else:
            moved["other"] += call.nbytes
        calls[call.kind if call.kind in calls else "other"] += 1
    return {
        **{f"{k}_bytes": v for k, v in moved.items()},
        **{f"{k}_calls": v for k, v in calls.items()},
    }


def _settle(device: Any) -> None:
    """Wait for the work queued on an accelerator: its steps end when the device is done."""
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_memory(
    case: Case, impl: str, mesh: Any, rank: int, steps: int, dist: Any, device: Any
) -> int:
    """Peak memory above the post-init baseline over ``steps`` steps (bytes, largest rank):
    RSS on the CPU, the device allocator's statistics on an accelerator."""
    import torch

    gc.collect()
    workload = Workload(case, impl, mesh, rank, device)
    gc.collect()
    if device.type != "cpu":
        above_bytes = _device_peak_above_baseline(workload, steps, dist, device)
        del workload
        gc.collect()
        above = torch.tensor([above_bytes], dtype=torch.int64, device=device)
        dist.all_reduce(above, op=dist.ReduceOp.MAX)
        return int(above.item())
    # Free heap pages left by earlier work would otherwise absorb this run's allocations.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(steps):
        workload.step()
    peak = _status_kib("VmHWM")
    del workload
    gc.collect()
    above = torch.tensor([(peak - baseline) * 1024], dtype=torch.int64)
    dist.all_reduce(above, op=dist.ReduceOp.MAX)
    return int(above.item())


def _device_peak_above_baseline(workload: Workload, steps: int, dist: Any, device: Any) -> int:
    import torch

    _settle(device)
    dist.barrier()
    baseline = torch.accelerator.memory_allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    for _ in range(steps):
        workload.step()
    _settle(device)
    return torch.accelerator.max_memory_allocated(device) - baseline


def _serve_large_blocks_with_mmap() -> None:
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed; RSS would not follow live memory")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} (needs Linux)")


def profile_run(
    workload: Workload, options: Options, case: Case, world_size: int, impl: str, rank: int
) -> list[dict[str, Any]] | None:
    """cProfile ``profile_steps`` steps on rank 0 (the others run them unprofiled)."""
    workload.step()
    if rank != 0:
        for _ in range(options.profile_steps):
            workload.step()
        return None
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(options.profile_steps):
        workload.step()
    profiler.disable()
    assert options.profile_dir is not None
    path = Path(options.profile_dir) / f"ws{world_size}-{case.label}-{impl}.pstats"
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(path))
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({name})",
                "calls_per_step": nc / options.profile_steps,
                "self_share": tt / total if total else 0.0,
                "cumulative_share": ct / total if total else 0.0,
            }
        )
    rows.sort(key=lambda r: r["self_share"], reverse=True)
    return [{"total_s_per_step": total / options.profile_steps}, *rows[:25]]


# --- statistics and reporting ------------------------------------------------------------


def bootstrap_median_interval(
    values: Sequence[float], *, resamples: int = 10000, seed: int = 0
) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return medians[int(0.025 * (resamples - 1))], medians[math.ceil(0.975 * (resamples - 1))]


def expected_traffic(
    groups: list[list[tuple[int, ...]]], world_size: int, raf: bool
) -> dict[str, int]:
    """The minimum bytes per rank per step: one all-gather per group (two if it reshards
    after forward) and one reduce-scatter per group, fp32."""
    from distconform.harness.comm import min_bytes_per_rank

    minimum = min_bytes_per_rank(groups, shard_size=world_size)
    gathers = 2 if raf else 1
    gather_calls = len(groups) * gathers if world_size > 1 else 0
    return {
        "all_gather_bytes": minimum.all_gather * gathers,
        "reduce_scatter_bytes": minimum.reduce_scatter,
        "all_reduce_bytes": minimum.all_reduce,
        "all_gather_calls": gather_calls,
        "reduce_scatter_calls": len(groups) if world_size > 1 else 0,
    }


def summarise(world_size: int, case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    data = per_rank[0]["cases"][case.label]
    times = data["times_s"]
    ratios = [r / t for r, t in zip(times["reference"], times["torch"], strict=True)]
    noise = [a / t for a, t in zip(times["torch_aa"], times["torch"], strict=True)]
    expected = expected_traffic([list(map(tuple, g)) for g in data["groups"]], world_size, case.raf)
    traffic = {}
    for impl in ("torch", "reference"):
        measured = [r["cases"][case.label]["traffic"][impl] for r in per_rank]
        moved = max(
            m["all_gather_bytes"]
            + m["reduce_scatter_bytes"]
            + m["all_reduce_bytes"]
            + m["other_bytes"]
            for m in measured
        )
        formula = (
            expected["all_gather_bytes"]
            + expected["reduce_scatter_bytes"]
            + expected["all_reduce_bytes"]
        )
        traffic[impl] = {
            "per_rank": measured,
            "moved_bytes": moved,
            "formula_bytes": formula,
            "ratio": moved / formula if formula else (1.0 if moved == 0 else math.inf),
        }
    ideal = math.ceil(data["param_elements"] / world_size) * 4
    shard_bytes = {
        impl: max(r["cases"][case.label]["sharded_storage_bytes"][impl] for r in per_rank)
        for impl in ("torch", "reference")
    }
    peaks = data["peak_rss_above_baseline"]
    peak = {impl: statistics.median(values) for impl, values in peaks.items()}
    lo, hi = bootstrap_median_interval(ratios)
    aa_lo, aa_hi = bootstrap_median_interval(noise)
    return {
        "world_size": world_size,
        "model": case.model,
        "raf": case.raf,
        "times_s": times,
        "ratio": {"pairs": ratios, "median": statistics.median(ratios), "ci95": [lo, hi]},
        "aa_ratio": {"pairs": noise, "median": statistics.median(noise), "ci95": [aa_lo, aa_hi]},
        "median_ms": {arm: 1e3 * statistics.median(v) for arm, v in times.items()},
        "peak_rss_above_baseline_bytes": peak,
        "peak_rss_above_baseline_runs": peaks,
        "peak_ratio": peak["reference"] / peak["torch"] if peak["torch"] else math.nan,
        "sharded_storage_bytes": shard_bytes,
        "ideal_shard_bytes": ideal,
        "expected_traffic": expected,
        "traffic": traffic,
        "profile": {impl: data["profile"][impl] for impl in ("torch", "reference")}
        if data["profile"]
        else None,
    }


def format_tables(rows: list[dict[str, Any]]) -> str:
    time_lines = [
        "| ws | model | raf | ratio | median | 95 % CI | ms/step (numerator) | ms/step torch |",
        "|---:|---|---|---|---:|---|---:|---:|",
    ]
    other_lines = [
        "| ws | model | raf | peak memory above baseline MiB ref / torch (ratio; RSS, or the "
        "device allocator's on an accelerator) "
        "| sharded bytes/rank ref / torch / ceil(N/ws) | bytes/rank/step ref / torch / formula "
        "| ratio ref, torch |",
        "|---:|---|---|---|---|---|---|",
    ]
    for r in rows:
        for label, key, arm in (
            ("reference / torch", "ratio", "reference"),
            ("torch / torch (A/A)", "aa_ratio", "torch_aa"),
        ):
            stats = r[key]
            time_lines.append(
                f"| {r['world_size']} | {r['model']} | {r['raf']} | {label} "
                f"| {stats['median']:.3f} "
                f"| [{stats['ci95'][0]:.3f}, {stats['ci95'][1]:.3f}] "
                f"| {r['median_ms'][arm]:.1f} | {r['median_ms']['torch']:.1f} |"
            )
        peak = r["peak_rss_above_baseline_bytes"]
        shard = r["sharded_storage_bytes"]
        traffic = r["traffic"]
        other_lines.append(
            f"| {r['world_size']} | {r['model']} | {r['raf']} "
            f"| {peak['reference'] / 2**20:.1f} / {peak['torch'] / 2**20:.1f} "
            f"({r['peak_ratio']:.3f}) "
            f"| {shard['reference']} / {shard['torch']} / {r['ideal_shard_bytes']} "
            f"| {traffic['reference']['moved_bytes']} / {traffic['torch']['moved_bytes']} "
            f"/ {traffic['reference']['formula_bytes']} "
            f"| {traffic['reference']['ratio']:.2f}, {traffic['torch']['ratio']:.2f} |"
        )
    return "\n".join(time_lines) + "\n\n" + "\n".join(other_lines)


def format_profiles(rows: list[dict[str, Any]], top: int = 12) -> str:
    lines = []
    for r in rows:
        if not r["profile"]:
            continue
        for impl, entries in r["profile"].items():
            head, *functions = entries
            lines.append(
                f"\nws {r['world_size']} {r['model']} raf={r['raf']} {impl}: "
                f"{1e3 * head['total_s_per_step']:.1f} ms/step under cProfile (rank 0)"
            )
            lines.append("  self%   cum%  calls/step  function")
            for f in functions[:top]:
                lines.append(
                    f"  {100 * f['self_share']:5.1f} {100 * f['cumulative_share']:6.1f} "
                    f"{f['calls_per_step']:10.1f}  {f['function']}"
                )
    return "\n".join(lines)


# --- command line ------------------------------------------------------------------------


def _csv(
    choices: Sequence[str] | None, convert: Callable[[str], Any] = str
) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if choices is not None:
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown value(s) {', '.join(bad)}; choose from {', '.join(choices)}"
                )
        try:
            return [convert(item) for item in items]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _world_size(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"world size must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=_csv(None, _world_size), default=[1, 2, 4])
    parser.add_argument("--models", type=_csv(MODELS), default=list(MODELS))
    parser.add_argument(
        "--raf",
        type=_csv(("true", "false"), lambda s: s == "true"),
        default=[True, False],
        help="reshard_after_forward values, e.g. true,false",
    )
    parser.add_argument("--pairs", type=int, default=7, help="interleaved blocks (paired runs)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps per arm before any timing")
    parser.add_argument("--warmup-per-run", type=int, default=1, help="untimed steps per run")
    parser.add_argument("--mem-steps", type=int, default=3, help="steps of the memory runs")
    parser.add_argument(
        "--mem-repeats", type=int, default=3, help="memory runs per implementation (median)"
    )
    parser.add_argument("--profile", metavar="DIR", help="cProfile each implementation on rank 0")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds per world size")
    parser.add_argument("--out", metavar="JSON", help="write every measurement here")
    parser.add_argument("--device", default="cpu", help="device type of the ranks (default: cpu)")
    parser.add_argument("--backend", help="process-group backend (default: the device's)")
    parser.add_argument(
        "--share-devices",
        action="store_true",
        help="with fewer devices than ranks, place ranks round-robin on them "
        "(a backend that can share: staged_gloo)",
    )
    args = parser.parse_args(argv)
    for name in ("pairs", "steps", "mem_steps", "mem_repeats", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("warmup", "warmup_per_run"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def write_report(
    path: str,
    options: Options,
    cases: tuple[Case, ...],
    threads: dict[int, list[int]],
    loads: list[float],
    rows: list[dict[str, Any]],
) -> None:
    import torch

    report = {
        # Read by `python -m distconform conformance history` to place the run in time.
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "options": {**asdict(options), "cases": [asdict(c) for c in cases]},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": options.device_type,
            "device_name": _device_name(options.device_type),
            "load_average_1min": loads,
            "torch_threads_per_rank": threads,
        },
        "rows": rows,
    }
    Path(path).write_text(json.dumps(report, indent=1))


def _device_name(device_type: str) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or device_type


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Read by the ranks at start-up: no per-collective trace files during timed steps.
    os.environ["DISTCONFORM_COMM_FLIGHT"] = "0"
    from distconform.harness import run_on_ranks

    cases = tuple(Case(model, raf) for model in args.models for raf in args.raf)
    options = Options(
        cases=cases,
        pairs=args.pairs,
        steps=args.steps,
        warmup=args.warmup,
        warmup_per_run=args.warmup_per_run,
        mem_steps=args.mem_steps,
        mem_repeats=args.mem_repeats,
        profile_dir=str(Path(args.profile).resolve()) if args.profile else None,
        profile_steps=args.profile_steps,
        device_type=args.device,
    )
    started = time.perf_counter()
    rows = []
    threads = {}
    loads = [os.getloadavg()[0]]
    for world_size in args.world_sizes:
        per_rank = run_on_ranks(
            run_rank,
            world_size,
            (options,),
            threads_per_rank=1,
            deadline=args.deadline,
            device=args.device,
            backend=args.backend,
            share_devices=args.share_devices,
        )
        loads.append(os.getloadavg()[0])
        threads[world_size] = [r["threads"] for r in per_rank]
        rows.extend(summarise(world_size, case, per_rank) for case in cases)
        # A long run on a busy machine keeps what it finished if a later world size fails.
        print(format_tables(rows), flush=True)
        if args.out:
            write_report(args.out, options, cases, threads, loads, rows)
    print(format_profiles(rows))
    print(
        f"\n{len(rows)} cases, {args.pairs} blocks x {args.steps} steps per arm; 1-minute load "
        f"average {', '.join(f'{x:.2f}' for x in loads)} (start, after each world size); "
        f"{time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
