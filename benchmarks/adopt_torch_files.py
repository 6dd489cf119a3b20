"""Test files written for torch's distributed harness: outcome and wall time per test under
torch's own harness and under ``--dist-adopt``, in one table.

    python benchmarks/adopt_torch_files.py PATH [PATH ...] [--out results.json] [-- PYTEST ARGS]

Each file (e.g. PyTorch's ``test/distributed/_composable/fsdp/test_fully_shard_training.py``
from a checkout) is copied into a fresh temporary directory and run twice, each time as its
own ``pytest`` session, as a user waits for it: first as pytest runs unittest classes anyway
(torch's ``MultiProcessTestCase`` / ``MultiThreadedTestCase`` spawn their ranks for every
test method), then with ``--dist-adopt`` (warm rank pools). The table gives each test's
outcome and time from pytest's JUnit file, the session walls, their ratio, and first the
tests that pass under torch's harness but not when adopted (the adapter's regressions; the
list should be empty). ``--also-fsdp-on-cpu`` adds a session with ``--dist-adopt-fsdp-on-cpu``.
Files are only read: nothing is written next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
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


def run_session(source: Path, mode: str, extra: list[str], timeout: float) -> Session:
    with tempfile.TemporaryDirectory(prefix=f"adopt-bench-{mode}-") as directory:
        work = Path(directory)
        shutil.copy(source, work / source.name)
        (work / "pytest.ini").write_text("[pytest]\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
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
        "--from-json",
        type=Path,
        metavar="RESULTS",
        help="print the tables of a saved run (--out) instead of running PATHs",
    )
    options, extra = parser.parse_known_args(argv)
    if options.from_json:
        print_saved(options.from_json)
        return 0
    if not options.paths:
        parser.error("name the test files to run (or --from-json RESULTS)")
    # Before any session: a mistyped second path would otherwise end the run (and lose its
    # --out) only after the first file's sessions.
    missing = [str(path) for path in options.paths if not path.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    extra = [arg for arg in extra if arg != "--"]
    results = []
    for source in options.paths:
        print(f"running {source.name} under torch's harness...", file=sys.stderr, flush=True)
        torch_run = run_session(source, "torch", extra, options.timeout)
        sessions = [torch_run]
        modes = ["adopt", "adopt-fsdp-on-cpu"] if options.also_fsdp_on_cpu else ["adopt"]
        for mode in modes:
            print(f"running {source.name}: {' '.join(MODES[mode])}...", file=sys.stderr, flush=True)
            sessions.append(run_session(source, mode, extra, options.timeout))
        print("\n".join(table(source.name, sessions)) + "\n", flush=True)
        results.append({"file": source.name, "sessions": [asdict(s) for s in sessions]})
    if options.out:
        options.out.write_text(json.dumps(results, indent=1))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
