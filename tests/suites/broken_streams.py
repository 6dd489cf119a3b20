"""Broken implementations that each drop one synchronisation between streams.

On a GPU each of these gives intermittent wrong values; on the fake device the numbers stay
right (its work is synchronous), and only the stream checker
(``harness/rank/stream_safety.py``) can fail them. Their rows in ``test_broken_adapters.py``
run with ``--device fakeaccel`` and require the checker's message.

Torch's FSDP2 takes its streams from the device module (``device_handle.current_stream()``,
``device_handle.Stream()``, here ``torch.fakeaccel``). :func:`drop_stream_wait` hands it
streams whose ``wait_event`` / ``wait_stream`` does nothing when called from one function
of FSDP2, the one line where the bug would sit, which keeps each breakage to one
synchronisation without copying FSDP2's code. The function names are FSDP2's in the
installed torch; :func:`drop_stream_wait` refuses a name FSDP2 no longer has, so a rename
fails the row instead of silently breaking nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

from distconform.harness.devices import current_stream_set

#: (method, FSDP2 function) pairs whose call does nothing in this process.
_DROPPED: set[tuple[str, str]] = set()


class DroppingStream(torch.Stream):
    """A stream whose waits named in ``_DROPPED`` do nothing when called from there."""

    def wait_event(self, event: torch.Event) -> None:
        if ("wait_event", sys._getframe(1).f_code.co_name) not in _DROPPED:
            super().wait_event(event)

    def wait_stream(self, stream: torch.Stream) -> None:
        if ("wait_stream", sys._getframe(1).f_code.co_name) not in _DROPPED:
            super().wait_stream(stream)


def _dropping(make: Callable[..., torch.Stream]) -> Callable[..., torch.Stream]:
    def build(*args: Any, **kwargs: Any) -> torch.Stream:
        stream = make(*args, **kwargs)
        return DroppingStream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )

    build.dropping = True  # type: ignore[attr-defined]
    return build


def drop_stream_wait(method: str, caller: str) -> None:
    """Make ``Stream.<method>`` a no-op when FSDP2's function ``caller`` calls it."""
    owners = (_fsdp_collectives, _fsdp_param_group, _fsdp_param_group.FSDPParamGroup)
    if not any(hasattr(owner, caller) for owner in owners):
        raise LookupError(f"torch's FSDP2 has no function {caller!r} any more")
    _DROPPED.add((method, caller))
    device_module = torch.get_device_module(torch.accelerator.current_accelerator())
    if not getattr(device_module.current_stream, "dropping", False):
        device_module.current_stream = _dropping(device_module.current_stream)
        device_module.Stream = _dropping(device_module.Stream)


def skip_all_gather_wait(module: nn.Module) -> None:
    """The compute stream uses the unsharded parameters without waiting for the all-gather."""
    drop_stream_wait("wait_event", "foreach_all_gather_copy_out")


def skip_reduce_scatter_stream_wait(module: nn.Module) -> None:
    """The reduce-scatter stream reads the gradients without waiting for the compute stream."""
    drop_stream_wait("wait_stream", "foreach_reduce")


def skip_final_wait(module: nn.Module) -> None:
    """Backward ends without the compute stream waiting for the last reductions: the
    optimizer reads gradients the reduce-scatter stream may still be writing."""
    drop_stream_wait("wait_event", "finalize_backward")
    drop_stream_wait("wait_event", "_wait_for_post_backward")


def free_reduce_scatter_input_early(module: nn.Module) -> None:
    """The reduce-scatter input is dropped as soon as the collective is issued, instead of
    being kept until the compute stream has waited for it: its memory goes back to the
    compute stream while the reduce-scatter stream may still read it."""
    keep = _fsdp_param_group.ReduceScatterState
    if getattr(keep, "drops_input", False):
        return

    def dropping_input(reduce_scatter_input: torch.Tensor, event: Any) -> Any:
        return keep(reduce_scatter_input.new_empty(0), event)

    dropping_input.drops_input = True  # type: ignore[attr-defined]
    _fsdp_param_group.ReduceScatterState = dropping_input


def unshard_wait_on_wrong_stream(module: nn.Module) -> None:
    """``unshard(async_op=True).wait()`` waits on a side stream, not the current one: the
    forward then reads parameters its own stream never waited for."""
    unshard = module.unshard
    side = torch.Stream(device=torch.accelerator.current_accelerator())

    class WrongStreamHandle:
        def __init__(self, handle: Any) -> None:
            self._handle = handle

        def wait(self) -> None:
            side.wait_stream(torch.accelerator.current_stream())
            with current_stream_set(side):
                self._handle.wait()

    def unshard_then_wait_elsewhere(async_op: bool = False) -> Any:
        handle = unshard(async_op=async_op)
        return WrongStreamHandle(handle) if handle is not None else None

    module.unshard = unshard_then_wait_elsewhere


STREAM_BREAKAGES: dict[str, Callable[[nn.Module], None]] = {
    "skip_all_gather_wait": skip_all_gather_wait,
    "skip_reduce_scatter_stream_wait": skip_reduce_scatter_stream_wait,
    "skip_final_wait": skip_final_wait,
    "free_reduce_scatter_input_early": free_reduce_scatter_input_early,
    "unshard_wait_on_wrong_stream": unshard_wait_on_wrong_stream,
}
