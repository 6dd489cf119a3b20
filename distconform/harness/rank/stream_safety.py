"""The stream-safety verdict on a test body, on a device that checks it (the fake device).

While the body runs, the device's checker (:func:`distconform.harness.devices.stream_checker`) sees
every kernel's stream and the storages it reads and writes, and every event, stream wait,
synchronize, allocation and free. When the body ends, each access it found that no synchronisation
orders after a conflicting access on another stream fails the test with a :class:`StreamSafetyError`
naming the op, both streams and both Python stacks; when the body failed too, its error follows the
findings (an unordered access is the likelier cause). On a real accelerator each of those is an
intermittent wrong value; here it is found every time, because the order the program *asks for* is
checked, not the order the work happened in.

Ranks that share a process (``--launcher thread``) share one checker: it is on while any of
them runs a body, and each rank is given the findings on its own device.
"""

from __future__ import annotations

import os
import sysconfig
import threading
import unittest
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from distconform.harness.devices import StreamChecker, stream_checker
from distconform.harness.shared.memory_sizes import format_size
from distconform.harness.shared.outcomes import STREAM_SAFETY_HEADLINE

#: Innermost frames of each stack a report shows.
STACK_FRAMES_SHOWN = 14

_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_TORCH_OP_CALL = os.path.join("torch", "_ops.py")  # torch.ops.<ns>.<op>(...) itself

_lock = threading.Lock()
_bodies_running = 0
_unclaimed: list[dict[str, Any]] = []


class StreamSafetyError(AssertionError):
    """A test body left accesses to device memory unordered between streams."""

    def __init__(self, message: str, findings: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.findings = findings


@contextmanager
def stream_safety(enabled: bool, device: torch.device, rank: int) -> Iterator[None]:
    """Check the block's stream safety on ``device`` (when ``enabled`` and the device can)."""
    checker = stream_checker(device.type) if enabled else None
    if checker is None:
        yield
        return
    _start(checker)
    try:
        yield
    except unittest.SkipTest:
        _finish(checker, device)  # a skip is a skip on every rank, findings or not
        raise
    except Exception as failure:
        findings = _finish(checker, device)
        if not findings:
            raise
        # An unordered access makes wrong values on a real device: it comes first, and
        # what the body saw follows it.
        also = f"\n\nthe test body also failed: {type(failure).__name__}: {failure}"
        error = StreamSafetyError(describe(findings, rank, device.type) + also, findings)
        raise error from failure
    except BaseException:
        _finish(checker, device)
        raise
    findings = _finish(checker, device)
    if findings:
        raise StreamSafetyError(describe(findings, rank, device.type), findings)


def _start(checker: StreamChecker) -> None:
    global _bodies_running
    with _lock:
        if _bodies_running == 0:
            checker.stream_check(True)
            _unclaimed.clear()
        _bodies_running += 1


def _finish(checker: StreamChecker, device: torch.device) -> list[dict[str, Any]]:
    global _bodies_running
    with _lock:
        _unclaimed.extend(checker.take_stream_findings())
        mine = [f for f in _unclaimed if f["access"]["device"] == device.index]
        _unclaimed[:] = [f for f in _unclaimed if f["access"]["device"] != device.index]
        _bodies_running -= 1
        if _bodies_running == 0:
            checker.stream_check(False)
    return mine


# --- the report ---------------------------------------------------------------------------------


def describe(findings: list[dict[str, Any]], rank: int, device_type: str) -> str:
    """Every finding: what was unordered with what, then both stacks."""
    total = sum(1 + finding["repeats"] for finding in findings)
    lines = [
        f"rank {rank}: {total} {STREAM_SAFETY_HEADLINE} "
        f"(stream checker; --no-dist-stream-check turns it off)"
    ]
    for number, finding in enumerate(findings, 1):
        lines.append("")
        lines.append(f"[{number}] {headline(finding, device_type)}")
        if finding["repeats"]:
            lines.append(f"    ({finding['repeats']} more by the same ops on the same streams)")
        earlier = {"read": "write", "write-after-read": "read", "write-after-write": "write"}
        lines.append(f"  this access ({finding['access']['op']}):")
        lines.extend(_stack_lines(finding["access"]["stack"]))
        lines.append(
            f"  the earlier {earlier.get(finding['kind'], 'access')} ({finding['earlier']['op']}):"
        )
        lines.extend(_stack_lines(finding["earlier"]["stack"]))
        if "freed" in finding:
            lines.append("  where the memory it used was freed:")
            lines.extend(_stack_lines(finding["freed"]["stack"]))
    return "\n".join(lines)


def headline(finding: dict[str, Any], device_type: str) -> str:
    access, earlier = finding["access"], finding["earlier"]
    size = format_size(finding["bytes"]) if finding["bytes"] else "memory"
    here = stream_name(access, device_type)
    there = stream_name(earlier, device_type)
    kind = finding["kind"]
    if kind == "read":
        return (
            f"{access['op']} on {here} reads {size} that {earlier['op']} wrote on {there}; "
            f"nothing orders {here} after that write (no event wait, wait_stream or "
            f"synchronize between them)"
        )
    if kind == "write-after-read":
        return (
            f"{access['op']} on {here} overwrites {size} that {earlier['op']} reads on "
            f"{there}; nothing orders {here} after that read"
        )
    if kind == "write-after-write":
        return (
            f"{access['op']} on {here} writes {size} that {earlier['op']} wrote on {there}; "
            f"nothing orders {here} after that write"
        )
    return (
        f"{access['op']} on {here} uses memory allocated after a free, which may be the freed "
        f"memory, while {earlier['op']} on {there} may still use that: the memory was freed "
        f"back to {here} before anything ordered {here} after that access, and record_stream "
        f"did not name {there}"
    )


def stream_name(place: dict[str, Any], device_type: str) -> str:
    default = " (default)" if place["stream"] == 0 else ""
    return f"stream {place['stream']}{default} of {device_type}:{place['device']}"


def _stack_lines(stack: list[list[Any]]) -> list[str]:
    frames = _own_frames(stack)
    if not frames:
        return ["    (no Python frame: a kernel autograd ran in backward, on its device thread)"]
    shown = frames[-STACK_FRAMES_SHOWN:]
    lines = [f"    ... {len(frames) - len(shown)} outer frames"] if len(shown) < len(frames) else []
    lines.extend(f'    File "{path}", line {line}, in {function}' for path, line, function in shown)
    return lines


def _own_frames(stack: list[list[Any]]) -> list[list[Any]]:
    """The stack without its outer frames in the harness's rank machinery and the stdlib,
    and without its inner frames in the harness (a backend reporting its collective)."""
    start, end = 0, len(stack)
    while start < end and _is_machinery(stack[start][0]):
        start += 1
    while end > start and _is_reporting(stack[end - 1][0]):
        end -= 1
    return stack[start:end]


def _is_reporting(path: str) -> bool:
    return path.startswith(_HARNESS_DIR + os.sep) or path.endswith(_TORCH_OP_CALL)


def _is_machinery(path: str) -> bool:
    return path.startswith((_HARNESS_DIR + os.sep, _STDLIB_DIR + os.sep, "<frozen"))
