"""Mutation benchmark: how many automatically broken copies of the reference the suites catch.

``python benchmarks/mutation.py --sample 200 --seed 1 --budget 36000`` makes every mutant of
``impl/reference`` (``mutation_operators.py``), draws a sample (``mutation_ids.py``), and
runs the quick conformance selection against each, then the rest of the full run against
each quick survivor (``mutation_runner.py``), in a private copy of the repository. The
results go to ``benchmarks/results/mutation-<date>.json`` after every mutant (running the
same command again continues them) and the table to the terminal; ``python
benchmarks/tables.py`` renders it into ``docs/results/mutation.md`` (``mutation_report.py``).

``--list`` prints the mutants (or the sample) without running anything; ``--diff ID`` shows
one; ``--mutant ID`` runs one and prints the test that kills it, for triage.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mutation_report as report
from mutation_ids import (
    Mutant,
    catalogue,
    load_equivalents,
    sample,
    select,
    stale_equivalents,
)
from mutation_operators import OPERATORS
from mutation_runner import (
    MIN_STAGE_S,
    StageResult,
    Tree,
    build_tree,
    kill_order,
    run_stage,
    verify_tree,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
EQUIVALENTS = ROOT / "benchmarks" / "mutation_equivalents.toml"
#: Stage limits when no baseline was measured (``--mutant``): generous, a hang still ends.
DEFAULT_LIMITS = {"quick": 600.0, "full": 2400.0}
DEFAULT_DEADLINE_S = 120.0
#: A stage may take this many times its baseline, plus a minute, before it counts as hung.
DEFAULT_TIMEOUT_FACTOR = 3.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_argument_group("what to mutate")
    what.add_argument("--sample", type=int, help="mutants to draw (default: every mutant)")
    what.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    what.add_argument(
        "--operators", type=_names, help=f"comma-separated subset of: {', '.join(OPERATORS)}"
    )
    what.add_argument("--files", type=_names, help="only files whose path contains one of these")
    what.add_argument(
        "--tree",
        default="worktree",
        help="what to copy and mutate: 'worktree' (the files as they are, default) or a "
        "git revision such as HEAD",
    )
    modes = parser.add_argument_group("what to do (default: run the sample)")
    modes.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    modes.add_argument(
        "--table", type=Path, metavar="JSON", help="print the tables of a results file, run nothing"
    )
    modes.add_argument("--diff", metavar="ID", action="append", help="print one mutant's diff")
    modes.add_argument(
        "--mutant", metavar="ID", action="append", help="run these mutants only (triage)"
    )
    run = parser.add_argument_group("running")
    run.add_argument("--budget", type=float, help="seconds; no mutant starts after they are spent")
    run.add_argument("--quick-only", action="store_true", help="skip the full stage")
    run.add_argument(
        "--timeout-factor",
        type=float,
        default=DEFAULT_TIMEOUT_FACTOR,
        help=f"stage limit = factor x its baseline + 60 s (default {DEFAULT_TIMEOUT_FACTOR})",
    )
    run.add_argument(
        "--out",
        type=Path,
        help="results JSON (default: continue the newest "
        "unfinished run with the same settings, or a new file of today's date)",
    )
    run.add_argument("--fresh", action="store_true", help="start --out over instead of continuing")
    run.add_argument("--keep-tree", action="store_true", help="leave the private copy behind")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    if options.table:
        results = report.load(options.table)
        print(report.format_table(results) + "\n\nWall time per mutant:\n")
        print(report.format_costs(results))
        return 0
    work = Path(tempfile.mkdtemp(prefix="distconform-mutation-"))
    try:
        revision = None if options.tree == "worktree" else options.tree
        tree = Tree(build_tree(ROOT, revision, work / "tree"), work)
        mutants = select(catalogue(tree.root), options.operators, options.files)
        equivalents = load_equivalents(EQUIVALENTS)
        if options.diff:
            return _print_diffs(mutants, options.diff, tree)
        if options.mutant:
            return _triage(tree, _by_id(mutants, options.mutant), equivalents)
        chosen = sample(mutants, options.sample, options.seed)
        if options.list:
            # Without --sample, in file and source order: easier to read than the draw.
            listed = chosen if options.sample is not None else sorted(mutants, key=_place)
            return _print_list(listed, equivalents, len(mutants))
        for stale in stale_equivalents(equivalents, catalogue(tree.root)):
            print(f"warning: {EQUIVALENTS.name} names {stale}, which no longer exists")
        return _benchmark(options, tree, mutants, chosen, equivalents)
    finally:
        if options.keep_tree:
            print(f"private tree kept at {work / 'tree'}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# --- listing and triage ------------------------------------------------------------------------


def _print_list(chosen: list[Mutant], equivalents: dict[str, str], total: int) -> int:
    for mutant in chosen:
        mark = "  (equivalent)" if mutant.id in equivalents else ""
        print(f"{mutant.id}  line {mutant.line}: {mutant.description}{mark}")
    counts = Counter(m.operator for m in chosen)
    print(
        f"\n{len(chosen)} of {total} mutants: "
        + ", ".join(f"{op} {n}" for op, n in sorted(counts.items()))
    )
    return 0


def _print_diffs(mutants: list[Mutant], ids: list[str], tree: Tree) -> int:
    for mutant in _by_id(mutants, ids):
        print(f"{mutant.id}: {mutant.description}\n{mutant.diff(tree.root)}")
    return 0


def _triage(tree: Tree, chosen: list[Mutant], equivalents: dict[str, str]) -> int:
    """Run each mutant through both stages (the full one only if the quick one passes) and
    say which test kills it, with the first lines of its failure."""
    verify_tree(tree)
    limits, deadline = _limits_from_latest_run()
    for mutant in chosen:
        print(f"{mutant.id}: {mutant.description}\n{mutant.diff(tree.root)}")
        if mutant.id in equivalents:
            print(f"listed as equivalent: {equivalents[mutant.id]}")
        for stage in ("quick", "full"):
            print(f"running the {stage} stage (limit {limits[stage]:.0f} s)...", flush=True)
            with tree.mutated(mutant):
                result = run_stage(tree, stage, timeout=limits[stage], deadline_s=deadline)
            print(f"{stage}: {result.status} in {result.seconds:.1f} s")
            if result.status != "passed":
                if result.failing_test:
                    print(f"killed by {result.failing_test}\n{result.message}")
                else:
                    print(result.log_tail)
                break
        else:
            print("SURVIVED: add a check that fails on it, or argue it equivalent")
    return 0


def _place(mutant: Mutant) -> tuple[str, int]:
    return mutant.path, mutant.line


def _by_id(mutants: list[Mutant], ids: list[str]) -> list[Mutant]:
    known = {m.id: m for m in mutants}
    missing = [i for i in ids if i not in known]
    if missing:
        raise SystemExit(f"no such mutant: {', '.join(missing)} (--list shows them)")
    return [known[i] for i in ids]


def _limits_from_latest_run() -> tuple[dict[str, float], float]:
    for path in sorted(RESULTS.glob("mutation-*.json"), reverse=True):
        limits = report.load(path).get("baseline", {}).get("limits")
        if limits:
            return {**DEFAULT_LIMITS, **limits["stages"]}, limits["deadline_s"]
    return dict(DEFAULT_LIMITS), DEFAULT_DEADLINE_S


# --- the benchmark -----------------------------------------------------------------------------


class Budget:
    """Wall-clock seconds left to this invocation."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()


class Run:
    """One invocation's state: the results file, the budget, the baselines checked."""

    def __init__(self, out: Path, results: dict[str, Any], options: argparse.Namespace) -> None:
        self.out = out
        self.results = results
        self.options = options
        self.budget = Budget(options.budget)
        self.started = time.monotonic()
        self.elapsed_before = results["elapsed_s"]
        # The quick baseline runs again in every invocation (the tree may have changed since);
        # the full one is measured once per results file.
        self.checked: set[str] = set()

    def save(self) -> None:
        elapsed = self.elapsed_before + time.monotonic() - self.started
        self.results["elapsed_s"] = round(elapsed, 1)
        report.save(self.out, self.results)

    def stop(self, why: str) -> int:
        self.save()
        done = len(self.results["mutants"])
        total = len(self.results["sampled"])
        print(f"stopped ({why}): {done} of {total} done; the same command continues the run")
        print(report.format_table(self.results))
        return 0 if why == "budget spent" else 1


def _benchmark(
    options: argparse.Namespace,
    tree: Tree,
    mutants: list[Mutant],
    chosen: list[Mutant],
    equivalents: dict[str, str],
) -> int:
    config = {
        "sample": options.sample,
        "seed": options.seed,
        "operators": options.operators,
        "files": options.files,
        "tree": options.tree,
        "quick_only": options.quick_only,
    }
    out = _results_path(options.out, config, options.fresh)
    run = Run(out, _open_results(out, config, options.fresh, tree, mutants, chosen), options)
    print(f"results: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    # A continued run keeps its sample, even if edits since have renamed some mutants.
    known = {m.id: m for m in mutants}
    gone = [i for i in run.results["sampled"] if i not in known]
    if gone:
        print(f"warning: {len(gone)} sampled mutants no longer exist (their lines changed)")
    chosen = [known[i] for i in run.results["sampled"] if i in known]
    done = {r["id"] for r in run.results["mutants"]}
    history = _history(out) + run.results["mutants"]

    print("checking that the pytest process and the ranks import the private copy...", flush=True)
    verify_tree(tree)
    if not _measure_baseline(tree, run, "quick"):
        return run.stop("the original fails its quick selection, or no budget for it")
    for index, mutant in enumerate(chosen, start=1):
        if mutant.id in done:
            continue
        if mutant.id in equivalents:
            record = {**_describe(mutant), "status": "equivalent", "reason": equivalents[mutant.id]}
        else:
            record = _run_mutant(tree, mutant, run, history)
            if record is None:
                return run.stop("budget spent")
        run.results["mutants"].append(record)
        history.append(record)
        run.save()
        _progress(index, len(chosen), record, run.results["elapsed_s"])
    run.results["complete"] = True
    run.save()
    print()
    print(report.format_table(run.results))
    print("\nwall time per mutant:\n" + report.format_costs(run.results))
    return 0


def _run_mutant(
    tree: Tree, mutant: Mutant, run: Run, history: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Run ``mutant`` through the quick stage and, if it survives, the full one; ``None``
    when the budget ran out first (it stays pending)."""
    record = _describe(mutant)
    order = kill_order(history, mutant)
    stages = ("quick",) if run.options.quick_only else ("quick", "full")
    for stage in stages:
        if stage == "full" and not _measure_baseline(tree, run, "full"):
            return None
        limits = run.results["baseline"]["limits"]
        limit, left = limits["stages"][stage], run.budget.left()
        if left < min(limit, MIN_STAGE_S):
            return None
        with tree.mutated(mutant):
            result = run_stage(
                tree,
                stage,
                timeout=min(limit, left),
                deadline_s=limits["deadline_s"],
                order=order,
            )
        if result.status == "timeout" and left < limit:
            return None  # cut by the budget, not by its own limit: run it again next time
        record[f"{stage}_s"] = round(result.seconds, 1)
        verdict = _verdict(result, run.results["baseline"][stage])
        if verdict is not None:
            return {**record, **verdict, "stage": stage}
    return {**record, "status": "survived", "stage": stages[-1]}


def _verdict(result: StageResult, baseline: dict[str, Any]) -> dict[str, Any] | None:
    """How a stage's run ends the mutant, or ``None`` if it passed as the original does."""
    if result.status == "timeout":
        return {"status": "timeout", "killed_by": None, "message": "stage time limit"}
    if result.status == "failed":
        status = "timeout" if result.hung else "killed"
        return {"status": status, "killed_by": result.failing_test, "message": result.message}
    # Passed, but a test the original passes may skip now: the verdict changed all the same.
    newly_skipped = sorted(set(result.skipped) - set(baseline.get("skipped", {})))
    if newly_skipped:
        test = newly_skipped[0]
        message = f"skipped: {result.skipped[test]}"
        return {"status": "killed", "killed_by": test, "message": message}
    return None


def _measure_baseline(tree: Tree, run: Run, stage: str) -> bool:
    """Run ``stage`` on the original: it must pass, and its wall time sets the stage's limit.
    False if it fails or the budget cannot pay for it."""
    baseline = run.results["baseline"]
    if stage in run.checked or (stage == "full" and stage in baseline):
        return True
    limit = DEFAULT_LIMITS[stage]
    if run.budget.left() < limit / 4:
        return False
    print(f"baseline: the {stage} stage on the original...", flush=True)
    result = run_stage(tree, stage, timeout=min(limit, run.budget.left()), deadline_s=300)
    print(f"baseline {stage}: {result.status} in {result.seconds:.1f} s, {result.passed} passed")
    if result.status != "passed":
        print(result.message or result.log_tail)
        return False
    run.checked.add(stage)
    baseline[stage] = {
        "seconds": round(result.seconds, 1),
        "passed": result.passed,
        "skipped": result.skipped,
        "slowest_test_s": round(max(result.durations.values(), default=0.0), 1),
    }
    factor = run.options.timeout_factor
    measured = [s for s in ("quick", "full") if s in baseline]
    slowest = max(baseline[s]["slowest_test_s"] for s in measured)
    baseline["limits"] = {
        "stages": {s: round(factor * baseline[s]["seconds"] + 60) for s in measured},
        # A test may take five times the slowest baseline test before the harness calls it
        # hung (it fails then, and the mutant counts as timed out).
        "deadline_s": min(300, max(60, round(5 * slowest))),
    }
    run.save()
    return True


# --- the results file --------------------------------------------------------------------------


def _results_path(out: Path | None, config: dict[str, Any], fresh: bool) -> Path:
    if out is not None:
        return out.resolve()
    if not fresh:
        for path in sorted(RESULTS.glob("mutation-*.json"), reverse=True):
            data = report.load(path)
            if not data.get("complete") and data.get("config") == config:
                return path
    today = datetime.date.today().isoformat()
    path = RESULTS / f"mutation-{today}.json"
    suffix = 2
    while path.exists() and not fresh:
        path = RESULTS / f"mutation-{today}-{suffix}.json"
        suffix += 1
    return path


def _open_results(
    out: Path,
    config: dict[str, Any],
    fresh: bool,
    tree: Tree,
    mutants: list[Mutant],
    chosen: list[Mutant],
) -> dict[str, Any]:
    if out.exists() and not fresh:
        results = report.load(out)
        if results.get("config") != config:
            raise SystemExit(
                f"{out} holds a run with other settings ({results.get('config')}); pass --fresh "
                "to start it over or another --out"
            )
        print(f"continuing: {len(results['mutants'])} of {len(chosen)} mutants done")
        return results
    results = report.new_results(config, _environment(tree))
    results["catalogue"] = {
        "mutants": len(mutants),
        "by_operator": dict(sorted(Counter(m.operator for m in mutants).items())),
    }
    results["sampled"] = [m.id for m in chosen]
    return results


def _history(out: Path) -> list[dict[str, Any]]:
    """The killed mutants of earlier runs: which tests kill what, to try those first."""
    records = []
    for path in RESULTS.glob("mutation-*.json"):
        if path.resolve() != out:
            records += [r for r in report.load(path)["mutants"] if r["status"] == "killed"]
    return records


def _environment(tree: Tree) -> dict[str, Any]:
    sources = sorted((tree.root / "distconform" / "impl" / "reference").rglob("*.py"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "reference_sha256": digest,
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "cpus": os.cpu_count(),
        # Stage times scale with what else the machine runs: read them with this.
        "load_average_at_start": round(os.getloadavg()[0], 1),
    }


def _describe(mutant: Mutant) -> dict[str, Any]:
    return {
        "id": mutant.id,
        "file": mutant.path,
        "qualname": mutant.qualname,
        "operator": mutant.operator,
        "line": mutant.line,
        "description": mutant.description,
    }


def _progress(index: int, total: int, record: dict[str, Any], elapsed: float) -> None:
    seconds = record.get("quick_s", 0.0) + record.get("full_s", 0.0)
    status = record["status"]
    stage = record.get("stage", "") if status != "equivalent" else ""
    by = f" by {record['killed_by']}" if record.get("killed_by") else ""
    print(
        f"[{index:>4}/{total}] {status:<10} {stage:<5} {seconds:6.1f} s "
        f"(run {elapsed / 60:5.1f} min)  {record['id']}{by}",
        flush=True,
    )


def _names(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:
        # `--list | head`: end quietly (the private tree is already removed), as a filter does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
