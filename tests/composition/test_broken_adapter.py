"""The pipeline gradient case fails on an implementation that sums instead of averaging.

Runs the suite item in a separate pytest session against
``tests.composition.adapters:no_grad_average`` and checks it fails on the gradient comparison
(a factor of the data-parallel size: max rel diff 1.0 at dp 2), not on something else. The
inner session uses rank threads: no rank processes to start, a third less CPU on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIPELINE_GRADIENT_CASE = (
    "suites/composition/test_pipeline.py::test_pipeline_parity[ws4-1F1B-fully_shard-fp32]"
)


def run_case(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", PIPELINE_GRADIENT_CASE, "--impl", spec, "-q",
         "-p", "no:cacheprovider", "-m", "slow or not slow", "--launcher", "thread"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # a whole inner pytest session: 15 s of CPU at best, minutes under load
def test_pipeline_gradient_case_fails_without_gradient_average():
    result = run_case("tests.composition.adapters:no_grad_average")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "1 failed" in output, output
    assert "gradient of 'layers." in output and "max rel diff 1.000e+00" in output, output
