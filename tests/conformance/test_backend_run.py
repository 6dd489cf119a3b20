"""``python -m distconform conformance --suite backend``: the command line it stands for, and one
real quick run on gloo whose report is about the backend only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from distconform.conformance.cli import pytest_args
from tests.conformance.report_checks import check_report_dir

ROOT = Path(__file__).resolve().parents[2]


def test_the_suite_option_chooses_the_directory():
    fsdp = pytest_args(["--impl", "torch"])
    backend_dir = next(arg for arg in fsdp if arg.endswith("suites/backend"))
    assert fsdp[fsdp.index(backend_dir) - 1] == "--ignore"  # the FSDP run leaves it out
    backend = pytest_args(["--suite", "backend", "--backend", "gloo"])
    assert backend[-1].endswith("suites/backend") and "--ignore" not in backend
    assert backend[backend.index("--backend") + 1] == "gloo"
    declared = pytest_args(["--suite", "backend", "--backend-declaration", "mine.toml"])
    assert declared[declared.index("--backend-declaration") + 1] == "mine.toml"


def test_the_selection_is_spelled_out_not_left_to_an_ini_file():
    # Installed, distconform's pyproject.toml (addopts -m "not slow") is not there.
    quick, full = pytest_args(["--quick"]), pytest_args([])
    assert quick[quick.index("-m") + 1] == "not slow"
    assert full[full.index("-m") + 1] == "slow or not slow"


def test_a_quick_backend_run_reports_on_the_backend(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "distconform",
            "conformance",
            "--suite",
            "backend",
            "--backend",
            "gloo",
            "--quick",
            "--out",
            str(out),
            "-k",
            "test_all_reduce or test_all_gather_uneven",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    report = check_report_dir(out)
    backend = report["environment"]["backend_declaration"]
    assert backend["name"] == "gloo"
    assert backend["declaration"].endswith("suites/backend/declarations/gloo.toml")
    assert "reduce_op.premul_sum" in backend["not_declared"]
    assert {test["subject"] for test in report["tests"]} == {"backend"}
    profiles = [profile["name"] for profile in report["profiles"]]
    assert profiles[0] == "c10d-core" and "fsdp2-core" not in profiles
    statuses = {test["nodeid"].split("::")[1]: test["status"] for test in report["tests"]}
    assert statuses["test_all_gather_uneven_list[ws2-dtype=float32]"] == "UNSUPPORTED"
    assert statuses["test_all_reduce[ws2-op=sum-dtype=float32]"] == "PASS"
    markdown = (out / "conformance.md").read_text()
    assert markdown.startswith("# Conformance report: backend gloo")
    assert "- `reduce_op.premul_sum`: RuntimeError: Cannot use ReduceOp.PREMUL_SUM" in markdown
