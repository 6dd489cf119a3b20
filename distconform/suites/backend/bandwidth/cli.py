"""The command line of ``bench-collectives``: its flags, the settings they resolve to (usage
errors before any rank starts), and ``main``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distconform.extension import add_backend_plugin_argument
from distconform.suites.backend.bandwidth.arithmetic import (
    DEFAULT_OPS,
    DTYPE_SIZES,
    MIN_ITERS,
    OPS,
    format_bytes,
    parse_bytes,
    parse_ops,
    parse_world_sizes,
    size_ladder,
)
from distconform.suites.backend.bandwidth.measure import Settings, Target, progress, run_benchmark
from distconform.suites.backend.bandwidth.output import (
    PROG,
    environment,
    json_document,
    load_average,
    render_table,
)

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
DEFAULT_DEADLINE_S = 300.0


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
    add_backend_plugin_argument(parser)
    parser.add_argument(
        "--launcher", default="process", choices=("process", "thread"), help="default: process"
    )
    parser.add_argument("--device", default="cpu", help="device type of the ranks (default: cpu)")
    parser.add_argument(
        "--share-devices",
        action="store_true",
        help="with fewer devices than ranks, place ranks round-robin on them (a backend that "
        "can share one: staged_gloo)",
    )
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
    from distconform.api import ConfigError
    from distconform.extension import (
        BackendPluginError,
        check_device_type,
        device_count,
        resolve_backend,
        sharing_refusal,
    )
    from distconform.extension import activate_backend_plugins as activate

    try:
        sizes = size_ladder(options.min_bytes, options.max_bytes, options.step_factor)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if options.json:
        folder = Path(options.json).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--json {options.json}: the folder {folder} does not exist")
    try:
        plugins = activate(options.backend_plugin, options.backend, options.device)
        device = check_device_type(options.device)
        backend = resolve_backend(options.launcher, options.backend, device)
        peer_backend = resolve_backend(PEER_LAUNCHER, PEER_BACKEND, PEER_DEVICE)
    except (ConfigError, BackendPluginError) as exc:
        raise UsageError(str(exc)) from None
    available = device_count(device)
    largest = max(options.world_sizes)
    if options.share_devices and available:
        refusal = sharing_refusal(backend, device, largest, available)
        if refusal is not None:
            raise UsageError(refusal)
    elif available is not None and available < largest:
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
        share_devices=options.share_devices,
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
    progress(
        f"measuring {measured} at ws {','.join(map(str, settings.world_sizes))}: "
        f"{len(settings.ops)} ops, {format_bytes(settings.sizes[0])} to "
        f"{format_bytes(settings.sizes[-1])}"
    )
    env = environment(settings)
    started = time.monotonic()
    records, failures = run_benchmark(settings)
    env["wall_s"] = round(time.monotonic() - started, 1)
    env["load_average_at_end"] = load_average()
    progress(f"done in {env['wall_s']} s")
    sys.stdout.write(render_table(settings, records, failures))
    sys.stdout.flush()
    if options.json:
        document = json_document(settings, env, records, failures)
        Path(options.json).write_text(json.dumps(document, indent=2) + "\n")
        progress(f"wrote {options.json}")
    if failures:
        hint = (
            f"the full reports are in {options.json}"
            if options.json
            else "--json FILE keeps the full reports"
        )
        progress(f"{len(failures)} sweep(s) failed; {hint}")
        return 1
    return 0
