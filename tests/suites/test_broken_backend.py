"""The backend suite fails on a backend that wraps gloo and breaks one thing (a wrong reduce
op, async work that completes early, a wrong uneven all_to_all split), with the complaint
that names the bug, and passes the same items on the unbroken wrapper.

Each row runs one backend-suite item in a child ``python -m pytest`` with
``--backend-plugin tests.suites.broken_backend --backend <name>_gloo`` and gloo's own
declaration under that name (the wrapper supports what gloo does).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from suites.backend.declaration import DECLARATIONS_DIR

ROOT = Path(__file__).resolve().parents[2]

WRONG_OP = "suites/backend/test_reductions.py::test_all_reduce[ws2-op=max-dtype=int64]"
EARLY = (
    "suites/backend/test_async.py::test_async_work_completes_only_when_every_rank_has_joined[ws2]"
)
SPLIT = "suites/backend/test_data_movement.py::test_all_to_all[ws2-dtype=float32]"

# Each row costs a child session (about 7 s): one runs by default, all with -m slow.
ROWS = [
    pytest.param("wrong_op", WRONG_OP, "all_reduce max int64", id="wrong_op"),
    pytest.param(
        "early_async",
        EARLY,
        "is_completed() was True before rank 1 joined",
        id="early_async",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "wrong_split", SPLIT, "single, uneven splits", id="wrong_split", marks=pytest.mark.slow
    ),
]


def run_item(tmp_path: Path, backend: str, nodeid: str) -> tuple[list, str]:
    """The child session's failures of ``nodeid`` on ``backend``, and its output."""
    declaration = tmp_path / f"{backend}.toml"
    gloo = (DECLARATIONS_DIR / "gloo.toml").read_text()
    declaration.write_text(gloo.replace('backend = "gloo"', f'backend = "{backend}"'))
    report = tmp_path / f"{backend}.xml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            nodeid,
            "--backend-plugin",
            "tests.suites.broken_backend",
            "--backend",
            backend,
            "--backend-declaration",
            str(declaration),
            "-m",
            "slow or not slow",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-q",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert report.exists(), f"no report from the child session:\n{output[-3000:]}"
    cases = ET.parse(report).getroot().findall(".//testcase")
    assert len(cases) == 1, f"{nodeid} selected {len(cases)} items:\n{output[-3000:]}"
    skipped = cases[0].findall("skipped")
    assert not skipped, f"{nodeid} was skipped on {backend}:\n{output[-3000:]}"
    return cases[0].findall("failure") + cases[0].findall("error"), output


@pytest.mark.parametrize(("breakage", "nodeid", "complaint"), ROWS)
def test_backend_suite_fails_on_a_broken_backend(tmp_path, breakage, nodeid, complaint):
    failures, output = run_item(tmp_path, f"{breakage}_gloo", nodeid)
    assert failures, f"{nodeid} passed on the {breakage} backend:\n{output[-3000:]}"
    message = " ".join((f.get("message") or "") + (f.text or "") for f in failures)
    assert complaint in message, (
        f"{nodeid} failed on {breakage}, but not with {complaint!r}:\n{message[-3000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("nodeid", [WRONG_OP, EARLY, SPLIT], ids=["op", "async", "split"])
def test_the_unbroken_wrapper_passes(tmp_path, nodeid):
    failures, output = run_item(tmp_path, "wrapped_gloo", nodeid)
    assert not failures, f"{nodeid} failed on the unbroken wrapper:\n{output[-3000:]}"
