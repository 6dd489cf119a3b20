"""``torch.fakeaccel``: the device module torch and FSDP2 look up by the device's name.

torch reaches an accelerator's Python module as ``getattr(torch, device_type)`` (FSDP2's
streams, DeviceMesh's device handle, ``torch.accelerator.device_count``). These functions
answer for the fake device: from its C++ side (``torch.ops.fakeaccel``) where only it knows,
otherwise through torch's device-generic ``torch.Stream``, ``torch.Event`` and
``torch.accelerator`` calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from distconform.api import current_stream_set

DEVICE_TYPE = "fakeaccel"


def is_available() -> bool:
    return device_count() > 0


def is_initialized() -> bool:
    return True


def device_count() -> int:
    return int(torch.ops.fakeaccel.device_count())


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: Any) -> None:
    torch.accelerator.set_device_index(device)


def _device(device: Any = None) -> torch.device:
    if device is None:
        return torch.device(DEVICE_TYPE, current_device())
    if isinstance(device, int):
        return torch.device(DEVICE_TYPE, device)
    return torch.device(device)


def synchronize(device: Any = None) -> None:
    torch.accelerator.synchronize(_device(device))


# Stream and Event keep torch.cuda's capitalised names: FSDP2 calls device_handle.Stream().
def Stream(device: Any = None, priority: int = 0) -> torch.Stream:
    return torch.Stream(device=_device(device), priority=priority)


def Event(
    enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
) -> torch.Event:
    return torch.Event(
        device=_device(), enable_timing=enable_timing, blocking=blocking, interprocess=interprocess
    )


def current_stream(device: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(_device(device))


def default_stream(device: Any = None) -> torch.Stream:
    target = _device(device)
    return torch.Stream(stream_id=0, device_index=target.index, device_type=target.type)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextmanager
def stream(chosen: torch.Stream | None) -> Iterator[None]:
    """Make ``chosen`` the current stream of its device for the block (None: no change)."""
    if chosen is None:
        yield
        return
    with current_stream_set(chosen):
        yield


def get_amp_supported_dtype() -> list[torch.dtype]:
    """What autocast may cast to on this device (the CPU runs the ops: both it supports)."""
    return [torch.float16, torch.bfloat16]


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The device's random state: the CPU generator's, which its random ops draw from
    (activation checkpointing saves and restores it around a recomputation)."""
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(state)


def manual_seed_all(seed: int) -> None:
    """Nothing to seed: random numbers for this device come from the CPU's generator, which
    ``torch.manual_seed`` seeds."""


def _is_in_bad_fork() -> bool:
    return False


def take_event_waits() -> list[tuple[int, int, int, int]]:
    """Every wait of a stream on an event since the last call: (device, stream id, event id
    as ``torch.Event.event_id``, how many times the event had been recorded)."""
    return [tuple(row) for row in torch.ops.fakeaccel.take_event_waits().tolist()]


# --- the stream checker (fakeaccel.cpp, stream_checker.h) ---------------------------------------


def stream_check(on: bool) -> bool:
    """Turn the stream-safety checker on or off, from a clean state either way; returns
    whether it was on. While on, every kernel, stream and event operation, allocation and
    free on the device is checked for accesses a real device would leave unordered."""
    return bool(torch.ops.fakeaccel.stream_check(on))


def take_stream_findings() -> list[dict[str, Any]]:
    """The checker's findings since the last call, each a dict: ``kind`` (read,
    write-after-read, write-after-write, free), ``bytes``, ``repeats`` (same ops and streams,
    folded in), ``access`` and ``earlier`` (``op``, ``device``, ``stream``, ``stack`` as
    ``[file, line, function]`` outermost first) and ``allocated_on`` (``device``, ``stream``)."""
    return [json.loads(text) for text in torch.ops.fakeaccel.take_stream_findings()]


def record_kernel(op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
    """Tell the checker that a kernel named ``op`` runs now on the current stream, reading
    ``reads`` and writing ``writes`` (work done outside the device's kernels: a collective)."""
    torch.ops.fakeaccel.record_kernel(op, reads, writes)


@contextmanager
def stream_check_paused() -> Iterator[None]:
    """Inside the block this thread's kernels are not checked: the work of a kernel that is
    recorded by itself (a backend's copies to and from the host)."""
    torch.ops.fakeaccel.pause_stream_check(True)
    try:
        yield
    finally:
        torch.ops.fakeaccel.pause_stream_check(False)
