"""``--dist-adopt`` on test classes written for torch's own distributed harness.

One pytest session runs ``SAMPLE`` (every base class of the family, the conventions those
tests use, a failure, a hang, a class that changes process-wide state) and writes a JUnit
file; each test below checks one aspect of that session, so it is paid for once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.adopt.junit_outcomes import method_outcomes

REPO = Path(__file__).resolve().parents[2]

SAMPLE = """
import copy
import os
import threading
import time
import unittest

import pytest
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group as bound_destroy
from torch.distributed import init_process_group as bound_init
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_fsdp import FSDPTest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class TestProcesses(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):  # as such classes are written; adoption never calls it (it spawns)
        super().setUp()
        self._spawn_processes()

    def _init(self, world_size=None):
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(self.file_name, self.world_size),
            rank=self.rank,
            world_size=world_size or self.world_size,
        )

    def test_all_reduce(self):
        self._init()
        value = torch.ones(3) * (self.rank + 1)
        dist.all_reduce(value)
        self.assertEqual(value, torch.full((3,), 3.0))
        dist.destroy_process_group()

    def test_init_of_this_world_is_served_by_the_pool(self):
        dist.init_process_group("gloo", rank=self.rank, world_size=2)
        dist.barrier()
        dist.destroy_process_group()

    def test_init_bound_when_the_module_was_imported(self):
        bound_init("gloo", store=dist.FileStore(self.file_name, 2), rank=self.rank, world_size=2)
        dist.barrier()
        bound_destroy()

    def test_rank_and_the_shared_store_file(self):
        self.assertEqual(self.rank, dist.get_rank())
        self.assertTrue(os.path.exists(self.file_name))
        names = [None, None]
        dist.all_gather_object(names, self.file_name)
        self.assertEqual(names[0], names[1])

    def test_seeded_as_torch_seeds_its_children(self):
        expected = torch.rand(3, generator=torch.Generator().manual_seed(1234))
        self.assertEqual(torch.rand(3), expected)

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self):
        raise AssertionError("a CPU run must skip this")

    @unittest.skip("not today")
    def test_skipped_by_unittest(self):
        raise AssertionError("skipped at collection")

    @unittest.expectedFailure
    def test_expected_to_fail(self):
        self.assertEqual(1, 2)

    @parametrize("factor", [1, 3])
    def test_parametrized(self, factor):
        self.assertEqual(dist.get_world_size() * factor, 2 * factor)

    def test_fails_on_rank_1(self):
        self.assertNotEqual(self.rank, 1, "rank 1 disagrees")

    def test_asks_for_another_world_size(self):
        self._init(world_size=4)

    def test_rank_0_then_warms_a_new_pool(self):
        # unittest runs methods by name: this one comes between the two hangs, so that the
        # second one's short deadline is spent on its body, not on a new pool's imports of
        # this module (seconds on a busy machine).
        dist.barrier()

    @pytest.mark.deadline(3)
    def test_rank_0_waits_for_a_rank_that_left(self):
        if self.rank == 0:
            dist.barrier()

    @pytest.mark.deadline(2)
    def test_rank_0_spins_in_python(self):
        if self.rank == 0:
            while True:
                time.sleep(0.05)

    def test_after_the_failures(self):
        dist.barrier()


instantiate_parametrized_tests(TestProcesses)


class TestFourRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 4

    def test_world(self):
        self.assertEqual(dist.get_world_size(), 4)


class TestThreads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 4

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def test_all_reduce_and_a_subgroup(self):
        # On rank threads of the harness, with its threaded backend (not torch's
        # ProcessLocalGroup, which importing torch's test package registers under that name).
        self.assertIsNot(threading.current_thread(), threading.main_thread())
        self.assertEqual(type(dist.group.WORLD).__name__, "ThreadedProcessGroup")
        SHARED_BY_THE_RANK_THREADS.append(self.rank)
        value = torch.ones(2)
        dist.all_reduce(value)
        self.assertEqual(value, torch.full((2,), 4.0))
        self.assertEqual(sorted(SHARED_BY_THE_RANK_THREADS[-4:]), [0, 1, 2, 3])
        pair = dist.new_group([0, 1])
        if self.rank < 2:
            self.assertEqual(type(pair).__name__, "ThreadedProcessGroup")
            dist.all_reduce(value, group=pair)
            self.assertEqual(value, torch.full((2,), 8.0))

    def test_fails_on_rank_2(self):
        for step in range(3):
            with self.subTest("steps", step=step):
                self.assertFalse(self.rank == 2 and step == 1, "rank 2 disagrees")

    def test_ddp_backward(self):
        # DDP's reducer waits for its buckets' all-reduces in C++, never back in Python.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        plain = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-5)
        inputs = [torch.arange(12.0).reshape(3, 4) * (rank + 1) / 10 for rank in range(4)]
        ddp(inputs[self.rank]).sum().backward()
        for rank_inputs in inputs:  # the oracle: the mean of every rank's own gradient
            (plain(rank_inputs).sum() / 4).backward()
        for name, param in plain.named_parameters():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, param.grad)


class TestFSDPStyle(FSDPTest):
    @property
    def world_size(self):
        return 2

    def test_run_subtests(self):
        calls = []
        self.run_subtests({"a": [1, 2], "b": [True, False]}, self._check, calls)
        self.assertEqual(len(calls), 4)

    def _check(self, calls, a, b):
        value = torch.full((1,), float(a))
        dist.all_reduce(value)
        self.assertEqual(value.item(), 2.0 * a)
        calls.append((a, b))


class TestDTensorStyle(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_mesh_and_dtensor(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        local = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        self.assertEqual(local.full_tensor(), torch.arange(4.0))


class TestChangesDefaultDtype(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def test_1_leaves_float64_behind(self):
        torch.set_default_dtype(torch.float64)

    def test_2_still_runs(self):
        self.assertEqual(torch.get_default_dtype(), torch.float32)
        RAN_IN_THIS_PROCESS.append("test_2")

    def test_3_runs_on_a_pool_of_its_own(self):
        self.assertEqual(RAN_IN_THIS_PROCESS, [])


class TestOwnBackend(MultiProcessTestCase):
    # As test_c10d_common's custom-backend and Python-backend classes: it registers a backend
    # and initialises its own world with it, which the pool's gloo group cannot stand in for.
    @property
    def world_size(self):
        return 2

    def _init_custom(self):
        def create(store, rank, size, timeout):  # a gloo group under a name of its own
            return dist.ProcessGroupGloo(store, rank, size, timeout)

        if "custom" not in dist.Backend.backend_list:
            dist.Backend.register_backend("custom", create, devices=["cpu"])
        dist.init_process_group(
            "custom",
            store=dist.FileStore(self.file_name, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
        )

    def test_1_initialises_its_own_backend(self):
        self._init_custom()
        self.assertEqual(dist.get_backend(), "custom")
        value = torch.ones(1) * (self.rank + 1)
        dist.all_reduce(value)
        self.assertEqual(value.item(), 3)
        dist.destroy_process_group()

    def test_2_initialises_it_again(self):
        self._init_custom()
        self.assertEqual(dist.get_backend(), "custom")
        dist.destroy_process_group()


class TestLocalSyncGroups(MultiProcessTestCase):
    # As test_c10d_gloo's LargeCommTest: groups named by a hash of their ranks
    # (use_local_synchronization) meet the barrier keys an earlier test left in a store;
    # in a world of the test's own, with its own store, there are none.
    @property
    def world_size(self):
        return 4

    def _pairs(self):
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(self.file_name, self.world_size),
            rank=self.rank,
            world_size=self.world_size,
        )
        pair = [self.rank // 2 * 2, self.rank // 2 * 2 + 1]
        group = dist.new_group(ranks=pair, use_local_synchronization=True)
        value = torch.ones(1)
        dist.all_reduce(value, group=group)
        self.assertEqual(value.item(), 2)
        dist.destroy_process_group()

    @pytest.mark.deadline(20)
    def test_1_pairs(self):
        self._pairs()

    @pytest.mark.deadline(20)
    def test_2_the_same_pairs_again(self):
        self._pairs()


RAN_IN_THIS_PROCESS = []
SHARED_BY_THE_RANK_THREADS = []
"""


#: torch's skip for too few devices: "CUDA devices" until torch 2.14, "accelerator devices"
#: from 2.15 on (its multi-device-N key).
TOO_FEW_DEVICES = r"Need at least 2 (?:CUDA|accelerator) devices"


def run_sample(
    directory: Path, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    """``pytest *args`` on ``SAMPLE`` written into ``directory``, as a user runs it."""
    if not (directory / "test_sample.py").exists():
        (directory / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
        (directory / "pytest.ini").write_text("[pytest]\n")
    environment = dict(os.environ, **env)
    environment["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"],
        cwd=directory, env=environment, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    root = tmp_path_factory.mktemp("adopt")
    done = run_sample(
        root, "test_sample.py", "--dist-adopt", "-rA", "--dist-adopt-fsdp-on-cpu",
        "--dist-peer-grace", "0.5", "--junitxml", "junit.xml", timeout=300,
    )  # fmt: skip
    return done, method_outcomes(root / "junit.xml", done)


def test_every_method_is_one_item_with_its_own_outcome(adopted):
    done, outcomes = adopted
    statuses = {name: status for name, (status, _) in outcomes.items()}
    assert statuses == {
        "TestProcesses::test_all_reduce": "passed",
        "TestProcesses::test_rank_and_the_shared_store_file": "passed",
        "TestProcesses::test_init_bound_when_the_module_was_imported": "passed",
        "TestProcesses::test_init_of_this_world_is_served_by_the_pool": "passed",
        "TestProcesses::test_seeded_as_torch_seeds_its_children": "passed",
        "TestProcesses::test_needs_two_gpus": "skipped",
        "TestProcesses::test_skipped_by_unittest": "skipped",
        "TestProcesses::test_expected_to_fail": "skipped",  # JUnit's word for xfailed
        "TestProcesses::test_parametrized_factor_1": "passed",
        "TestProcesses::test_parametrized_factor_3": "passed",
        "TestProcesses::test_fails_on_rank_1": "failure",
        "TestProcesses::test_asks_for_another_world_size": "failure",
        "TestProcesses::test_rank_0_waits_for_a_rank_that_left": "failure",
        "TestProcesses::test_rank_0_spins_in_python": "failure",
        "TestProcesses::test_rank_0_then_warms_a_new_pool": "passed",
        "TestProcesses::test_after_the_failures": "passed",
        "TestFourRanks::test_world": "passed",
        "TestThreads::test_all_reduce_and_a_subgroup": "passed",
        "TestThreads::test_ddp_backward": "passed",
        "TestThreads::test_fails_on_rank_2": "failure",
        "TestFSDPStyle::test_run_subtests": "passed",
        "TestDTensorStyle::test_mesh_and_dtensor": "passed",
        "TestChangesDefaultDtype::test_1_leaves_float64_behind": "passed",
        "TestChangesDefaultDtype::test_2_still_runs": "passed",
        "TestChangesDefaultDtype::test_3_runs_on_a_pool_of_its_own": "passed",
        "TestOwnBackend::test_1_initialises_its_own_backend": "passed",
        "TestOwnBackend::test_2_initialises_it_again": "passed",
        "TestLocalSyncGroups::test_1_pairs": "passed",
        "TestLocalSyncGroups::test_2_the_same_pairs_again": "passed",
    }, done.stdout[-6000:]
    assert (
        "XFAIL test_sample.py::TestProcesses::test_expected_to_fail - unittest.expectedFailure"
        in done.stdout
    )


def test_skips_keep_their_reasons(adopted):
    done, outcomes = adopted
    # Reported at the test's own line, not at the harness line that raised the skip.
    assert re.search(
        rf"^SKIPPED \[1\] test_sample\.py:\d+: {TOO_FEW_DEVICES} \(exit code 77\)$",
        done.stdout,
        re.M,
    ), done.stdout[-3000:]
    assert re.search(
        rf"{TOO_FEW_DEVICES} \(exit code 77\)", outcomes["TestProcesses::test_needs_two_gpus"][1]
    )
    assert outcomes["TestProcesses::test_skipped_by_unittest"][1].endswith("not today")


def failure_section(stdout: str, method: str, test_class: str = "TestProcesses") -> str:
    start = stdout.index(f"_ {test_class}.{method} _")
    end = stdout.find("\n____", start + 1)
    return stdout[start:end]


def test_a_failing_method_gets_the_harness_report(adopted):
    done, _ = adopted
    report = failure_section(done.stdout, "test_fails_on_rank_1")
    lines = report.splitlines()
    assert lines[1].startswith("rank 1 failed: AssertionError:"), report
    assert "rank 1 disagrees" in lines[1]
    assert "ws 2, process/gloo/cpu" in lines[1]
    assert "reproduce with:" in report
    assert (
        "-m pytest test_sample.py::TestProcesses::test_fails_on_rank_1 --launcher process" in report
    )
    # The command is the last line of the failure's text (rank output may follow it: a CUDA
    # build of torch warns there that it found no CUDA runtime).
    command = report.split("reproduce with:\n", 1)[1].splitlines()[0]
    assert command.rstrip().endswith("--dist-adopt --dist-adopt-fsdp-on-cpu"), report


def test_a_failing_thread_class_method_gets_the_report_of_its_rank_threads(adopted):
    done, _ = adopted
    report = failure_section(done.stdout, "test_fails_on_rank_2", "TestThreads")
    lines = report.splitlines()
    assert lines[1].startswith("rank 2 failed: AssertionError:"), report
    assert "ws 4, thread/threaded/cpu" in lines[1]
    assert "in subTest('steps', step=1)" in report
    assert (
        "-m pytest test_sample.py::TestThreads::test_fails_on_rank_2 --launcher thread "
        "--backend threaded --device cpu" in report
    ), report


def test_a_rank_left_waiting_gets_the_collective_trace(adopted):
    done, _ = adopted
    report = failure_section(done.stdout, "test_rank_0_waits_for_a_rank_that_left")
    # Its barrier's timeout and its 3 s deadline are close: on a busy machine either ends
    # it first, and either way the trace must name the rank that never arrived.
    assert re.match(r"rank 0 (failed|hung)", report.splitlines()[1]), report
    assert "collective trace: rank 1 never arrived at barrier #0 on group world" in report
    assert "rank 0 called barrier - (dist.barrier) at test_sample.py:" in report


def test_a_hanging_method_gets_the_stacks_of_the_hung_rank(adopted):
    done, _ = adopted
    report = failure_section(done.stdout, "test_rank_0_spins_in_python")
    assert report.splitlines()[1].startswith("rank 0 hung"), report
    assert "stacks of rank 0 at the deadline:" in report
    assert re.search(r'test_sample\.py", line \d+ in test_rank_0_spins_in_python', report), report
    assert re.search(r"^\s+1\s+passed", report, re.M)


def test_an_init_for_another_world_fails_with_both_sizes(adopted):
    done, _ = adopted
    report = failure_section(done.stdout, "test_asks_for_another_world_size")
    assert (
        "TestProcesses calls init_process_group(world_size=4, rank=0) on rank 0 of a pool of 2"
        in report
    ), report


def test_differences_from_the_classes_own_harness_are_warned_once(adopted):
    done, _ = adopted
    difference = "TestProcesses: destroy_process_group() of the default group is left to the pool"
    assert done.stdout.count(difference) == 1, done.stdout[-4000:]


def test_an_init_with_its_own_backend_or_store_runs_in_a_world_of_its_own(adopted):
    """Never the pool's group in its place: its init creates its world on ranks without one,
    with its own backend and store, as under its own harness; each class is named once."""
    done, outcomes = adopted
    for warning in (
        "TestOwnBackend initialises its world with its own 'custom' backend (the pool's is "
        "'gloo') and its own store: such a test runs on ranks of its own",
        "TestProcesses initialises its world with its own store: such a test runs on ranks of "
        "its own",
    ):
        assert done.stdout.count(warning) == 1, done.stdout[-4000:]
    # An init for another world size still fails at once, with both sizes (never a hang).
    assert outcomes["TestProcesses::test_asks_for_another_world_size"][0] == "failure"


def test_a_class_that_changes_process_state_gets_fresh_pools_and_a_warning(adopted):
    done, outcomes = adopted
    assert (
        "TestChangesDefaultDtype leaves its ranks changed (torch default dtype changed from "
        in done.stdout
    ), done.stdout[-4000:]
    assert "its other tests in this session run on a fresh pool each" in done.stdout
    assert outcomes["TestChangesDefaultDtype::test_2_still_runs"][0] == "passed"
    # test_3 would see test_2's entry in a module of the same warm rank.
    assert outcomes["TestChangesDefaultDtype::test_3_runs_on_a_pool_of_its_own"][0] == "passed"


def test_fsdp_classes_skip_as_their_own_harness_does_without_accelerators(tmp_path):
    done = run_sample(tmp_path, "test_sample.py::TestFSDPStyle", "--dist-adopt", "-rs")
    assert "1 skipped" in done.stdout, done.stdout[-3000:]
    assert re.search(
        rf"{TOO_FEW_DEVICES} \(FSDPTest's own check before the method runs\); "
        r"--dist-adopt-fsdp-on-cpu runs it anyway",
        done.stdout,
    ), done.stdout[-3000:]


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_without_the_option_pytest_runs_them_with_torchs_own_harness(tmp_path):
    done = run_sample(tmp_path, "--collect-only", "-q")
    assert "test_sample.py::TestProcesses::test_all_reduce" in done.stdout, done.stdout
    assert "AdoptedMethod" not in done.stdout
    adopted_ids = run_sample(tmp_path, "--collect-only", "-q", "--dist-adopt")
    # The same node ids either way: selections and CI configurations keep working.
    assert sorted(_ids(adopted_ids.stdout)) == sorted(_ids(done.stdout))


def _ids(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("test_sample.py::")]


@pytest.mark.slow
def test_fsdp_and_dtensor_classes_run_on_the_fake_accelerator(tmp_path):
    # FSDPTest skips before any method runs on a machine with fewer accelerators than
    # ranks; the fake device has 8, so its methods run on accelerator ranks, here as there.
    done = run_sample(
        tmp_path, "test_sample.py", "--dist-adopt", "--device", "fakeaccel", "-rA",
        "-k", "FSDPStyle or DTensorStyle", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "PASSED test_sample.py::TestFSDPStyle::test_run_subtests" in done.stdout
    assert "PASSED test_sample.py::TestDTensorStyle::test_mesh_and_dtensor" in done.stdout
    assert "device fakeaccel" in done.stdout
