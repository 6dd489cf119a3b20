"""Suites are device-generic: every conformance case runs under the device audit.

On a CPU run a tensor created without a device and one created on ``rank_ctx.device`` are
the same; on ``--device cuda`` the first lands on the CPU and the case breaks on the GPU
runners it exists for. ``@conformance`` therefore marks every case ``device_audit``, and a
case that creates a tensor without a device fails on CPU with the line to fix.
"""

from __future__ import annotations

import textwrap

from distconform.suites.cases import conformance

CASE = "fsdp.world_size_1"  # one rank: the cheapest pool


def test_conformance_cases_run_under_the_device_audit():
    @conformance(CASE)
    def case_function(rank_ctx, impl):  # pragma: no cover - only its marks are read
        pass

    names = [mark.name for mark in case_function.pytestmark]
    assert "device_audit" in names, names


def test_a_case_that_leaves_a_tensor_off_the_rank_device_fails_on_cpu(pytester):
    pytester.makepyfile(
        test_off_device=textwrap.dedent(
            f"""
            import torch
            from distconform.suites.cases import conformance

            @conformance({CASE!r})
            def test_forgets_the_device(rank_ctx):
                torch.randn(4, 8)

            @conformance({CASE!r})
            def test_places_everything(rank_ctx):
                with torch.device(rank_ctx.device):
                    torch.nn.Linear(8, 8)(torch.randn(4, 8))
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_off_device.py:6 created a tensor with torch.randn and no device*"]
    )
