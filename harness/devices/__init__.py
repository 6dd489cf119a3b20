"""Devices the harness brings along (each loaded when its module is imported, a plug-in),
and what the suites may ask of any device beyond torch's own API.

A device can offer a record of which event each stream waited on: its module (the one
``torch.get_device_module`` returns) has ``take_event_waits()``, returning
``(device, stream id, event id, times recorded)`` rows since the last call, the event id
being ``torch.Event.event_id``. The fake device does; real devices make the same ordering
observable only by timing, so a check that needs it asks :func:`event_wait_record` and
falls back to timing where the answer is None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EventWaits = list[tuple[int, int, int, int]]


def event_wait_record(device_type: str) -> Callable[[], EventWaits] | None:
    """The device's ``take_event_waits``, or None when it keeps no such record."""
    if device_type == "cpu":
        return None
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError:
        return None
    return getattr(module, "take_event_waits", None)
