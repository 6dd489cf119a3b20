"""The steps of the GPU check: what each one runs, how long it may take, how it is judged.

Every step is a command of its own (a child process with a time limit), so a crash or hang
in one cannot lose the others; each writes its artifacts into its own folder, and its judge
reads them back: a JUnit file, a conformance report, a benchmark's JSON. A step passes only
on what its artifacts say, never on its exit status alone.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconform.harness.entry_points import pytest_plugin_args

PASS, FAIL, TIMEOUT, ERROR, SKIPPED = "pass", "fail", "timeout", "error", "skipped"

#: The tests of the harness on the device, and the failure/hang check (paths in the tree).
ACCELERATOR_TESTS = "tests/accelerator/test_on_device.py"
FAULT_TESTS = "tests/accelerator/faults_on_device.py"
CONTINUOUS_TESTS = "tests/accelerator/adopted_continuous_on_device.py"
#: Devices torch's own harness finds in the processes it spawns; another (the fake device, a
#: plug-in's) exists only where distconform loaded it, so only the adopted run can use it.
TORCH_OWN_DEVICES = ("cuda", "xpu", "hpu")
#: Each of its tests and the outcome torch's harness documents for it: after the failure
#: the class's remaining tests are skipped (its poison pill).
CONTINUOUS_EXPECTED = {
    "test_a_sum_of_ranks_on_the_device": "passed",
    "test_b_rank_and_world_size_are_the_classs": "passed",
    "test_a_sharded_arange_on_the_device": "passed",
    "test_1_fails_on_the_last_rank": "failed",
    "test_2_skipped_after_the_failure": "skipped",
}
#: The hang test's deadline (tests/accelerator/faults_on_device.py) and the most the report
#: of it may take beyond that: the stack dump, the peer grace, a fresh pool for the next test.
HANG_DEADLINE_S = 15.0
HANG_REPORT_SLACK_S = 30.0


@dataclass(frozen=True)
class StepRun:
    """What running one step left behind."""

    name: str
    folder: Path
    returncode: int | None
    wall_s: float
    timed_out: bool
    log: Path


@dataclass
class Verdict:
    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """One command of the check. Steps of one ``wave`` run at the same time (they lease no
    device from each other and time nothing); waves run one after another."""

    name: str
    title: str
    limit_s: float
    argv: tuple[str, ...]
    judge: Callable[[StepRun], Verdict]
    wave: int
    needs: str | None = None  # a path of the tree the step runs; absent -> skipped


@dataclass(frozen=True)
class Plan:
    """What the check runs against: the device type and the two backends."""

    python: str
    device: str
    backend: str | None  # the device's own (None: its default, e.g. nccl)
    shared_backend: str  # one that lets ranks share a device
    shared_world_sizes: tuple[int, ...] = (2, 4)


# --- judges ------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def judge_environment(run: StepRun) -> Verdict:
    path = run.folder / "environment.json"
    if run.returncode != 0 or not path.exists():
        return Verdict(ERROR, "the environment could not be read (see the log)")
    facts = _read_json(path)
    devices = facts.get("devices")
    names = (
        ", ".join(str(d.get("name", d)) for d in devices)
        if isinstance(devices, list)
        else str(devices)
    )
    summary = (
        f"torch {facts.get('torch')}, python {facts.get('python')}, pytest {facts.get('pytest')}"
    )
    if facts.get("cuda"):
        summary += f", CUDA {facts['cuda']}, NCCL {facts.get('nccl')}"
    summary += f"; {facts.get('device_count')} device(s): {names or 'none'}"
    status = PASS if isinstance(devices, list) and devices else FAIL
    return Verdict(status, summary, facts)


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Every test case of a JUnit file: name, outcome, message, time."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or "") + "\n" + (found.text or "")
                break
        cases.append(
            {
                "name": case.get("name", ""),
                "outcome": outcome,
                "message": message.strip(),
                "time_s": float(case.get("time") or 0.0),
            }
        )
    return cases


def _counts(cases: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return counts


def judge_pytest(run: StepRun) -> Verdict:
    path = run.folder / "junit.xml"
    if not path.exists():
        return Verdict(ERROR, f"no JUnit report (exit status {run.returncode}; see the log)")
    cases = junit_cases(path)
    counts = _counts(cases)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"
    details = {"counts": counts, "cases": cases}
    bad = counts.get("failed", 0) + counts.get("error", 0)
    ran = len(cases) - counts.get("skipped", 0)
    if bad or run.returncode not in (0, None):
        return Verdict(FAIL, summary, details)
    if ran == 0:
        return Verdict(FAIL, f"nothing ran ({summary})", details)
    return Verdict(PASS, summary, details)


def judge_conformance(run: StepRun) -> Verdict:
    path = run.folder / "report" / "conformance.json"
    if not path.exists():
        return Verdict(ERROR, f"no conformance report (exit status {run.returncode})")
    report = _read_json(path)
    counts = report["summary"]["counts"]
    percent = report["summary"]["conformance_percent"]
    summary = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    summary += f"; {percent:.1f} %" if isinstance(percent, int | float) else f"; {percent}"
    verdict = report.get("verdict") or {}
    if verdict.get("line"):
        summary = f"{verdict['line']}; {summary}"
    failures = [t for t in report["tests"] if t.get("status") == "FAIL"]
    details = {
        "verdict": verdict.get("status"),
        "counts": counts,
        "complete": report["complete"],
        "failures": [
            {"test": t.get("nodeid") or t.get("id"), "message": t.get("message", "")}
            for t in failures
        ],
    }
    if not report["complete"]:
        return Verdict(FAIL, f"incomplete: {summary}", details)
    ran = sum(counts.get(k, 0) for k in ("PASS", "FAIL", "XFAIL", "XPASS"))
    if counts.get("FAIL", 0) or run.returncode != 0 or ran == 0:
        return Verdict(FAIL, summary, details)
    return Verdict(PASS, summary, details)


def judge_impl_step(run: StepRun) -> Verdict:
    path = run.folder / "impl_step.json"
    if not path.exists():
        return Verdict(ERROR, f"no benchmark output (exit status {run.returncode})")
    rows = _read_json(path)["rows"]
    table = [
        {
            "world_size": row["world_size"],
            "model": row["model"],
            "raf": row["raf"],
            "time_ratio_reference_over_torch": round(row["ratio"]["median"], 3),
            "aa_ratio": round(row["aa_ratio"]["median"], 3),
            "ms_per_step": {k: round(v, 2) for k, v in row["median_ms"].items()},
            "peak_bytes": row["peak_rss_above_baseline_bytes"],
            "peak_ratio_reference_over_torch": round(row["peak_ratio"], 3),
        }
        for row in rows
    ]
    summary = "; ".join(
        f"ws {r['world_size']} {r['model']}: time x{r['time_ratio_reference_over_torch']}, "
        f"peak x{r['peak_ratio_reference_over_torch']}"
        for r in table
    )
    status = PASS if run.returncode == 0 and table else FAIL
    return Verdict(status, summary or "no rows", {"rows": table})


def judge_bench_collectives(run: StepRun) -> Verdict:
    path = run.folder / "bench.json"
    if not path.exists():
        return Verdict(ERROR, f"no benchmark output (exit status {run.returncode})")
    document = _read_json(path)
    records, failures = document.get("records", []), document.get("failures", [])
    best: dict[str, tuple[float, float]] = {}
    for record in records:
        key = f"{record['backend']} ws{record['world_size']} {record['op']}"
        algbw, busbw = best.get(key, (0.0, 0.0))
        best[key] = (max(algbw, record["algbw_gbps"]), max(busbw, record["busbw_gbps"]))
    summary = "; ".join(f"{k} {a:.2f}/{b:.2f}" for k, (a, b) in sorted(best.items()))
    details = {
        "best_algbw_busbw_gbps": {k: list(v) for k, v in best.items()},
        "failures": [f.get("error") for f in failures],
    }
    status = PASS if run.returncode == 0 and records and not failures else FAIL
    if not summary:
        return Verdict(status, "no records", details)
    return Verdict(status, f"peak algbw/busbw GB/s: {summary}", details)


def judge_faults(run: StepRun) -> Verdict:
    path = run.folder / "junit.xml"
    if not path.exists():
        return Verdict(ERROR, f"no JUnit report (exit status {run.returncode})")
    cases = {c["name"].split("[")[0]: c for c in junit_cases(path)}
    problems = []
    failing = cases.get("test_fails_on_rank_0")
    if failing is None or failing["outcome"] != "failed":
        problems.append("the failing test did not fail")
    elif "rank 0 failed" not in failing["message"] or "cannot be right" not in failing["message"]:
        problems.append("the failure's report does not name rank 0 and its assertion")
    hanging = cases.get("test_hangs_on_rank_0")
    if hanging is None or hanging["outcome"] != "failed":
        problems.append("the hanging test was not reported as a failure")
    else:
        if "hung" not in hanging["message"]:
            problems.append("the hang's report does not say the rank hung")
        if hanging["time_s"] > HANG_DEADLINE_S + HANG_REPORT_SLACK_S:
            problems.append(
                f"the hang took {hanging['time_s']:.0f} s to report "
                f"(deadline {HANG_DEADLINE_S:g} s)"
            )
    after = cases.get("test_passes_after_the_failure_and_the_hang")
    if after is None or after["outcome"] != "passed":
        problems.append("the test after the failure and the hang did not pass")
    details = {"cases": list(cases.values())}
    if problems:
        return Verdict(FAIL, "; ".join(problems), details)
    took = hanging["time_s"] if hanging else 0.0
    return Verdict(
        PASS,
        f"failure named rank 0; hang reported after {took:.1f} s (deadline "
        f"{HANG_DEADLINE_S:g} s); the next test passed",
        details,
    )


def _last_line_starting(log: Path, prefix: str) -> str | None:
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    return next((line for line in reversed(lines) if line.startswith(prefix)), None)


def judge_continuous(adopted: bool) -> Callable[[StepRun], Verdict]:
    """The continuous sample's outcomes, under torch's harness or adopted; adopted, its
    failure must also name the last rank and the assertion (the harness's per-rank report)."""

    def judge(run: StepRun) -> Verdict:
        path = run.folder / "junit.xml"
        if not path.exists():
            # pytest's one-line refusal (a usage error: expecttest missing, say) says why.
            refusal = _last_line_starting(run.log, "ERROR:")
            return Verdict(ERROR, refusal or f"no JUnit report (exit status {run.returncode})")
        cases = {c["name"]: c for c in junit_cases(path)}
        outcomes = {name: case["outcome"] for name, case in cases.items()}
        problems = [
            f"{name}: {outcomes.get(name, 'not run')}, expected {expected}"
            for name, expected in CONTINUOUS_EXPECTED.items()
            if outcomes.get(name) != expected
        ]
        failing = cases.get("test_1_fails_on_the_last_rank")
        if adopted and failing is not None and failing["outcome"] == "failed":
            message = failing["message"]
            if " failed" not in message or "cannot be right" not in message:
                problems.append("the failure's report does not name its rank and assertion")
            elif "rank" not in message.split(" failed")[0]:
                problems.append("the failure's headline does not start with the rank")
        details = {"cases": list(cases.values())}
        if problems:
            return Verdict(FAIL, "; ".join(problems), details)
        headline = failing["message"].splitlines()[0][:100] if adopted and failing else ""
        summary = f"{len(CONTINUOUS_EXPECTED)} outcomes as expected"
        return Verdict(PASS, f"{summary}; {headline}" if headline else summary, details)

    return judge


# --- the plan ------------------------------------------------------------------------------------


def _backend_args(backend: str | None) -> tuple[str, ...]:
    return ("--backend", backend) if backend else ()


def build_steps(plan: Plan, out: Path) -> list[Step]:
    """The steps in the order they run; ``out`` holds one folder per step."""
    py, device = plan.python, plan.device
    native = _backend_args(plan.backend)
    shared = ("--backend", plan.shared_backend, "--dist-share-devices")
    shared_sizes = ",".join(map(str, plan.shared_world_sizes))
    plugins = tuple(pytest_plugin_args())

    def pytest_args(name: str, path: str, *extra: str) -> tuple[str, ...]:
        return (
            py,
            "-m",
            "pytest",
            path,
            *plugins,
            "--device",
            device,
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "--junitxml",
            str(out / name / "junit.xml"),
            *extra,
        )

    def conformance(name: str, impl: str, *extra: str) -> tuple[str, ...]:
        return (
            py,
            "-m",
            "distconform",
            "conformance",
            "--impl",
            impl,
            "--quick",
            "--device",
            device,
            "--out",
            str(out / name / "report"),
            *extra,
        )

    def impl_step(name: str, world_size: int, *extra: str) -> tuple[str, ...]:
        return (
            py,
            "benchmarks/impl_step.py",
            "--device",
            device,
            "--world-sizes",
            str(world_size),
            "--models",
            "mlp,transformer",
            "--raf",
            "true",
            "--pairs",
            "3",
            "--steps",
            "5",
            "--warmup",
            "2",
            "--mem-repeats",
            "1",
            "--deadline",
            "240",
            "--out",
            str(out / name / "impl_step.json"),
            *extra,
        )

    def bench(name: str, world_size: int, *extra: str) -> tuple[str, ...]:
        return (
            py,
            "-m",
            "distconform",
            "bench-collectives",
            "--device",
            device,
            "--world-sizes",
            str(world_size),
            "--ops",
            "all_reduce,all_gather,reduce_scatter",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "64M",
            "--step-factor",
            "8",
            "--time-budget",
            "0.2",
            "--deadline",
            "120",
            "--json",
            str(out / name / "bench.json"),
            *extra,
        )

    steps = [
        Step(
            "environment",
            "torch, CUDA, NCCL and driver versions; devices",
            30,
            (
                py,
                "-m",
                "distconform.harness.gpu_check.environment",
                device,
                "--json",
                str(out / "environment" / "environment.json"),
            ),
            judge_environment,
            wave=1,
        ),
        Step(
            "accelerator-tests",
            "the harness's accelerator tests, ws 1, the device's backend",
            60,
            pytest_args("accelerator-tests", ACCELERATOR_TESTS, *native, "--world-sizes", "1"),
            judge_pytest,
            wave=2,
            needs=ACCELERATOR_TESTS,
        ),
        Step(
            "accelerator-tests-shared",
            f"the accelerator tests, ws 2 on shared devices ({plan.shared_backend})",
            60,
            pytest_args(
                "accelerator-tests-shared", ACCELERATOR_TESTS, *shared, "--world-sizes", "2"
            ),
            judge_pytest,
            wave=2,
            needs=ACCELERATOR_TESTS,
        ),
        Step(
            "conformance-reference",
            "conformance --quick, reference, ws 1, the device's backend",
            45,
            conformance("conformance-reference", "reference", *native, "--world-sizes", "1"),
            judge_conformance,
            wave=3,
        ),
        Step(
            "conformance-torch",
            "conformance --quick, torch's FSDP2, ws 1, the device's backend",
            45,
            conformance("conformance-torch", "torch", *native, "--world-sizes", "1"),
            judge_conformance,
            wave=4,
        ),
        Step(
            "conformance-reference-shared",
            f"conformance --quick, reference, ws {shared_sizes} on shared devices",
            100,
            conformance(
                "conformance-reference-shared", "reference", *shared, "--world-sizes", shared_sizes
            ),
            judge_conformance,
            wave=3,
        ),
        Step(
            "conformance-torch-shared",
            f"conformance --quick, torch's FSDP2, ws {shared_sizes} on shared devices",
            100,
            conformance(
                "conformance-torch-shared", "torch", *shared, "--world-sizes", shared_sizes
            ),
            judge_conformance,
            wave=3,
        ),
        Step(
            "impl-step",
            "impl_step: reference against FSDP2, step time and peak memory, ws 1",
            50,
            impl_step("impl-step", 1, *native),
            judge_impl_step,
            wave=5,
            needs="benchmarks/impl_step.py",
        ),
        Step(
            "impl-step-shared",
            "impl_step, ws 2 on shared devices",
            50,
            impl_step("impl-step-shared", 2, "--backend", plan.shared_backend, "--share-devices"),
            judge_impl_step,
            wave=6,
            needs="benchmarks/impl_step.py",
        ),
        Step(
            "bench-collectives",
            "bench-collectives, ws 1, the device's backend (gloo on the CPU alongside)",
            45,
            bench("bench-collectives", 1, *native),
            judge_bench_collectives,
            wave=7,
        ),
        Step(
            "bench-collectives-shared",
            f"bench-collectives, ws 2 on shared devices ({plan.shared_backend})",
            45,
            bench(
                "bench-collectives-shared", 2, "--backend", plan.shared_backend, "--share-devices"
            ),
            judge_bench_collectives,
            wave=8,
        ),
        Step(
            "failure-and-hang",
            "a failing and a hanging test on the device, then a passing one",
            55,
            pytest_args("failure-and-hang", FAULT_TESTS, *native, "--dist-peer-grace", "2"),
            judge_faults,
            wave=9,
            needs=FAULT_TESTS,
        ),
        Step(
            "adopt-continuous",
            "torch's continuous family on the device with --dist-adopt",
            55,
            pytest_args("adopt-continuous", CONTINUOUS_TESTS, *native, "--dist-adopt"),
            judge_continuous(adopted=True),
            wave=9,  # beside failure-and-hang: the waves fill the check's 8 minutes
            needs=CONTINUOUS_TESTS,
        ),
    ]
    if device in TORCH_OWN_DEVICES:  # the only ones torch's own worker processes can see
        steps.append(
            Step(
                "adopt-continuous-torch",
                "the same classes under torch's own harness",
                55,
                pytest_args("adopt-continuous-torch", CONTINUOUS_TESTS),
                judge_continuous(adopted=False),
                wave=9,
                needs=CONTINUOUS_TESTS,
            )
        )
    return steps
