"""The audited module's accessors, in this process: what they answer on the installed torch,
that each has an audit of every release of the window, and that each refuses a torch outside the
window (or a release its audit lacks) with the message that says what to do."""

from __future__ import annotations

import sys
import unittest

import pytest
import torch
from torch.testing._internal.common_distributed import (  # the module under audit reads these
    TEST_SKIPS,
    MultiProcContinuousTest,
    MultiProcessTestCase,
    MultiThreadedTestCase,
)
from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestMultiThread
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorContinuousTestBase,
    DTensorOpTestBase,
    DTensorTestBase,
    LocalDTensorContinuousTestBase,
    LocalDTensorTestBase,
)

from distconform.harness.adopt import _torch_test_harness as torch_harness
from distconform.harness.torch_window import (
    SUPPORTED_TORCH,
    V2_15,
    installed_torch_version,
)
from tests.audited_access import audit_tests

MODULE = "harness/adopt/_torch_test_harness.py"


class _Process(MultiProcessTestCase):
    __test__ = False  # read by the accessors, never run by pytest's unittest plugin

    @property
    def world_size(self):
        return 3

    def test_x(self):
        raise SystemExit(77)  # TEST_SKIPS' code for "fewer than 2 devices" in every release


class _Continuous(MultiProcContinuousTest):
    __test__ = False  # read by the accessors, never run by pytest's unittest plugin

    world_size = 2

    def test_x(self):
        pass


class _ContinuousOnTheDeviceCount(MultiProcContinuousTest):
    __test__ = False  # read by the accessors, never run by pytest's unittest plugin

    def test_x(self):
        pass


class _ContinuousWithoutItsBackend(MultiProcContinuousTest):
    __test__ = False  # read by the accessors, never run by pytest's unittest plugin

    world_size = 3

    @classmethod
    def backend_str(cls):
        return "mpi"


def test_families_of_the_base_classes():
    assert torch_harness.family_of(_Process) == torch_harness.PROCESS_FAMILY
    for process in (FSDPTest, DTensorTestBase):
        assert torch_harness.family_of(process) == torch_harness.PROCESS_FAMILY
    for threaded in (MultiThreadedTestCase, FSDPTestMultiThread, DTensorOpTestBase):
        assert torch_harness.family_of(threaded) == torch_harness.THREAD_FAMILY
    for continuous in (MultiProcContinuousTest, DTensorContinuousTestBase, _Continuous):
        assert torch_harness.family_of(continuous) == torch_harness.CONTINUOUS_FAMILY
    # Run in the calling process on a fake backend: left to pytest's unittest plugin.
    assert torch_harness.family_of(LocalDTensorTestBase) is None
    assert torch_harness.family_of(LocalDTensorContinuousTestBase) is None
    assert torch_harness.family_of(unittest.TestCase) is None
    assert torch_harness.is_fsdp_test(FSDPTest) and not torch_harness.is_fsdp_test(_Process)
    assert torch_harness.is_dtensor_test(DTensorTestBase)


def _too_few_devices_message(count: int) -> str:
    """torch's own text: the key and the wording changed in torch 2.15."""
    key = f"multi-device-{count}" if installed_torch_version() >= V2_15 else f"multi-gpu-{count}"
    return TEST_SKIPS[key].message


def test_fsdp_tests_skip_before_the_method_without_enough_accelerators():
    class _Fsdp(FSDPTest):
        @property
        def world_size(self):
            return 2

    if torch.accelerator.device_count() >= 2:
        pytest.skip("this machine has the accelerators FSDPTest asks for")
    reason = torch_harness.own_precondition_skip(_Fsdp, 2)
    assert reason == f"{_too_few_devices_message(2)} (FSDPTest's own check before the method runs)"
    assert torch_harness.own_precondition_skip(_Process, 2) is None  # not an FSDPTest


def test_world_size_instance_and_skip_exit_codes():
    assert torch_harness.declared_world_size(_Process, "test_x") == 3
    instance = torch_harness.build_instance(_Process, "test_x", rank=1, file_name="/tmp/x")
    assert (instance.rank, instance.file_name) == (1, "/tmp/x")
    with pytest.raises(unittest.SkipTest) as skipped:
        torch_harness.call_test_method(instance, "test_x")
    assert str(skipped.value) == f"{_too_few_devices_message(2)} (exit code 77)"
    assert torch_harness.skip_reason(1) is None


def test_a_continuous_classs_world_is_what_its_parent_would_spawn():
    assert torch_harness.continuous_world(_Continuous) == torch_harness.ContinuousWorld(2)
    # No world_size: its parent spawns one worker per device of the class's device type (the
    # current accelerator's, the CPU without one; a session may have loaded the fake device).
    device_type = _ContinuousOnTheDeviceCount.device_type()
    assert torch_harness.continuous_world(_ContinuousOnTheDeviceCount).world_size == (
        torch.get_device_module(device_type).device_count()
    )
    assert torch_harness.continuous_world(_ContinuousWithoutItsBackend) == (
        torch_harness.ContinuousWorld(3, "Backend 'mpi' is not available")
    )


def test_a_continuous_instance_takes_the_classs_rank_and_world_size(monkeypatch):
    class _Joined(_Continuous):
        pass

    calls = []
    monkeypatch.setattr(
        _Joined, "_init_pg", classmethod(lambda cls, *args: calls.append((cls, *args)))
    )
    torch_harness.join_continuous_world(_Joined, 1, 2, "/tmp/x")
    assert calls == [(_Joined, 1, 2, "/tmp/x")]
    assert (_Joined.rank, _Joined.world_size) == (1, 2)
    instance = torch_harness.build_continuous_instance(_Joined, "test_x")
    assert (instance.rank, instance.world_size) == (1, 2)

    def skip(cls, *args):
        raise SystemExit(77)

    monkeypatch.setattr(_Joined, "_init_pg", classmethod(skip))
    with pytest.raises(unittest.SkipTest, match="exit code 77"):
        torch_harness.join_continuous_world(_Joined, 0, 2, "/tmp/x")


def test_the_skip_key_is_chosen_for_every_release():
    assert set(torch_harness._TOO_FEW_DEVICES_SKIP) == set(SUPPORTED_TORCH)


def test_on_torch_2_15_the_skip_is_read_under_its_new_key(monkeypatch):
    """torch 2.15 renamed ``multi-gpu-N`` to ``multi-device-N`` (same exit codes)."""

    class _Fsdp(FSDPTest):
        pass

    test_skip = type(next(iter(TEST_SKIPS.values())))  # (exit_code, message)
    common = type(
        "common_distributed_2_15",
        (),
        {"TEST_SKIPS": {"multi-device-3": test_skip(80, "2.15 text")}},
    )
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    monkeypatch.setitem(sys.modules, torch_harness._COMMON_DISTRIBUTED, common)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    assert torch_harness.own_precondition_skip(_Fsdp, 3) == (
        "2.15 text (FSDPTest's own check before the method runs)"
    )


#: A call of each accessor; every one must be refused before it touches anything.
CALLS = {
    "family_of": (_Process,),
    "is_fsdp_test": (_Process,),
    "is_dtensor_test": (_Process,),
    "declared_world_size": (_Process, "test_x"),
    "own_precondition_skip": (_Process, 2),
    "build_instance": (_Process, "test_x", 0, "/tmp/x"),
    "seed_like_torch": (),
    "skip_reason": (77,),
    "call_test_method": (None, "test_x"),
    "run_per_thread_hooks": (None, None),
    "continuous_world": (_Continuous,),
    "join_continuous_world": (_Continuous, 0, 2, "/tmp/x"),
    "build_continuous_instance": (_Continuous, "test_x"),
    "test_package_imports": ("import os\n",),
}

(
    test_every_accessor_has_an_audit_of_every_release,
    test_every_accessor_refuses_a_torch_outside_the_window,
    test_an_accessor_whose_audit_lacks_the_installed_release_is_refused,
) = audit_tests(torch_harness, MODULE, CALLS)


def test_the_modules_of_torchs_test_package_a_file_imports_are_read_from_its_source():
    source = """
import os
import torch.testing._internal.common_fsdp
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.common_utils import TestCase
from .helpers import thing
import torch.distributed as dist
"""
    assert torch_harness.test_package_imports(source) == (
        "torch.testing._internal.common_distributed",
        "torch.testing._internal.common_fsdp",
        "torch.testing._internal.distributed._tensor.common_dtensor",
        "torch.testing._internal.common_utils",
    )
    assert torch_harness.test_package_imports("def broken(:\n") == ()
