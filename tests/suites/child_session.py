"""One suite item run in a child ``python -m pytest`` (the broken-implementation and
broken-backend tests): its JUnit test case, read back with the session's output."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_one_item(nodeid: str, options: list[str], report: Path, timeout: float) -> tuple:
    """``(failures and errors of the one item, output)``; fails unless exactly one item ran.

    Every case of the slow run is selectable (``-m "slow or not slow"``).
    """
    command = [sys.executable, "-m", "pytest", nodeid, *options, "-m", "slow or not slow"]
    command += ["-p", "no:cacheprovider", f"--junitxml={report}", "-q"]
    # From the package folder: the suites' ids (suites/...) are paths there.
    result = subprocess.run(
        command, cwd=ROOT / "distconform", capture_output=True, text=True, timeout=timeout
    )
    output = result.stdout + result.stderr
    assert report.exists(), f"no report from the child session:\n{output[-3000:]}"
    cases = ET.parse(report).getroot().findall(".//testcase")
    assert len(cases) == 1, f"{nodeid} selected {len(cases)} items:\n{output[-3000:]}"
    assert not cases[0].findall("skipped"), f"{nodeid} was skipped:\n{output[-3000:]}"
    return cases[0].findall("failure") + cases[0].findall("error"), output


def failure_text(failures: list) -> str:
    """The messages and texts of a test case's failures, joined."""
    return " ".join((f.get("message") or "") + (f.text or "") for f in failures)
