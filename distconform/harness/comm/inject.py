"""Perturbing collectives on chosen ranks: delays and arbitrary wrappers.

Nothing is patched for the collectives themselves: an injector is a thread-local torch
function mode (see intercept.py), so on the thread launcher it only affects the rank
thread that entered it, and on exit nothing of it remains. ``ranks`` picks the ranks by
``harness.get_rank_context()`` (the c10d rank outside the harness): on every other rank
the context does nothing, so the same ``with`` can be written on every rank.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from distconform.harness.comm.intercept import Interceptor, Proceed
from distconform.harness.comm.records import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, RawCall
from distconform.harness.comm.tracer import current_rank

DEFAULT_KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
Around = Callable[[RawCall, Proceed], Any]


class _CollectiveWrapper(Interceptor):
    def __init__(self, around: Around, kinds: Collection[str]) -> None:
        self._around = around
        self._kinds = frozenset(kinds)

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        if raw.kind not in self._kinds:
            return proceed()
        return self._around(raw, proceed)


@contextlib.contextmanager
def wrap_collectives(
    around: Around,
    *,
    kinds: Collection[str] = DEFAULT_KINDS,
    ranks: Collection[int] | None = None,
) -> Iterator[None]:
    """Run ``around(call, proceed)`` instead of each matching collective on ``ranks``.

    ``around`` must call ``proceed()`` once (it issues the collective) and return its
    value; ``call`` describes the collective (``kind``, ``api``, ``shapes``, ``site``).
    ``ranks=None`` means every rank.
    """
    if ranks is not None and current_rank() not in ranks:
        yield
        return
    with _CollectiveWrapper(around, kinds):
        yield


def delay_collectives(
    seconds: float,
    *,
    kinds: Collection[str] = DEFAULT_KINDS,
    ranks: Collection[int] | None = None,
    on_device: bool = False,
) -> contextlib.AbstractContextManager[None]:
    """Delay each matching collective on ``ranks`` by ``seconds`` before it is issued.

    On the CPU the host busy-waits (a sleep would release the GIL and let other rank
    threads run, which changes the interleaving being tested); with ``on_device`` the
    accelerator's current stream is kept busy instead and the host does not wait.
    """

    def delayed(call: RawCall, proceed: Proceed) -> Any:
        if on_device:
            device_sleep(seconds)
        else:
            busy_wait(seconds)
        return proceed()

    return wrap_collectives(delayed, kinds=kinds, ranks=ranks)


def busy_wait(seconds: float) -> None:
    """Spin the calling thread for ``seconds`` of wall time."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


_kernel_seconds: dict[str, float] = {}
_SPIN_SIZE = 512


def device_sleep(seconds: float, device: torch.device | str | None = None) -> None:
    """Keep the current stream of an accelerator busy for about ``seconds``; host returns at once.

    Uses public APIs only: a calibrated number of small matmuls, timed once per device
    with ``torch.Event``. Refuses the CPU (there is no stream to delay; use busy_wait).
    """
    if device is None:
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise RuntimeError("device_sleep needs an accelerator; on the CPU use busy_wait")
        device = accelerator
    device = torch.device(device)
    if device.type == "cpu":
        raise RuntimeError("device_sleep needs an accelerator; on the CPU use busy_wait")
    per_kernel = _kernel_seconds.get(str(device))
    matrix = torch.ones(_SPIN_SIZE, _SPIN_SIZE, device=device)
    if per_kernel is None:
        per_kernel = _kernel_seconds[str(device)] = _time_kernel(matrix)
    for _ in range(max(1, math.ceil(seconds / per_kernel))):
        torch.mm(matrix, matrix)


def _time_kernel(matrix: torch.Tensor, repeats: int = 50) -> float:
    start = torch.Event(device=matrix.device, enable_timing=True)
    stop = torch.Event(device=matrix.device, enable_timing=True)
    torch.mm(matrix, matrix)  # warm-up: library initialisation is not a kernel's time
    start.record()
    for _ in range(repeats):
        torch.mm(matrix, matrix)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1000.0 / repeats
