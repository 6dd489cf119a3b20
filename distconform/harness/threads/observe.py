"""Collective observer hook: the threaded backend reports every collective it executes.

torch's ``CommDebugMode`` does not see c10d ops issued through a Python backend, so the
comm counter subscribes here instead. A listener is called on the issuing rank's thread,
at issue time (before the collective completes), once per rank per collective, so a
listener may use thread-local state (e.g. "which counter is active on this rank"). A
listener that raises fails the collective on that rank: observers are test tooling and
must not fail silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    """One rank's view of one collective.

    ``shapes``/``dtypes``/``numel``/``nbytes`` describe the tensors this rank contributes
    (its inputs); ``out_numel``/``out_nbytes`` the tensors it receives into. For ``recv``
    the inputs are empty; for ``barrier`` both are.
    """

    op: str
    group_name: str
    group_ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # global rank of the issuing thread
    group_rank: int
    seq: int  # per-group sequence number of this collective on this rank
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    numel: int
    nbytes: int
    out_numel: int
    out_nbytes: int


Listener = Callable[[CollectiveRecord], None]

_lock = threading.Lock()
_listeners: tuple[Listener, ...] = ()  # replaced, never mutated: readers need no lock


class ListenerHandle:
    """Returned by :func:`add_collective_listener`; ``remove()`` unsubscribes (idempotent)."""

    def __init__(self, fn: Listener) -> None:
        self._fn = fn

    def remove(self) -> None:
        global _listeners
        with _lock:
            _listeners = tuple(f for f in _listeners if f is not self._fn)

    def __enter__(self) -> ListenerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def add_collective_listener(fn: Listener) -> ListenerHandle:
    """Call ``fn(record)`` for every collective the threaded backend executes."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, fn)
    return ListenerHandle(fn)


def has_listeners() -> bool:
    return bool(_listeners)


def notify(
    *,
    op: str,
    group_name: str,
    group_ranks: tuple[int, ...],
    rank: int,
    group_rank: int,
    seq: int,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
) -> None:
    listeners = _listeners
    if not listeners:
        return  # the common case: no record is built at all
    record = CollectiveRecord(
        op=op,
        group_name=group_name,
        group_ranks=group_ranks,
        rank=rank,
        group_rank=group_rank,
        seq=seq,
        shapes=tuple(tuple(t.shape) for t in inputs),
        dtypes=tuple(t.dtype for t in inputs),
        numel=sum(t.numel() for t in inputs),
        nbytes=sum(t.numel() * t.element_size() for t in inputs),
        out_numel=sum(t.numel() for t in outputs),
        out_nbytes=sum(t.numel() * t.element_size() for t in outputs),
    )
    for fn in listeners:
        fn(record)
