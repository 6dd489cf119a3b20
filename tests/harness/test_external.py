"""--launcher external: pytest under torchrun, one pytest process per rank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

TORCHRUN_MODULE = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.world_size(2, 4)
    def test_sum(rank_ctx):
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == rank_ctx.world_size

    @pytest.mark.world_size(2)
    def test_fails_on_rank_1(rank_ctx):
        assert rank_ctx.rank != 1, "rank 1 disagrees"

    @pytest.mark.world_size(2)
    def test_mesh_after_a_failure(rank_ctx):
        mesh = rank_ctx.mesh((2,), ("dp",))
        value = torch.ones(1)
        dist.all_reduce(value, group=mesh.get_group())
        assert value.item() == 2

    @pytest.mark.world_size(2)
    def test_hangs_on_rank_1(rank_ctx):
        if rank_ctx.rank == 1:
            while True:
                pass

    @pytest.mark.world_size(2)
    def test_after_the_hang(rank_ctx):
        dist.barrier()
    """
)


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_ranks_report_every_rank_through_rank_0(tmp_path):
    (tmp_path / "test_under_torchrun.py").write_text(TORCHRUN_MODULE)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--redirects",
            "3",
            "--log-dir",
            str(tmp_path / "logs"),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "test_under_torchrun.py",
            "--launcher",
            "external",
            "--dist-deadline",
            "5",
            "-rA",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    logs = {
        rank: next((tmp_path / "logs").rglob(f"attempt_0/{rank}/stdout.log")).read_text()
        for rank in (0, 1)
    }
    rank0 = logs[0]
    assert "rank 0 of a torchrun world of 2" in rank0
    # ws4 cannot run in a world of 2: deselected, identically on both ranks.
    assert "1 deselected" in rank0 and "1 deselected" in logs[1]
    failure = rank0[rank0.index("test_fails_on_rank_1[ws2] _") :]
    assert "rank 1 failed: AssertionError: rank 1 disagrees" in failure
    assert re.search(r"^\s+0\s+passed", failure, re.M)
    assert re.search(r"^\s+1\s+failed", failure, re.M)
    assert "torchrun --nproc-per-node 2 -m pytest" in failure
    # A failure with every rank back leaves the world usable: the next test passes.
    assert "PASSED test_under_torchrun.py::test_mesh_after_a_failure[ws2]" in rank0
    hang = rank0[rank0.index("test_hangs_on_rank_1[ws2] _") :]
    assert "rank 1 hung: no result within the 5.0 s deadline" in hang
    assert "test_hangs_on_rank_1" in hang.split("rank  outcome")[0]  # rank 1's own stack
    # After a hang the world cannot be trusted: the session stops, nothing is skipped.
    assert "left the torchrun world in an unknown state" in rank0
    assert "test_after_the_hang" not in rank0.split("short test summary")[0].split("FAILURES")[0]
    assert completed.returncode != 0
