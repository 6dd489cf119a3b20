"""Running the check's steps: each a child process with its own limit, waves in order.

A step runs in a process session of its own, so the limit ends it with everything it
started (rank processes, their fork server): SIGTERM first, SIGKILL after a grace. The
budget of the whole check caps each wave: a wave gets what is left, and a wave that would
have less than :data:`MIN_STEP_S` is skipped, not started to be killed at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from distconform.harness.gpu_check.steps import ERROR, SKIPPED, TIMEOUT, Step, StepRun, Verdict

#: Below this, a step is skipped rather than started.
MIN_STEP_S = 15.0
_TERM_GRACE_S = 5.0


@dataclass
class StepResult:
    step: Step
    verdict: Verdict
    wall_s: float
    limit_s: float
    returncode: int | None
    log: Path


def child_environment(tree: Path) -> dict[str, str]:
    """The environment of every step: the tree first on ``PYTHONPATH`` (a plain copy of the
    tree, nothing installed, runs the same code), output unbuffered."""
    env = dict(os.environ)
    paths = [str(tree), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _end_session(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, _TERM_GRACE_S)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, out: Path, tree: Path, limit_s: float) -> StepResult:
    folder = out / step.name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    if step.needs is not None and not (tree / step.needs).exists():
        verdict = Verdict(SKIPPED, f"{step.needs} is not in this tree (run from the source tree)")
        return StepResult(step, verdict, 0.0, limit_s, None, log)
    started = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(step.argv)}\n")
        sink.flush()
        process = subprocess.Popen(
            step.argv,
            cwd=tree,
            env=child_environment(tree),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = False
        try:
            process.wait(limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _end_session(process)  # a finished step's leftovers too (a fork server)
    wall = time.monotonic() - started
    run = StepRun(step.name, folder, process.returncode, wall, timed_out, log)
    try:
        verdict = step.judge(run)
    except Exception as exc:  # a judge that cannot read what a step left is an error, not a crash
        verdict = Verdict(ERROR, f"could not judge the step: {type(exc).__name__}: {exc}")
    if timed_out:
        verdict = Verdict(
            TIMEOUT,
            f"stopped at its {limit_s:.0f} s limit; what it left: {verdict.summary}",
            verdict.details,
        )
    return StepResult(step, verdict, wall, limit_s, process.returncode, log)


def run_all(
    steps: list[Step],
    out: Path,
    tree: Path,
    budget_s: float,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> list[StepResult]:
    """Every step, wave after wave, the steps of a wave at the same time, within the budget."""
    deadline = time.monotonic() + budget_s
    results: dict[str, StepResult] = {}
    in_waves = sorted(steps, key=lambda step: step.wave)  # stable: the plan's order within one
    for wave, members in groupby(in_waves, key=lambda step: step.wave):
        members = list(members)
        left = deadline - time.monotonic()
        if left < MIN_STEP_S:
            for step in members:
                verdict = Verdict(SKIPPED, f"the check's {budget_s:.0f} s budget was spent")
                results[step.name] = StepResult(step, verdict, 0.0, 0.0, None, out / step.name)
                progress(f"[gpu-check] {step.name}: skipped (budget spent)")
            continue
        names = ", ".join(step.name for step in members)
        progress(f"[gpu-check] wave {wave}: {names}")

        def run_one(step: Step, left: float = left) -> None:
            results[step.name] = run_step(step, out, tree, min(step.limit_s, left))

        threads = [
            threading.Thread(target=run_one, args=(step,), name=f"gpu-check-{step.name}")
            for step in members
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for step in members:
            result = results[step.name]
            progress(
                f"[gpu-check] {step.name}: {result.verdict.status.upper()} in "
                f"{result.wall_s:.1f} s: {result.verdict.summary}"
            )
    return [results[step.name] for step in steps]
