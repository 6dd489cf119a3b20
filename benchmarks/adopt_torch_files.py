"""Test files written for torch's distributed harness: outcome and wall time per test under
torch's own harness and under ``--dist-adopt``, in one table.

    python benchmarks/adopt_torch_files.py PATH [PATH ...] [--out results.json] [-- PYTEST ARGS]
    python benchmarks/adopt_torch_files.py --corpus benchmarks/adopt_corpus.toml \
        --corpus-dir DIR [--only NAME ...] [--out results.json]

Each file (e.g. PyTorch's ``test/distributed/_composable/fsdp/test_fully_shard_training.py``
from a checkout) is copied into a fresh temporary directory and run twice, each time as its
own ``pytest`` session, as a user waits for it: first as pytest runs unittest classes anyway
(torch's ``MultiProcessTestCase`` / ``MultiThreadedTestCase`` spawn their ranks for every
test method), then with ``--dist-adopt`` (warm rank pools). The table gives each test's
outcome and time from pytest's JUnit file, the session walls, their ratio, and first the
tests that pass under torch's harness but not when adopted (the adapter's regressions; the
list should be empty). ``--also-fsdp-on-cpu`` adds a session with ``--dist-adopt-fsdp-on-cpu``.
Files are only read: nothing is written next to them.

``--corpus`` runs the files a manifest lists (repository, path, commit, sha256 prefix and the
pytest arguments of each), read beforehand into ``--corpus-dir``; each is checked against its
hash, its siblings there are importable, and the JSON records where it came from. It ends
with one summary row per file: the tests passing under each harness, every test whose
outcome differs (named), the session walls and their ratio, and the ratio over the tests
that ran (passed or failed) under both harnesses, from their JUnit times.

The machine is noisy (the same session varies by 2x between runs), so one pair decides
nothing when the two walls are close: ``--pairs N`` gives a file whose first two walls differ
by under ``--close`` (20 %) N pairs in all, each pair in the other order from the last (adopted
first, then torch's harness first...). Its row then gives the median wall of each harness and
the median of the pairs' ratios, and a test is a difference if its outcomes differ in any pair.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "torch": [],
    "adopt": ["--dist-adopt"],
    "adopt-fsdp-on-cpu": ["--dist-adopt", "--dist-adopt-fsdp-on-cpu"],
}


@dataclass
class Session:
    mode: str
    wall_s: float
    exit_code: int
    #: test id -> (outcome, seconds, message)
    tests: dict[str, tuple[str, float, str]]


def run_session(
    source: Path, mode: str, extra: list[str], timeout: float, siblings: Path | None = None
) -> Session:
    with tempfile.TemporaryDirectory(prefix=f"adopt-bench-{mode}-") as directory:
        work = Path(directory)
        shutil.copy(source, work / source.name)
        (work / "pytest.ini").write_text("[pytest]\n")
        env = dict(os.environ)
        # The repository, then the file's siblings (a corpus file may import another).
        paths = [str(REPO), *([str(siblings)] if siblings else []), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        command = [
            sys.executable, "-m", "pytest", source.name, "-q", "-p", "no:cacheprovider",
            "--junitxml", "junit.xml", *MODES[mode], *extra,
        ]  # fmt: skip
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = -1
        wall = time.perf_counter() - started
        junit = work / "junit.xml"
        tests = read_junit(junit) if junit.exists() else {}
    return Session(mode, wall, code, tests)


def read_junit(path: Path) -> dict[str, tuple[str, float, str]]:
    tests = {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if child is None else {"failure": "failed"}.get(child.tag, child.tag)
        message = "" if child is None else (child.get("message") or "")
        if child is not None and child.tag == "skipped" and child.get("type") == "pytest.xfail":
            outcome = "xfailed"
        tests[name] = (outcome, float(case.get("time") or 0.0), message)
    return tests


def table(file_name: str, sessions: list[Session]) -> list[str]:
    """One file's table: each adopted session against torch's own harness, test by test."""
    torch_run, adopted_runs = sessions[0], sessions[1:]
    names = sorted({name for session in sessions for name in session.tests})
    lines = [f"## {file_name}", ""]
    for adopted in adopted_runs:
        regressions = [
            name
            for name in names
            if torch_run.tests.get(name, ("",))[0] == "passed"
            and adopted.tests.get(name, ("",))[0] != "passed"
        ]
        lines += [
            f"- `{' '.join(MODES[adopted.mode])}`: session wall {adopted.wall_s:.1f} s "
            f"(exit {adopted.exit_code}) against torch's harness {torch_run.wall_s:.1f} s "
            f"(exit {torch_run.exit_code}): {torch_run.wall_s / adopted.wall_s:.1f}x; passes "
            f"under torch's harness but not adopted: {', '.join(regressions) or 'none'}",
        ]
    headers = ["torch's harness", *(f"`{' '.join(MODES[a.mode])}`" for a in adopted_runs)]
    lines += [
        "",
        "| test | " + " | ".join(f"{header} | s" for header in headers) + " |",
        "|---|" + "---|---:|" * len(headers),
    ]
    for name in names:
        cells = []
        for session in sessions:
            result = session.tests.get(name, ("not run", 0.0, ""))
            cells.append(f"{_outcome(result)} | {result[1]:.2f}")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


RAN = ("passed", "failed")


# How each harness words a test stopped for running too long: torch's ("Timing out after",
# "timed out") and distconform's ("rank N hung", "did not answer within").
_HANG = re.compile(r"\bhung\b|timed out|timing out|did not answer within", re.IGNORECASE)


def session_pairs(result: dict) -> list[tuple[dict, dict]]:
    """Each (torch's harness, adopted) pair of a file: the first two sessions, then the
    interleaved repeats of ``--pairs``."""
    first = (result["sessions"][0], result["sessions"][1])
    return [first, *((r["torch"], r["adopt"]) for r in result.get("repeats", []))]


def summary_row(result: dict) -> dict:
    """One file's figures: torch's harness against the adopted sessions, pair by pair."""
    pairs = session_pairs(result)
    torch_run, adopted = pairs[0]
    names = sorted({name for pair in pairs for session in pair for name in session["tests"]})

    def outcome(session: dict, name: str) -> str:
        return session["tests"].get(name, ["not run"])[0]

    def how(session: dict, name: str) -> str:
        """The outcome with its time, and whether it hung (a hang must cost only its own
        deadline: the times show it did)."""
        if name not in session["tests"]:
            return "not run"
        state, seconds, message = session["tests"][name]
        hung = ", hung" if _HANG.search(message or "") else ""
        return f"{state} ({seconds:.1f} s{hung})"

    differences = []
    for name in names:
        for index, (torch_session, adopted_session) in enumerate(pairs):
            if outcome(torch_session, name) != outcome(adopted_session, name):
                where = f" (pair {index + 1} of {len(pairs)})" if len(pairs) > 1 else ""
                differences.append(
                    f"{name}: {how(torch_session, name)} under torch's harness, "
                    f"{how(adopted_session, name)} adopted{where}"
                )
                break
    both_ran = [
        name for name in names if outcome(torch_run, name) in RAN and outcome(adopted, name) in RAN
    ]
    torch_s = sum(torch_run["tests"][name][1] for name in both_ran)
    adopted_s = sum(adopted["tests"][name][1] for name in both_ran)
    pair_ratios = [t["wall_s"] / a["wall_s"] for t, a in pairs if a["wall_s"]]
    return {
        "file": result["file"],
        "tests": len(names),
        "passed_torch": sum(outcome(torch_run, n) == "passed" for n in names),
        "passed_adopted": sum(outcome(adopted, n) == "passed" for n in names),
        "differences": differences,
        "pairs": len(pairs),
        "pair_ratios": pair_ratios,
        "wall_torch_s": statistics.median(t["wall_s"] for t, _ in pairs),
        "wall_adopted_s": statistics.median(a["wall_s"] for _, a in pairs),
        "ran_both": len(both_ran),
        "ran_both_torch_s": torch_s,
        "ran_both_adopted_s": adopted_s,
    }


def format_summary(results: list[dict]) -> str:
    """The corpus table: one row per file, then the corpus as a whole."""
    rows = [summary_row(result) for result in results]
    lines = [
        "| file | tests | pass torch / adopted | differences | session s torch / adopted "
        "| ratio | ran under both | their s torch / adopted | ratio |",
        "|---|---:|---|---|---|---:|---:|---|---:|",
    ]

    def ratio(a: float, b: float) -> str:
        if not b:
            return "-"
        # Two significant digits below 1: a file far slower adopted must not read 0.0x.
        return f"{a / b:.1f}x" if a >= b else f"{a / b:.2g}x"

    for row in rows:
        walls = f"{row['wall_torch_s']:.1f} / {row['wall_adopted_s']:.1f}"
        wall_ratio = ratio(row["wall_torch_s"], row["wall_adopted_s"])
        if row["pairs"] > 1:
            each = ", ".join(f"{r:.2f}x" for r in row["pair_ratios"])
            walls += f" (medians of {row['pairs']} interleaved pairs)"
            wall_ratio = f"{statistics.median(row['pair_ratios']):.2f}x ({each})"
        lines.append(
            f"| {row['file']} | {row['tests']} | {row['passed_torch']} / {row['passed_adopted']} "
            f"| {'; '.join(row['differences']) or 'none'} "
            f"| {walls} | {wall_ratio} | {row['ran_both']} "
            f"| {row['ran_both_torch_s']:.1f} / {row['ran_both_adopted_s']:.1f} "
            f"| {ratio(row['ran_both_torch_s'], row['ran_both_adopted_s'])} |"
        )
    torch_wall = sum(r["wall_torch_s"] for r in rows)
    adopted_wall = sum(r["wall_adopted_s"] for r in rows)
    torch_ran = sum(r["ran_both_torch_s"] for r in rows)
    adopted_ran = sum(r["ran_both_adopted_s"] for r in rows)
    lines.append(
        f"| **all** | {sum(r['tests'] for r in rows)} "
        f"| {sum(r['passed_torch'] for r in rows)} / {sum(r['passed_adopted'] for r in rows)} "
        f"| {sum(len(r['differences']) for r in rows)} "
        f"| {torch_wall:.1f} / {adopted_wall:.1f} | {ratio(torch_wall, adopted_wall)} "
        f"| {sum(r['ran_both'] for r in rows)} | {torch_ran:.1f} / {adopted_ran:.1f} "
        f"| {ratio(torch_ran, adopted_ran)} |"
    )
    return "\n".join(lines)


def corpus_files(manifest: Path, directory: Path, only: list[str]) -> list[dict]:
    """The manifest's entries (``only`` those named), each checked against its file."""
    entries = tomllib.loads(manifest.read_text())["file"]
    if only:
        unknown = sorted(set(only) - {entry["name"] for entry in entries})
        if unknown:
            raise SystemExit(f"not in {manifest}: {', '.join(unknown)}")
        entries = [entry for entry in entries if entry["name"] in only]
    for entry in entries:
        path = directory / entry["name"]
        if not path.is_file():
            raise SystemExit(
                f"{path}: missing; read {entry['repository']}:{entry['path']} at "
                f"{entry['commit']} into {directory}"
            )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if not digest.startswith(entry["sha256"]):
            raise SystemExit(f"{path}: sha256 {digest[:16]}, the manifest says {entry['sha256']}")
    return entries


def _outcome(result: tuple[str, float, str]) -> str:
    outcome, _, message = result
    if outcome in ("skipped", "failed") and message:
        # The reason without what each harness adds to it (an exit code, where it was decided).
        short = message.splitlines()[0].split("; ")[0].split(" (")[0][:70].replace("|", "/")
        return f"{outcome}: {short}"
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, help="write every measurement as JSON here")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per session")
    parser.add_argument(
        "--also-fsdp-on-cpu",
        action="store_true",
        help="a third session with --dist-adopt-fsdp-on-cpu (FSDPTest methods run on CPU ranks "
        "where their own harness skips them)",
    )
    parser.add_argument(
        "--corpus", type=Path, metavar="MANIFEST", help="run the files this TOML manifest lists"
    )
    parser.add_argument(
        "--corpus-dir", type=Path, metavar="DIR", help="where the manifest's files were read to"
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="only this corpus file"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        metavar="N",
        help="N interleaved pairs in all for a file whose first pair's walls are close",
    )
    parser.add_argument(
        "--close",
        type=float,
        default=0.2,
        metavar="FRACTION",
        help="walls this close (a fraction of the longer) get --pairs (default 0.2)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="RESULTS",
        help="print the tables of a saved run (--out) instead of running PATHs",
    )
    options, extra = parser.parse_known_args(argv)
    if options.from_json:
        print_saved(options.from_json)
        return 0
    if options.corpus:
        if options.corpus_dir is None:
            parser.error("--corpus needs --corpus-dir")
        entries = corpus_files(options.corpus, options.corpus_dir, options.only)
        sources = [(options.corpus_dir / e["name"], e, e.get("pytest_args", [])) for e in entries]
    elif options.paths:
        sources = [(path, None, []) for path in options.paths]
    else:
        parser.error("name the test files to run, --corpus MANIFEST, or --from-json RESULTS")
    # Before any session: a mistyped second path would otherwise end the run (and lose its
    # --out) only after the first file's sessions.
    missing = [str(path) for path, _, _ in sources if not path.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    extra = [arg for arg in extra if arg != "--"]
    results = []
    siblings = options.corpus_dir if options.corpus else None
    for source, origin, file_args in sources:
        args = [*file_args, *extra]
        print(f"running {source.name} under torch's harness...", file=sys.stderr, flush=True)
        torch_run = run_session(source, "torch", args, options.timeout, siblings)
        sessions = [torch_run]
        modes = ["adopt", "adopt-fsdp-on-cpu"] if options.also_fsdp_on_cpu else ["adopt"]
        for mode in modes:
            print(f"running {source.name}: {' '.join(MODES[mode])}...", file=sys.stderr, flush=True)
            sessions.append(run_session(source, mode, args, options.timeout, siblings))
        print("\n".join(table(source.name, sessions)) + "\n", flush=True)
        result = {"file": source.name, "sessions": [asdict(s) for s in sessions]}
        repeats = []
        if close(torch_run.wall_s, sessions[1].wall_s, options.close):
            for index in range(1, options.pairs):
                order = ["adopt", "torch"] if index % 2 else ["torch", "adopt"]
                print(
                    f"running {source.name}: pair {index + 1} of {options.pairs} "
                    f"({order[0]} first)...",
                    file=sys.stderr,
                    flush=True,
                )
                pair = {m: run_session(source, m, args, options.timeout, siblings) for m in order}
                repeats.append({"order": f"{order[0]} first"} | {m: asdict(pair[m]) for m in order})
        if repeats:
            result["repeats"] = repeats
        if origin is not None:
            result["origin"] = {k: origin[k] for k in ("repository", "path", "commit", "sha256")}
            result["pytest_args"] = args
        results.append(result)
        if options.out:  # after each file: a long corpus run keeps what it measured
            options.out.write_text(json.dumps(results, indent=1))
    print(format_summary(results))
    return 0


def close(first: float, second: float, fraction: float) -> bool:
    """Whether two walls differ by less than ``fraction`` of the longer."""
    return abs(first - second) < fraction * max(first, second)


def print_saved(path: Path) -> None:
    """The tables of a saved run (``--out``), as they were printed when it was measured."""
    for result in json.loads(path.read_text()):
        sessions = [
            Session(
                s["mode"], s["wall_s"], s["exit_code"], {k: tuple(v) for k, v in s["tests"].items()}
            )
            for s in result["sessions"]
        ]
        print("\n".join(table(result["file"], sessions)) + "\n")
    print(format_summary(json.loads(path.read_text())))


if __name__ == "__main__":
    sys.exit(main())
