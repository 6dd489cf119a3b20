"""The pytest side: parametrization, reports, skips, output sections, bad input."""

from __future__ import annotations

import re
import textwrap

import pytest

FAILING_MODULE = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.world_size(2, 4)
    def test_passes(rank_ctx):
        value = torch.ones(1)
        dist.all_reduce(value)
        print(f"sum on rank {rank_ctx.rank} is {value.item()}")
        assert value.item() == rank_ctx.world_size

    @pytest.mark.world_size(2)
    def test_fails_on_rank_1(rank_ctx):
        print(f"rank {rank_ctx.rank} reached the check")
        assert rank_ctx.rank != 1, "rank 1 disagrees"
        dist.barrier()

    @pytest.mark.world_size(2)
    def test_after_a_failure(rank_ctx):
        dist.barrier()
    """
)


def run_inner(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--dist-peer-grace=0.5", *args)


def test_world_sizes_become_parametrize_ids(pytester):
    pytester.makepyfile(test_ids=FAILING_MODULE)
    result = run_inner(pytester, "--collect-only", "-q")
    assert "test_ids.py::test_passes[ws2]" in result.outlines
    assert "test_ids.py::test_passes[ws4]" in result.outlines
    result = run_inner(pytester, "--collect-only", "-q", "--world-sizes", "4")
    assert "test_ids.py::test_passes[ws4]" in result.outlines
    assert "test_ids.py::test_passes[ws2]" not in result.outlines


def test_failure_report_puts_the_failing_rank_first(pytester):
    pytester.makepyfile(test_report=FAILING_MODULE)
    result = run_inner(pytester, "--dist-seed", "1234", "-rA")
    result.assert_outcomes(passed=3, failed=1)
    text = result.stdout.str()
    failure = text[text.index("test_fails_on_rank_1[ws2] __") :]
    headline = failure.splitlines()[1]
    assert headline.startswith("rank 1 failed: AssertionError: rank 1 disagrees")
    assert "seed 1234" in headline
    assert re.search(r"^\s+0\s+aborted-by-peer", failure, re.M)
    assert re.search(r"^\s+1\s+failed", failure, re.M)
    assert "--dist-seed 1234" in failure
    assert "python -m pytest 'test_report.py::test_fails_on_rank_1[ws2]'" in failure
    # Each rank's output is its own report section.
    assert "Captured output rank 1 call" in failure
    assert "rank 1 reached the check" in failure
    # The pool was recycled and the next test passed: nothing skipped.
    assert "test_report.py::test_after_a_failure[ws2]" in text
    assert "skipped" not in result.outlines[-1]


def test_dash_s_streams_rank_output_with_a_prefix(pytester):
    pytester.makepyfile(test_stream=FAILING_MODULE)
    result = run_inner(pytester, "-s", "-k", "test_passes and ws2")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*[[]rank 0[]] sum on rank 0 is 2.0*"])
    result.stdout.fnmatch_lines(["*[[]rank 1[]] sum on rank 1 is 2.0*"])


def test_skips_decided_in_the_parent_never_spawn(pytester, monkeypatch):
    monkeypatch.setenv("DISTCONFORM_FAKE_DEVICE_COUNT", "0")  # "has 0" on a GPU machine too
    pytester.makeconftest(
        """
        from distconform.harness.controller.process.pool import ProcessPool

        def refuse_to_spawn(*args, **kwargs):
            raise AssertionError("a rank was spawned for a test that must be skipped")

        ProcessPool._spawn = refuse_to_spawn
        """
    )
    pytester.makepyfile(
        test_skips="""
        import pytest

        @pytest.mark.world_size(2)
        @pytest.mark.requires_accelerator
        def test_needs_accelerator(rank_ctx):
            pass

        @pytest.mark.world_size(2)
        def test_needs_devices(rank_ctx):
            pass
        """
    )
    result = run_inner(pytester, "-rs", "-k", "accelerator")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs an accelerator; this run's device is cpu*"])
    result = run_inner(pytester, "-rs", "--device", "cuda", "-k", "devices")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 2 cuda device(s), this machine has 0*"])


def test_inconsistent_skip_fails_naming_the_ranks(pytester):
    pytester.makepyfile(
        test_skip="""
        import pytest

        @pytest.mark.world_size(4)
        def test_skips_on_some(rank_ctx):
            if rank_ctx.rank in (1, 3):
                pytest.skip("no luck on odd ranks")

        @pytest.mark.world_size(2)
        def test_skips_everywhere(rank_ctx):
            pytest.skip("not today")
        """
    )
    result = run_inner(pytester, "-rs")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*inconsistent skip: ranks 1, 3 skipped (no luck on odd ranks) but ranks 0, 2 did not*",
            "*not today*",
        ]
    )


def test_bad_configuration_is_a_usage_error_without_spawning(pytester):
    pytester.makepyfile(test_any="def test_nothing():\n    pass\n")
    result = run_inner(pytester, "--launcher", "thread", "--backend", "gloo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "always uses the 'threaded' backend" in result.stderr.str()


def test_bad_world_size_marker_is_reported(pytester):
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.world_size(0)
        def test_zero(rank_ctx):
            pass
        """
    )
    result = run_inner(pytester)
    assert result.ret != 0
    output = result.stdout.str() + result.stderr.str()
    assert "world size must be a positive integer, got 0" in output


def test_unpicklable_fixture_value_is_named(pytester):
    pytester.makepyfile(
        test_pickle="""
        import threading
        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.world_size(2)
        def test_uses_lock(rank_ctx, lock):
            pass
        """
    )
    result = run_inner(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cannot ship to the ranks: lock (lock) could not be pickled*"])


def test_a_rerun_keeps_the_failed_attempts_rank_report(pytester):
    marker = pytester.path / "attempted"
    pytester.makepyfile(
        test_flaky=f"""
        import os
        import pytest

        @pytest.mark.world_size(2)
        def test_flaky(rank_ctx):
            if not os.path.exists({str(marker)!r}):
                if rank_ctx.rank == 1:
                    open({str(marker)!r}, "w").close()
                    raise ValueError("the first attempt fails on rank 1")
        """
    )
    result = run_inner(pytester, "--reruns", "1", "--junitxml", "report.xml")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    result.stdout.fnmatch_lines(
        [
            "*distributed tests rerun: the failed attempts*",
            "*test_flaky.py::test_flaky[[]ws2[]] (rerun)*",
            "rank 1 failed: ValueError: the first attempt fails on rank 1*",
        ]
    )
    junit = (pytester.path / "report.xml").read_text()
    assert 'name="rerun"' in junit
    assert "rank 1 failed: ValueError: the first attempt fails on rank 1" in junit
    assert 'value="0:passed 1:passed"' in junit  # the attempt that passed


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_the_summary_counts_pool_starts_and_replaced_pools(pytester):
    pytester.makepyfile(test_pools_started=FAILING_MODULE)
    result = run_inner(pytester)
    # The failure on rank 1 broke the ws-2 pool: the next ws-2 test needed a new one.
    result.stdout.fnmatch_lines(
        ["distconform: started 3 rank pool(s); 1 replaced a pool that a test left broken*"]
    )
    # Without a replaced pool the line waits for -v.
    quiet = run_inner(pytester, "-k", "test_passes")
    assert "distconform: started" not in quiet.stdout.str()
