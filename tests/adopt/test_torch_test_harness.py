"""The audited module's accessors, in this process: what they answer on the pinned torch,
and that each refuses another torch version with the message that says what to re-audit."""

from __future__ import annotations

import unittest

import pytest
import torch
from torch.testing._internal.common_distributed import (  # the module under audit reads these
    TEST_SKIPS,
    MultiProcessTestCase,
    MultiThreadedTestCase,
)
from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestMultiThread
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorOpTestBase,
    DTensorTestBase,
    LocalDTensorTestBase,
)

from harness._torch_private import PrivateTorchAccessError
from harness.adopt import _torch_test_harness as torch_harness


class _Process(MultiProcessTestCase):
    @property
    def world_size(self):
        return 3

    def test_x(self):
        raise SystemExit(TEST_SKIPS["multi-gpu-2"].exit_code)


def test_families_of_the_base_classes():
    assert torch_harness.family_of(_Process) == torch_harness.PROCESS_FAMILY
    for process in (FSDPTest, DTensorTestBase):
        assert torch_harness.family_of(process) == torch_harness.PROCESS_FAMILY
    for threaded in (MultiThreadedTestCase, FSDPTestMultiThread, DTensorOpTestBase):
        assert torch_harness.family_of(threaded) == torch_harness.THREAD_FAMILY
    # Runs in the calling process on a fake backend: left to pytest's unittest plugin.
    assert torch_harness.family_of(LocalDTensorTestBase) is None
    assert torch_harness.family_of(unittest.TestCase) is None
    assert torch_harness.is_fsdp_test(FSDPTest) and not torch_harness.is_fsdp_test(_Process)
    assert torch_harness.is_dtensor_test(DTensorTestBase)


def test_fsdp_tests_skip_before_the_method_without_enough_accelerators():
    class _Fsdp(FSDPTest):
        @property
        def world_size(self):
            return 2

    if torch.accelerator.device_count() >= 2:
        pytest.skip("this machine has the accelerators FSDPTest asks for")
    reason = torch_harness.own_precondition_skip(_Fsdp, 2)
    assert reason == "Need at least 2 CUDA devices (FSDPTest's own check before the method runs)"
    assert torch_harness.own_precondition_skip(_Process, 2) is None  # not an FSDPTest


def test_world_size_instance_and_skip_exit_codes():
    assert torch_harness.declared_world_size(_Process, "test_x") == 3
    instance = torch_harness.build_instance(_Process, "test_x", rank=1, file_name="/tmp/x")
    assert (instance.rank, instance.file_name) == (1, "/tmp/x")
    with pytest.raises(unittest.SkipTest, match=r"Need at least 2 CUDA devices \(exit code 77\)"):
        torch_harness.call_test_method(instance, "test_x")
    assert torch_harness.skip_reason(1) is None


@pytest.mark.parametrize(
    "accessor, args",
    [
        ("family_of", (_Process,)),
        ("is_fsdp_test", (_Process,)),
        ("is_dtensor_test", (_Process,)),
        ("declared_world_size", (_Process, "test_x")),
        ("own_precondition_skip", (_Process, 2)),
        ("build_instance", (_Process, "test_x", 0, "/tmp/x")),
        ("seed_like_torch", ()),
        ("skip_reason", (77,)),
        ("run_per_thread_hooks", (None, None)),
    ],
)
@pytest.mark.parametrize("version", ["2.14.0", "2.12.1+cpu"])
def test_every_accessor_refuses_an_unaudited_torch(monkeypatch, accessor, args, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(PrivateTorchAccessError) as excinfo:
        getattr(torch_harness, accessor)(*args)
    message = str(excinfo.value)
    assert f"harness/adopt/_torch_test_harness.py:{accessor}" in message and version in message
