"""--launcher external: pytest under torchrun or srun, one pytest process per rank.

One test file mixes every outcome. Each world runs it once, and the checks read what a
user would: rank 0's console, the other ranks' consoles, and rank 0's JUnit file (the
time of each test).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conformance.report_checks import check_report_dir

MIXED_MODULE = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    @pytest.mark.world_size(2, 4)
    def test_sum(rank_ctx):
        value = torch.ones(1)
        dist.all_reduce(value)
        assert value.item() == rank_ctx.world_size

    @pytest.mark.world_size(2, 4)
    def test_fails_on_rank_1_while_the_others_wait(rank_ctx):
        if rank_ctx.rank == 1:
            assert rank_ctx.rank == 0
        dist.barrier()

    @pytest.mark.world_size(2, 4)
    def test_mesh_after_a_failure(rank_ctx):
        mesh = rank_ctx.mesh((rank_ctx.world_size,), ("dp",))
        value = torch.ones(1)
        dist.all_reduce(value, group=mesh.get_group())
        assert value.item() == rank_ctx.world_size

    @pytest.mark.world_size(2, 4)
    def test_skipped_everywhere(rank_ctx):
        pytest.skip("not on this world")

    @pytest.mark.world_size(2, 4)
    def test_hangs_in_python_on_rank_1(rank_ctx):
        if rank_ctx.rank == 1:
            while True:
                pass
        dist.barrier()

    @pytest.mark.world_size(2, 4)
    def test_after_the_hang(rank_ctx):
        dist.barrier()
    """
)

# Only in the slow runs: a rank blocked in C code cannot come back, so the session stops.
BLOCKED_IN_C = textwrap.dedent(
    """

    @pytest.mark.world_size(2, 4)
    def test_blocks_in_c_on_rank_1(rank_ctx):
        if rank_ctx.rank == 1:
            import ctypes
            ctypes.CDLL(None).sleep(1000)
        dist.barrier()

    @pytest.mark.world_size(2, 4)
    def test_never_reached(rank_ctx):
        dist.barrier()
    """
)

PYTEST_ARGS = ["-p", "no:cacheprovider", "test_mixed.py", "--launcher", "external"]
DEADLINE_S = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_module(directory: Path, *, blocked_in_c: bool) -> None:
    text = MIXED_MODULE + (BLOCKED_IN_C if blocked_in_c else "")
    (directory / "test_mixed.py").write_text(text)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["DISTCONFORM_RANK_REPORT_DIR"] = str(tmp_path / "rank-reports")
    return env


def _junit_times(path: Path) -> dict[str, tuple[str, float]]:
    """Each test's outcome and seconds from rank 0's JUnit file."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        found[case.get("name")] = (outcome, float(case.get("time")))
    return found


def check_world(rank0: str, others: list[str], junit: Path, world_size: int, wall: float) -> None:
    """What every external world must show for the mixed module."""
    ws = f"ws{world_size}"
    times = _junit_times(junit)
    # A failure on rank 1 ends the test for every rank: the others are aborted by their peer
    # (no bound on the seconds: the group's 1 s timeout and a busy machine's delays are of
    # one size, and which comes first is not what this checks).
    outcome, _seconds = times[f"test_fails_on_rank_1_while_the_others_wait[{ws}]"]
    assert outcome == "failure", times
    failure = rank0[rank0.index(f"test_fails_on_rank_1_while_the_others_wait[{ws}] _") :]
    assert "rank 1 failed: AssertionError: assert 1 == 0" in failure
    assert re.search(r"^\s+0\s+aborted-by-peer", failure, re.M)
    # ... and the session goes on, on a rebuilt default group.
    assert times[f"test_mesh_after_a_failure[{ws}]"][0] == "passed", times
    assert times[f"test_skipped_everywhere[{ws}]"][0] == "skipped", times
    # A rank hung in Python code is reported with its stacks, then comes back.
    hang = rank0[rank0.index(f"test_hangs_in_python_on_rank_1[{ws}] _") :]
    assert f"rank 1 hung: still running at the {DEADLINE_S:.1f} s deadline" in hang
    assert "test_hangs_in_python_on_rank_1" in hang.split("rank  outcome")[0]
    assert times[f"test_after_the_hang[{ws}]"][0] == "passed", times
    # One report: rank 0 prints it; every other rank prints one line saying where its is.
    assert rank0.count("short test summary info") == 1
    for rank, console in enumerate(others, start=1):
        assert "short test summary info" not in console and "FAILURES" not in console
        assert re.search(
            rf"distconform: rank {rank} of {world_size} \(\w+\): rank 0 prints the report; "
            rf"this rank's pytest output is in \S+rank{rank}\.txt",
            console,
        ), console
    print(f"{world_size}-rank world: the whole file in {wall:.1f} s; per test: {times}")


def _torchrun(tmp_path: Path, *, nodes: int, per_node: int, extra: list[str]):
    """``nodes`` torchrun agents on loopback (c10d rendezvous), ``per_node`` ranks each."""
    port = _free_port()
    agents = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--node-rank", str(node),
            "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"distconform-{port}",
            "--redirects", "3", "--log-dir", str(tmp_path / f"logs-node{node}"),
            "-m", "pytest", *PYTEST_ARGS, *extra,
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=_env(tmp_path),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for agent in agents:
        agent.communicate(timeout=300)
    consoles = {}
    for node in range(nodes):
        for log in (tmp_path / f"logs-node{node}").rglob("stdout.log"):
            local = int(log.parent.name)
            consoles[node * per_node + local] = log.read_text()
    return [consoles[rank] for rank in sorted(consoles)]


def _mixed_world_under_torchrun(tmp_path: Path, *, nodes: int, per_node: int) -> str:
    """Run the mixed module (with the C-level block when several nodes) and check the
    world; rank 0's console for the checks of the caller."""
    _write_module(tmp_path, blocked_in_c=nodes > 1)
    started = time.monotonic()
    consoles = _torchrun(
        tmp_path,
        nodes=nodes,
        per_node=per_node,
        extra=["--dist-deadline", str(DEADLINE_S), "--junitxml", "report.xml"],
    )
    wall = time.monotonic() - started
    check_world(consoles[0], consoles[1:], tmp_path / "report.xml", nodes * per_node, wall)
    return consoles[0]


def test_a_torchrun_world_reports_every_outcome_once_and_goes_on(tmp_path):
    rank0 = _mixed_world_under_torchrun(tmp_path, nodes=1, per_node=2)
    assert "ws4" not in rank0.split("short test summary")[1]  # deselected in a world of 2


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_a_slurm_world_needs_no_torchrun(tmp_path):
    # What srun sets (and the MASTER_ADDR a job script exports); rank 0 hosts the store.
    _write_module(tmp_path, blocked_in_c=False)
    port = _free_port()
    started = time.monotonic()
    ranks = []
    for rank in range(2):
        env = _env(tmp_path) | {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_ID": "4242",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)
        args = ["--dist-deadline", str(DEADLINE_S), "--junitxml", "report.xml"]
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "pytest", *PYTEST_ARGS, *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    consoles = [rank.communicate(timeout=240)[0] for rank in ranks]
    wall = time.monotonic() - started
    check_world(consoles[0], consoles[1:], tmp_path / "report.xml", 2, wall)
    assert "(slurm)" in consoles[1]
    assert "srun --ntasks 2 python -m pytest 'test_mixed.py::" in consoles[0]
    assert (tmp_path / "rank-reports" / "slurm-4242" / "rank1.junit.xml").exists()


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback_report_once_and_stop_on_a_rank_that_cannot_return(
    tmp_path,
):
    rank0 = _mixed_world_under_torchrun(tmp_path, nodes=2, per_node=2)
    assert "rank 1 hung: no result within" in rank0
    assert "did not come back from test_mixed.py::test_blocks_in_c_on_rank_1[ws4]" in rank0
    assert "test_never_reached" not in rank0.split("short test summary")[0]


@pytest.mark.slow
def test_a_conformance_run_under_torchrun_writes_one_report_on_rank_0(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--redirects", "3", "--log-dir", str(tmp_path / "logs"),
        "-m", "distconform", "conformance", "--launcher", "external", "--world-sizes", "2",
        "--quick", "-k", "hsdp", "--out", str(tmp_path / "report"), "-p", "no:cacheprovider",
    ]  # fmt: skip
    subprocess.run(command, cwd=tmp_path, env=_env(tmp_path), timeout=300, check=False)
    report = check_report_dir(tmp_path / "report")
    assert report["complete"] and report["environment"]["launcher"] == "external"
    assert report["summary"]["counts"]["PASS"] >= 1 and report["summary"]["counts"]["FAIL"] == 0
    rank1 = next((tmp_path / "logs").rglob("attempt_0/1/stdout.log")).read_text()
    # Rank 1's console is the one line saying where its report went, nothing else.
    assert rank1.strip().splitlines() == [rank1.strip()] and "rank 0 prints the report" in rank1
