"""Devices the harness brings along (each loaded when its module is imported, a plug-in),
and what the suites may ask of any device beyond torch's own API.

A device can offer a record of which event each stream waited on: its module (the one
``torch.get_device_module`` returns) has ``take_event_waits()``, returning
``(device, stream id, event id, times recorded)`` rows since the last call, the event id
being ``torch.Event.event_id``. The fake device does; real devices make the same ordering
observable only by timing, so a check that needs it asks :func:`event_wait_record` and
falls back to timing where the answer is None.

A device can also check stream safety (the fake device does): its module has
``stream_check(on) -> bool``, ``take_stream_findings() -> list[dict]``,
``record_kernel(op, reads, writes)`` and ``stream_check_paused()``
(:class:`StreamChecker`; see ``harness/devices/fakeaccel/module.py`` for what each does).
:func:`stream_checker` finds it; the harness turns it on around each test body
(``harness/rank/stream_safety.py``) and a backend reports its collectives' accesses to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

EventWaits = list[tuple[int, int, int, int]]


class StreamChecker(Protocol):
    """What a device module offers when it checks stream safety."""

    def stream_check(self, on: bool) -> bool: ...
    def take_stream_findings(self) -> list[dict[str, Any]]: ...
    def record_kernel(
        self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]
    ) -> None: ...
    def stream_check_paused(self) -> AbstractContextManager[None]: ...


def _device_module(device_type: str) -> Any:
    if device_type == "cpu":
        return None
    try:
        return torch.get_device_module(device_type)
    except RuntimeError:
        return None


def event_wait_record(device_type: str) -> Callable[[], EventWaits] | None:
    """The device's ``take_event_waits``, or None when it keeps no such record."""
    return getattr(_device_module(device_type), "take_event_waits", None)


def stream_checker(device_type: str) -> StreamChecker | None:
    """The device module, when it checks stream safety; else None."""
    module = _device_module(device_type)
    return module if callable(getattr(module, "stream_check", None)) else None


@contextmanager
def current_stream_set(stream: torch.Stream) -> Iterator[torch.Stream]:
    """Make ``stream`` its device's current stream for the block (``with stream:`` does the
    same from torch 2.12 on; this works on every release of the window)."""
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield stream
    finally:
        torch.accelerator.set_stream(previous)
