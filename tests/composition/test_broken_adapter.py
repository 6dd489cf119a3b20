"""The pipeline gradient case fails on an implementation that sums instead of averaging.

Runs the suite item in a separate pytest session against
``tests.composition.adapters:no_grad_average`` (torch's FSDP2, driven by the pipelining engine)
and the zero-bubble item against ``reference_no_grad_average`` (the reference, driven by the
suite's ``DataParallelStage``), and checks each fails on the gradient comparison (a factor of
the data-parallel size: max rel diff 1.0 at dp 2), not on something else. The inner session
uses rank threads: no rank processes to start, a third less CPU on 2 cores.
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
# The split backward, on a stage the suite drives itself (DataParallelStage).
ZERO_BUBBLE_GRADIENT_CASE = (
    "suites/composition/test_pipeline.py::"
    "test_pipeline_parity[ws4-InterleavedZeroBubble-fully_shard-fp32]"
)


def run_case(spec: str, case: str = PIPELINE_GRADIENT_CASE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            case,
            "--impl",
            spec,
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "slow or not slow",
            "--launcher",
            "thread",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow  # a whole inner pytest session: 15 s of CPU at best, minutes under load
def test_pipeline_gradient_case_fails_without_gradient_average():
    result = run_case("tests.composition.adapters:no_grad_average")
    assert_fails_on_gradient_sum(result.stdout + result.stderr, result.returncode)


@pytest.mark.slow  # another inner session
def test_zero_bubble_gradient_case_fails_on_the_reference_without_gradient_average():
    result = run_case(
        "tests.composition.adapters:reference_no_grad_average", ZERO_BUBBLE_GRADIENT_CASE
    )
    assert_fails_on_gradient_sum(result.stdout + result.stderr, result.returncode)


def assert_fails_on_gradient_sum(output: str, returncode: int) -> None:
    assert returncode == 1, output
    assert "1 failed" in output, output
    assert "gradient of 'layers." in output and "max rel diff 1.000e+00" in output, output
