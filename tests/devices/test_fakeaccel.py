"""The fake accelerator behaves like a device, not like a renamed CPU.

Each test states what a real accelerator guarantees (its own memory and statistics, copies
across the host boundary, storage that can be freed and re-allocated, device indices,
streams and events) and checks it against the device through torch's public,
device-generic API. Visibility is checked in child processes, where the variables are set
before the device is loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from distconform.harness.devices import fakeaccel

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("fakeaccel", 0)


def test_it_is_the_current_accelerator_with_the_devices_of_the_machine():
    assert torch.accelerator.current_accelerator() == torch.device("fakeaccel")
    assert torch.accelerator.is_available()
    expected = int(os.environ.get(fakeaccel.COUNT_VARIABLE, "8"))
    assert torch.accelerator.device_count() == expected
    assert torch.get_device_module("fakeaccel") is fakeaccel.module


def test_a_device_tensor_is_not_a_cpu_tensor_and_moving_it_copies():
    host = torch.arange(6.0).reshape(2, 3)
    moved = host.to(DEVICE)
    assert moved.device == DEVICE and moved.is_fakeaccel
    moved.add_(1)
    assert host.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # the CPU tensor is untouched
    back = moved.cpu()
    back.zero_()
    assert moved.sum().item() == 21.0  # and the device tensor does not follow its copy


def test_ops_without_a_native_kernel_run_on_the_cpu_and_stay_on_the_device():
    left = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    right = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    product = left.to(DEVICE) @ right.to(DEVICE)
    assert product.device == DEVICE
    torch.testing.assert_close(product.cpu(), left @ right)


def test_views_share_the_memory_of_their_base():
    base = torch.zeros(4, 4, device=DEVICE)
    base[1:3, ::2].fill_(7.0)
    base.t()[0].add_(1.0)
    expected = torch.zeros(4, 4)
    expected[1:3, ::2] = 7.0
    expected.t()[0] += 1.0
    assert torch.equal(base.cpu(), expected)


def test_complex_tensors_view_as_real_and_back_in_place():
    values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64, device=DEVICE)
    as_real = torch.view_as_real(values)
    as_real[:, 1].neg_()  # writes through to the complex tensor: a view, not a copy
    assert values.cpu().tolist() == [1 - 2j, 3 + 4j]
    assert torch.view_as_complex(as_real).data_ptr() == values.data_ptr()


def test_allocator_statistics_count_device_memory_only():
    torch.accelerator.reset_peak_memory_stats(DEVICE)
    before = torch.accelerator.memory_allocated(DEVICE)
    block = torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(4 << 20, dtype=torch.uint8)  # the CPU's memory is not the device's
    assert torch.accelerator.memory_allocated(DEVICE) - before == 1 << 20
    assert torch.accelerator.max_memory_allocated(DEVICE) - before == 1 << 20
    del block, host
    assert torch.accelerator.memory_allocated(DEVICE) == before
    assert torch.accelerator.max_memory_allocated(DEVICE) - before == 1 << 20
    torch.accelerator.reset_peak_memory_stats(DEVICE)
    assert torch.accelerator.max_memory_allocated(DEVICE) == before


def test_each_device_keeps_its_own_statistics():
    other = torch.device("fakeaccel", 1)
    before = torch.accelerator.memory_allocated(DEVICE)
    kept = torch.empty(1000, dtype=torch.uint8, device=other)
    assert torch.accelerator.memory_allocated(DEVICE) == before
    assert torch.accelerator.memory_allocated(other) >= 1000
    del kept


def test_storage_can_be_freed_and_allocated_again_in_place():
    # FSDP2 frees an unsharded parameter's storage with resize_(0) and brings it back.
    tensor = torch.ones(256, device=DEVICE)
    storage = tensor.untyped_storage()
    before = torch.accelerator.memory_allocated(DEVICE)
    storage.resize_(0)
    assert storage.nbytes() == 0
    assert before - torch.accelerator.memory_allocated(DEVICE) == 1024
    storage.resize_(1024)
    tensor.fill_(2.0)
    assert tensor.sum().item() == 512.0
    assert torch.accelerator.memory_allocated(DEVICE) == before


def test_device_indices_and_the_current_device():
    previous = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(3)
    try:
        assert torch.empty(1, device="fakeaccel").device == torch.device("fakeaccel", 3)
    finally:
        torch.accelerator.set_device_index(previous)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.empty(1, device=torch.device("fakeaccel", torch.accelerator.device_count()))


def test_streams_and_events_work_and_every_wait_is_recorded():
    fakeaccel.module.take_event_waits()  # start from an empty record
    producer = torch.Stream(device=DEVICE)
    consumer = torch.Stream(device=DEVICE)
    first = torch.Event(device=DEVICE, enable_timing=True)
    first.record(producer)
    second = producer.record_event()
    consumer.wait_event(first)
    consumer.wait_event(second)
    assert first.query() and second.query()
    consumer.synchronize()
    torch.accelerator.synchronize(DEVICE)
    later = torch.Event(device=DEVICE, enable_timing=True)
    later.record(producer)
    assert first.elapsed_time(later) >= 0.0
    waits = fakeaccel.module.take_event_waits()
    assert [(w[1], w[2]) for w in waits] == [
        (consumer.stream_id, first.event_id),
        (consumer.stream_id, second.event_id),
    ]
    assert fakeaccel.module.take_event_waits() == []  # taken once


def test_pinned_host_memory_is_known_as_pinned():
    pinned = torch.ones(8).pin_memory()
    assert pinned.is_pinned()
    assert not torch.ones(8).is_pinned()


def _in_child(code: str, **env: str) -> dict:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_the_visibility_variable_narrows_the_devices_of_a_process():
    code = """
        import json, torch
        import distconform.harness.devices.fakeaccel
        print(json.dumps({"count": torch.accelerator.device_count()}))
    """
    assert _in_child(code, FAKEACCEL_DEVICE_COUNT="6", FAKEACCEL_VISIBLE_DEVICES="4,5") == {
        "count": 2
    }
    assert _in_child(code, FAKEACCEL_DEVICE_COUNT="3") == {"count": 3}


def test_a_visible_device_the_machine_lacks_is_refused():
    code = "import torch, distconform.harness.devices.fakeaccel; torch.ones(1, device='fakeaccel')"
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "FAKEACCEL_DEVICE_COUNT": "2", "FAKEACCEL_VISIBLE_DEVICES": "5"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert completed.returncode != 0
    assert "FAKEACCEL_VISIBLE_DEVICES names device 5" in completed.stderr
