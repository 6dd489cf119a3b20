"""Per-test overhead of trivial distributed tests: our launchers against torch's harnesses.

Every variant runs the same trivial test (a one-element ``all_reduce`` at world size 2,
then a check of the value) ``--tests`` times, as its own ``python -m pytest`` session on
generated files in a temp dir. Durations come from one small reporting plugin loaded
with ``-p`` into every session, which records ``setup + call + teardown`` of each test
item, so unittest-based torch classes and our pytest tests are timed by the same clock.

    python benchmarks/harness_overhead.py [--tests 200] [--json out.json] [--mptc-tests N]
                                          [--variants warm,fresh,mptc,continuous,mttc,thread]
                                          [--repeats 3]

Users wait for whole sessions, so each variant is also timed as a session: a 1-test session
and an N-test session, ``--repeats`` times each, interleaved across the variants (the
machine's drift hits all of them alike). The marginal cost per test is (median N-test
wall - median 1-test wall) / (N - 1): pytest's own per-test work included, which the
per-item durations leave out.

The table's median and p90 are over the steady state (every test but the first, for every
variant); the first test, which pays for a lazily started pool or torch's class spawn, is
its own column. Torch's ``torch.testing._internal`` classes are allowed here only, never in
harness/, impl/ or suites/. This script imports no torch itself: only the sessions do.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

WORLD_SIZE = 2
TIMING_PLUGIN = "_distconform_bench_timing"
TIMINGS_ENV = "DISTCONFORM_BENCH_TIMINGS"

# The reporting plugin loaded into every session. It keeps reports in memory and writes
# them once at the end, so the clock around each phase (pytest's own ``report.duration``)
# never includes our bookkeeping.
_TIMING_PLUGIN_SOURCE = f'''
import json
import os

_REPORTS = []


def pytest_runtest_logreport(report):
    _REPORTS.append([report.nodeid, report.when, report.duration, report.outcome])


def pytest_sessionfinish(session):
    with open(os.environ["{TIMINGS_ENV}"], "w") as handle:
        json.dump(_REPORTS, handle)
'''

_INI = """[pytest]
# An empty config of its own: the repository's addopts and timeouts must not apply here.
# pytest's cache stays on, as in a user's checkout. Each variant has a directory of its own,
# so its sessions find the cache its previous session left (the fork server then starts at
# configure), never one of another harness's sessions, which collect no distributed tests.
addopts = -p no:benchmark
"""

# One torch thread everywhere, so every variant does the same work per rank; the
# spawned ranks of torch's classes inherit it through the environment.
_ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _ours_module(count: int) -> str:
    tests = "".join(
        textwrap.dedent(
            f"""

            @pytest.mark.world_size({WORLD_SIZE})
            def test_{i:04d}(rank_ctx):
                value = torch.ones(1)
                dist.all_reduce(value)
                assert value.item() == rank_ctx.world_size
            """
        )
        for i in range(count)
    )
    return "import pytest\nimport torch\nimport torch.distributed as dist\n" + tests


def _unittest_module(count: int, base: str, preamble: str) -> str:
    """A torch test class with ``count`` identical test methods."""
    methods = "".join(
        textwrap.indent(
            textwrap.dedent(
                f"""
                def test_{i:04d}(self):
                    {{init}}value = torch.ones(1)
                    dist.all_reduce(value)
                    self.assertEqual(value.item(), {WORLD_SIZE})
                """
            ),
            "    ",
        )
        for i in range(count)
    )
    header = textwrap.dedent(
        f"""\
        import torch
        import torch.distributed as dist
        from torch.testing._internal.common_distributed import {base}


        class Bench{base}({base}):
        """
    )
    return header + textwrap.indent(textwrap.dedent(preamble), "    ") + methods


# MultiProcessTestCase spawns fresh ranks for every test; the test body joins the world.
_MPTC_PREAMBLE = f"""
@property
def world_size(self):
    return {WORLD_SIZE}

def setUp(self):
    super().setUp()
    self._spawn_processes()
"""
_MPTC_INIT = (
    'dist.init_process_group("gloo", init_method=f"file://{self.file_name}", '
    "rank=self.rank, world_size=self.world_size)\n        "
)

# MultiProcContinuousTest spawns its ranks lazily in the first test's setUp and keeps them.
_CONTINUOUS_PREAMBLE = f"""
world_size = {WORLD_SIZE}

@classmethod
def backend_str(cls):
    return "gloo"

@classmethod
def device_type(cls):
    return "cpu"
"""

_MTTC_PREAMBLE = f"""
@property
def world_size(self):
    return {WORLD_SIZE}

def setUp(self):
    super().setUp()
    self._spawn_threads()
"""


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    module: str
    pytest_args: tuple[str, ...] = ()


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "warm",
        "distconform warm pool (--launcher process)",
        "test_ours.py",
        ("--launcher", "process", "--dist-threads", "1"),
    ),
    Variant(
        "fresh",
        "distconform fresh pool per test (--dist-fresh-pool)",
        "test_ours.py",
        ("--launcher", "process", "--dist-threads", "1", "--dist-fresh-pool"),
    ),
    Variant("mptc", "torch MultiProcessTestCase", "test_torch_mptc.py"),
    Variant("continuous", "torch MultiProcContinuousTest", "test_torch_continuous.py"),
    Variant("mttc", "torch MultiThreadedTestCase", "test_torch_mttc.py"),
    Variant(
        "thread",
        "distconform thread launcher (--launcher thread)",
        "test_ours.py",
        ("--launcher", "thread"),
    ),
)
VARIANT_KEYS = tuple(v.key for v in VARIANTS)


def write_tests(directory: Path, count: int, mptc_count: int | None = None) -> None:
    """Generate the test modules (``count`` tests, and a 1-test twin of each, ``*_one.py``),
    the ini file and the timing plugin into ``directory``."""
    (directory / "pytest.ini").write_text(_INI)
    (directory / f"{TIMING_PLUGIN}.py").write_text(_TIMING_PLUGIN_SOURCE)
    for suffix, n, mptc_n in (("", count, mptc_count or count), ("_one", 1, 1)):
        (directory / f"test_ours{suffix}.py").write_text(_ours_module(n))
        (directory / f"test_torch_mptc{suffix}.py").write_text(
            _unittest_module(mptc_n, "MultiProcessTestCase", _MPTC_PREAMBLE).replace(
                "{init}", _MPTC_INIT
            )
        )
        (directory / f"test_torch_continuous{suffix}.py").write_text(
            _unittest_module(n, "MultiProcContinuousTest", _CONTINUOUS_PREAMBLE).replace(
                "{init}", ""
            )
        )
        (directory / f"test_torch_mttc{suffix}.py").write_text(
            _unittest_module(n, "MultiThreadedTestCase", _MTTC_PREAMBLE).replace("{init}", "")
        )


def one_test_module(variant: Variant) -> str:
    return variant.module.replace(".py", "_one.py")


@dataclass
class Measurement:
    key: str
    label: str
    tests: int
    passed: int
    returncode: int
    wall_s: float
    # setup + call + teardown of each test item, in run order, in milliseconds.
    durations_ms: list[float] = field(default_factory=list)
    log_tail: str = ""
    # Whole-session walls of the interleaved repeats: 1-test sessions and N-test sessions.
    one_test_walls_s: list[float] = field(default_factory=list)
    session_walls_s: list[float] = field(default_factory=list)

    @property
    def one_test_session_s(self) -> float:
        return statistics.median(self.one_test_walls_s) if self.one_test_walls_s else math.nan

    @property
    def session_s(self) -> float:
        walls = self.session_walls_s or [self.wall_s]
        return statistics.median(walls)

    @property
    def marginal_ms(self) -> float:
        """What one more test adds to the session users wait for (pytest's work included)."""
        if not self.one_test_walls_s or self.tests < 2:
            return math.nan
        return (self.session_s - self.one_test_session_s) / (self.tests - 1) * 1e3

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.passed == self.tests

    @property
    def steady_ms(self) -> list[float]:
        # The first test pays for lazily started ranks (our pools, torch's continuous
        # class); the same rule applies to every variant so the columns compare.
        return self.durations_ms[1:] or self.durations_ms

    @property
    def median_ms(self) -> float:
        return statistics.median(self.steady_ms) if self.durations_ms else math.nan

    @property
    def p90_ms(self) -> float:
        return percentile(self.steady_ms, 90)

    @property
    def first_ms(self) -> float:
        return self.durations_ms[0] if self.durations_ms else math.nan

    @property
    def start_up_ms(self) -> float:
        """What the first test cost beyond a steady-state test: pool start or class spawn."""
        return self.first_ms - self.median_ms

    @property
    def sum_s(self) -> float:
        return sum(self.durations_ms) / 1e3


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile: a value that was actually measured."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def per_test_durations(reports: list[list]) -> tuple[list[float], int]:
    """Sum setup, call and teardown durations per item; count items that passed all three."""
    totals: dict[str, float] = {}
    call_passed: set[str] = set()
    failed: set[str] = set()
    for nodeid, when, duration, outcome in reports:
        totals[nodeid] = totals.get(nodeid, 0.0) + duration
        if outcome == "failed":
            failed.add(nodeid)
        if when == "call" and outcome == "passed":
            call_passed.add(nodeid)
    # dicts keep insertion order: the order the items ran in.
    return [seconds * 1e3 for seconds in totals.values()], len(call_passed - failed)


def run_variant(
    variant: Variant, directory: Path, count: int, timeout: float, module: str | None = None
) -> Measurement:
    timings = directory / f"timings-{variant.key}.json"
    log = directory / f"log-{variant.key}.txt"
    env = dict(os.environ, **_ONE_THREAD_ENV, **{TIMINGS_ENV: str(timings)})
    # Python's default: the sessions cache compiled modules, pytest's rewritten test modules
    # included, as on a user's machine (some sandboxes turn that off for every process).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # The temp dir first on the path, so -p finds the timing plugin and the ranks of
    # torch's spawn-based classes can import the test module.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable,
        "-m",
        "pytest",
        module or variant.module,
        "-q",
        "-p",
        TIMING_PLUGIN,
        *variant.pytest_args,
    ]
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            returncode = subprocess.run(
                command,
                cwd=directory,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = -1
    wall = time.perf_counter() - started
    reports = json.loads(timings.read_text()) if timings.exists() else []
    durations, passed = per_test_durations(reports)
    measurement = Measurement(
        key=variant.key,
        label=variant.label,
        tests=count,
        passed=passed,
        returncode=returncode,
        wall_s=wall,
        durations_ms=durations,
    )
    if not measurement.ok:
        measurement.log_tail = log.read_text(errors="replace")[-4000:]
    return measurement


def format_table(measurements: list[Measurement]) -> str:
    header = (
        "| variant | tests | median ms/test | p90 ms/test | first test ms "
        "| sum of tests s | 1-test session s | N-test session s | marginal ms/test (session) |"
    )
    rows = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in measurements:
        tests = f"{m.passed}/{m.tests}" if not m.ok else str(m.tests)
        rows.append(
            f"| {m.label} | {tests} | {m.median_ms:.1f} | {m.p90_ms:.1f} | {m.first_ms:.0f} "
            f"| {m.sum_s:.1f} | {m.one_test_session_s:.2f} | {m.session_s:.2f} "
            f"| {m.marginal_ms:.1f} |"
        )
    return "\n".join(rows)


def format_notes(measurements: list[Measurement]) -> str:
    lines = []
    for m in measurements:
        if m.key == "continuous" and m.durations_ms:
            lines.append(
                f"MultiProcContinuousTest class spawn (first test minus steady median): "
                f"{m.start_up_ms / 1e3:.2f} s"
            )
        if m.key == "warm" and m.durations_ms:
            lines.append(
                f"distconform warm pool start (first test minus steady median): "
                f"{m.start_up_ms / 1e3:.2f} s"
            )
    return "\n".join(lines)


def machine() -> dict[str, str]:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "cores": str(os.cpu_count()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "device": "cpu",
        "backend": "gloo (threaded for the thread variants)",
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=200, help="tests per variant (default 200)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANT_KEYS),
        help=f"comma-separated subset of {','.join(VARIANT_KEYS)} (default: all)",
    )
    parser.add_argument(
        "--mptc-tests",
        type=int,
        default=None,
        help="tests for MultiProcessTestCase only (default: --tests); it spawns and imports "
        "torch in every rank for every test, about 4 s per test on 2 idle cores",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds allowed per variant session"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="1-test and N-test sessions per variant for the session-wall columns, "
        "interleaved across the variants (default 3; 0 skips them)",
    )
    args = parser.parse_args(argv)
    if args.mptc_tests is None:
        args.mptc_tests = args.tests
    if min(args.tests, args.mptc_tests) < 2:
        parser.error("at least 2 tests per variant: the first test is reported on its own")
    wanted = [key.strip() for key in args.variants.split(",") if key.strip()]
    unknown = sorted(set(wanted) - set(VARIANT_KEYS))
    if unknown or not wanted:
        parser.error(f"unknown variants {unknown}; choose from {','.join(VARIANT_KEYS)}")
    args.variants = wanted
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [v for v in VARIANTS if v.key in args.variants]
    measurements = []
    with tempfile.TemporaryDirectory(prefix="distconform-bench-") as tmp:
        directories = {variant.key: Path(tmp) / variant.key for variant in chosen}
        for directory in directories.values():
            directory.mkdir()
            write_tests(directory, args.tests, args.mptc_tests)
        for repeat in range(max(1, args.repeats)):
            for index, variant in enumerate(chosen):
                count = args.mptc_tests if variant.key == "mptc" else args.tests
                print(
                    f"running {variant.label} ({count} tests, repeat {repeat + 1}) ...",
                    file=sys.stderr,
                    flush=True,
                )
                directory = directories[variant.key]
                many = run_variant(variant, directory, count, args.timeout)
                if repeat == 0:
                    measurements.append(many)
                if args.repeats:
                    one = run_variant(
                        variant, directory, 1, args.timeout, module=one_test_module(variant)
                    )
                    measurements[index].session_walls_s.append(many.wall_s)
                    measurements[index].one_test_walls_s.append(one.wall_s)
    info = machine()
    # Other work on the machine inflates every number; say how busy it was.
    info["load_average_at_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    counts = f"{args.tests} trivial tests per variant"
    if args.mptc_tests != args.tests and "mptc" in args.variants:
        counts += f" ({args.mptc_tests} for MultiProcessTestCase)"
    print(
        f"\n{counts} (one-element all_reduce, world size "
        f"{WORLD_SIZE}), {info['cores']} cores, {info['device']}, torch {info['torch']}, "
        f"one torch thread per rank, load average at the end {info['load_average_at_end']}; "
        f"median/p90 exclude each variant's first test; session columns: medians of "
        f"{args.repeats} interleaved repeats\n"
    )
    print(format_table(measurements))
    notes = format_notes(measurements)
    if notes:
        print("\n" + notes)
    for m in measurements:
        if not m.ok:
            print(
                f"\n{m.label}: exit code {m.returncode}, {m.passed} of {m.tests} passed; "
                f"end of its log:\n{m.log_tail}",
                file=sys.stderr,
            )
    if args.json is not None:
        payload = {
            "tests": args.tests,
            "world_size": WORLD_SIZE,
            "machine": info,
            "variants": [
                asdict(m)
                | {
                    "median_ms": m.median_ms,
                    "p90_ms": m.p90_ms,
                    "first_ms": m.first_ms,
                    "start_up_ms": m.start_up_ms,
                    "sum_s": m.sum_s,
                    "one_test_session_s": m.one_test_session_s,
                    "session_s": m.session_s,
                    "marginal_ms": m.marginal_ms,
                }
                for m in measurements
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(m.ok for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main())
