"""``--dist-adopt`` on ``MultiProcContinuousTest`` classes: one world per class, on warm pools.

One session runs ``CONTINUOUS`` (a plain continuous class, one that fails on rank 1, one
whose backend is missing, a ``DTensorContinuousTestBase`` class) with ``--dist-adopt``; each
test below checks one aspect of it against what torch's harness documents for the class:
its worker runs the class's ``_init_pg`` once, then every test of the class in the same
process with the class's ``rank`` and ``world_size``, seeded with ``set_rng_seed()``; after a
failure the class's remaining tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adopt.junit_outcomes import method_outcomes

REPO = Path(__file__).resolve().parents[2]

CONTINUOUS = """
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
)


class TestOneWorld(MultiProcContinuousTest):
    world_size = 2
    joined = 0
    parent_set_up = []

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.parent_set_up.append(os.getpid())

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        super()._init_pg(rank, world_size, rdvz_file)
        cls.joined += 1

    def test_a_all_reduce(self):
        value = torch.ones(1) * (self.rank + 1)
        dist.all_reduce(value)
        self.assertEqual(value.item(), 3.0)
        type(self).seen_by_a = os.getpid()

    def test_b_the_class_joined_its_world_once(self):
        self.assertEqual(type(self).joined, 1)
        self.assertEqual(type(self).seen_by_a, os.getpid())  # the same worker process
        self.assertIs(type(self).pg, dist.group.WORLD)
        self.assertEqual((self.rank, self.world_size), (dist.get_rank(), 2))
        self.assertEqual((type(self).rank, type(self).world_size), (dist.get_rank(), 2))
        self.assertEqual(os.environ["LOCAL_RANK"], str(self.rank))
        # setUpClass ran in pytest's process, never in a worker.
        self.assertEqual(type(self).parent_set_up, [])

    def test_c_seeded_like_torch(self):
        expected = torch.rand(3, generator=torch.Generator().manual_seed(1234))
        self.assertEqual(torch.rand(3), expected)


class TestFailsOnRankOne(MultiProcContinuousTest):
    world_size = 2

    def test_1_fails_on_rank_1(self):
        dist.barrier()
        self.assertNotEqual(self.rank, 1, "rank 1 disagrees")

    def test_2_after_the_failure(self):
        pass


class TestWithoutItsBackend(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "mpi"

    def test_never_runs(self):
        pass


class TestDTensorContinuous(DTensorContinuousTestBase):
    world_size = 4

    def test_shard_and_gather(self):
        mesh = self.build_device_mesh()
        full = torch.arange(8.0)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), full[2 * self.rank : 2 * self.rank + 2])
        self.assertEqual(sharded.full_tensor(), full)
"""


def run_continuous(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``pytest --dist-adopt *args`` on ``CONTINUOUS`` written into ``root``, as a user runs it."""
    (root / "test_continuous.py").write_text(CONTINUOUS)
    (root / "pytest.ini").write_text("[pytest]\n")
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "test_continuous.py", "--dist-adopt", "-rA", "-v",
         "--dist-peer-grace", "0.5", "-p", "no:cacheprovider", *args],
        cwd=root, env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    root = tmp_path_factory.mktemp("continuous")
    done = run_continuous(root, "--junitxml", "junit.xml")
    return done, method_outcomes(root / "junit.xml", done)


def test_each_method_is_an_item_with_the_outcome_its_own_harness_gives(adopted):
    done, outcomes = adopted
    statuses = {name: status for name, (status, _) in outcomes.items()}
    assert statuses == {
        "TestOneWorld::test_a_all_reduce": "passed",
        "TestOneWorld::test_b_the_class_joined_its_world_once": "passed",
        "TestOneWorld::test_c_seeded_like_torch": "passed",
        "TestFailsOnRankOne::test_1_fails_on_rank_1": "failure",
        "TestFailsOnRankOne::test_2_after_the_failure": "skipped",
        "TestWithoutItsBackend::test_never_runs": "skipped",
        "TestDTensorContinuous::test_shard_and_gather": "passed",
    }, done.stdout + done.stderr


def test_a_failure_on_rank_1_reads_rank_1_failed_with_the_per_rank_report(adopted):
    done, _ = adopted
    start = done.stdout.index("_ TestFailsOnRankOne.test_1_fails_on_rank_1 _")
    report = done.stdout[start : done.stdout.find("\n____", start + 1)]
    headline = report.splitlines()[1]
    assert headline.startswith("rank 1 failed: AssertionError:"), report
    assert "rank 1 disagrees" in headline and "ws 2, process/gloo/cpu" in headline
    # The per-rank table: rank 0 passed its part, rank 1 failed.
    assert any(line.split()[:2] == ["1", "failed"] for line in report.splitlines()), report
    assert "reproduce with:" in report
    assert "test_continuous.py::TestFailsOnRankOne::test_1_fails_on_rank_1" in report
    # Not torch's report of its own workers.
    assert "exited with error code" not in report and "Exception in worker" not in report


def test_after_a_failure_the_rest_of_the_class_is_skipped_and_says_why(adopted):
    _, outcomes = adopted
    _, reason = outcomes["TestFailsOnRankOne::test_2_after_the_failure"]
    assert "TestFailsOnRankOne.test_1_fails_on_rank_1 failed" in reason, reason
    assert "MultiProcContinuousTest" in reason


def test_a_class_whose_backend_is_missing_is_skipped_as_its_parent_skips_it(adopted):
    _, outcomes = adopted
    assert outcomes["TestWithoutItsBackend::test_never_runs"][1].endswith(
        "Backend 'mpi' is not available"
    )


@pytest.mark.slow  # a second session of the sample; nightly
def test_on_the_thread_launcher_a_continuous_class_runs_on_process_ranks(tmp_path):
    done = run_continuous(tmp_path, "--launcher", "thread", "-k", "TestOneWorld")
    # Its rank lives in class attributes, which rank threads would share.
    assert "3 passed" in done.stdout, done.stdout + done.stderr
