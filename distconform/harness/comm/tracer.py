"""``CommTracer``: count and trace the collectives one rank issues, per kind, group and phase."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.comm.intercept import Interceptor, Proceed
from distconform.harness.comm.records import (
    CollectiveCall,
    RawCall,
    default_group_name,
    group_identity,
    wire_bytes,
)
from distconform.harness.shared.rank_context import get_rank_context


class CallNumbering:
    """Turns raw calls into numbered, labelled :class:`CollectiveCall` records.

    ``labels`` maps c10d group names to readable names (mesh dims); the default group is
    ``world``; any other group is named ``ranks[...]`` after its global ranks.
    """

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self._labels = dict(labels or {})
        self._seq = 0
        self._group_seq: Counter[str] = Counter()

    def number(self, raw: RawCall, phase: str | None) -> CollectiveCall:
        if raw.group_ranks is not None:
            name = raw.group if isinstance(raw.group, str) else str(raw.group)
            ranks = raw.group_ranks
        else:
            name, ranks = group_identity(raw.group, _torch_private.live_process_groups)
        label = self._labels.get(name)
        if label is None:
            label = "world" if name == default_group_name() else f"ranks{list(ranks)}"
        call = CollectiveCall(
            seq=self._seq,
            group_seq=self._group_seq[name],
            kind=raw.kind,
            api=raw.api,
            group=label,
            group_name=name,
            group_ranks=ranks,
            shapes=raw.shapes or (),
            dtypes=raw.dtypes or (),
            numel=raw.numel or 0,
            nbytes=raw.nbytes or 0,
            out_numel=raw.out_numel,
            out_nbytes=raw.out_nbytes,
            wire_bytes=wire_bytes(raw.kind, raw.nbytes or 0, raw.out_nbytes, len(ranks)),
            phase=phase or raw.auto_phase,
            site=raw.site,
            peer=raw.peer,
            time=raw.time,
            op=raw.op,
        )
        self._seq += 1
        self._group_seq[name] += 1
        return call


def mesh_group_labels(mesh: Any) -> dict[str, str]:
    """c10d group name -> mesh dim name, for every named dim of a DeviceMesh."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {mesh.get_group(i).group_name: name for i, name in enumerate(names)}


@dataclass(frozen=True)
class CommTotals:
    """Sums over the traced calls that match a filter: how many, the elements and bytes of
    their inputs and outputs, and the bytes each rank sends over the wire."""

    calls: int
    numel: int
    nbytes: int
    out_numel: int
    out_nbytes: int
    wire_bytes: int


class CommTracer(Interceptor):
    """Records every collective this rank issues while the context is active.

    ``with CommTracer(mesh=mesh) as trace: ...`` on every rank. Groups are named by the
    mesh's dim names (``mesh``), by ``group_labels`` ({ProcessGroup or group name: label}),
    ``world`` for the default group, else ``ranks[...]``. Phases: the innermost
    ``with trace.phase(name)`` if any, else what the stack shows (``auto_phase``):
    ``forward`` / ``backward`` / ``optimizer``, or ``-``. ``functional=False`` skips the
    torch function mode (no per-op cost). Functional collectives are seen when called
    through their op packets, as DTensor and funcol call them, in forward and backward;
    ``dispatch=True`` also sees them called any other way (an overload such as
    ``.default``), at a per-op cost.
    """

    def __init__(
        self,
        *,
        mesh: Any = None,
        group_labels: Mapping[Any, str] | None = None,
        auto_phase: bool = True,
        functional: bool = True,
        dispatch: bool = False,
    ) -> None:
        self.functional = functional
        self.dispatch = dispatch
        labels: dict[str, str] = {}
        if mesh is not None:
            labels.update(mesh_group_labels(mesh))
        for group, label in (group_labels or {}).items():
            labels[group if isinstance(group, str) else group.group_name] = label
        self._numbering = CallNumbering(labels)
        self._auto_phase = auto_phase
        self._phases: list[str] = []
        self._lock = threading.Lock()
        self.calls: list[CollectiveCall] = []
        self.marks: list[tuple[int, str]] = []  # (number of calls before the mark, label)

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        phase = self._phases[-1] if self._phases else (None if self._auto_phase else "-")
        with self._lock:
            self.calls.append(self._numbering.number(raw, phase))
        return proceed()

    def __enter__(self) -> CommTracer:
        super().__enter__()
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the collectives issued inside the block with ``name``."""
        self._phases.append(name)
        try:
            yield
        finally:
            self._phases.pop()

    # --- queries ------------------------------------------------------------------------

    def select(
        self, kind: str | None = None, *, group: str | None = None, phase: str | None = None
    ) -> list[CollectiveCall]:
        return [
            c
            for c in self.calls
            if (kind is None or c.kind == kind)
            and (group is None or c.group == group)
            and (phase is None or c.phase == phase)
        ]

    def count(
        self, kind: str | None = None, *, group: str | None = None, phase: str | None = None
    ) -> int:
        return len(self.select(kind, group=group, phase=phase))

    def totals(
        self, kind: str | None = None, *, group: str | None = None, phase: str | None = None
    ) -> CommTotals:
        chosen = self.select(kind, group=group, phase=phase)
        return CommTotals(
            calls=len(chosen),
            numel=sum(c.numel for c in chosen),
            nbytes=sum(c.nbytes for c in chosen),
            out_numel=sum(c.out_numel for c in chosen),
            out_nbytes=sum(c.out_nbytes for c in chosen),
            wire_bytes=sum(c.wire_bytes for c in chosen),
        )

    def counts(self, *by: str) -> dict[Any, int]:
        """Calls per key; ``by`` names CollectiveCall fields (default: ``kind``).

        ``trace.counts("phase", "kind")`` -> {("forward", "all_gather"): 2, ...}.
        """
        fields = by or ("kind",)
        counted: Counter[Any] = Counter()
        for call in self.calls:
            key = tuple(getattr(call, f) for f in fields)
            counted[key[0] if len(key) == 1 else key] += 1
        return dict(counted)

    def mark(self, label: str) -> None:
        """Put ``label`` between the collectives issued before and after this call.

        Marks show where a collective was issued relative to the program (e.g. a module's
        forward pre-hook marking each layer), which counts alone cannot show.
        """
        with self._lock:
            self.marks.append((len(self.calls), label))

    def schedule(self, *, with_phase: bool = True, with_site: bool = False) -> str:
        """One line per collective in issue order (phase, kind, group, tensors); marks as
        ``== label`` lines."""
        return format_schedule(
            self.calls, with_phase=with_phase, with_site=with_site, marks=self.marks
        )

    def clear(self) -> None:
        with self._lock:
            self.calls.clear()
            self.marks.clear()


def format_schedule(
    calls: list[CollectiveCall],
    *,
    with_phase: bool = True,
    with_site: bool = False,
    marks: Sequence[tuple[int, str]] = (),
) -> str:
    """``calls`` as aligned text, one line per collective (phase, kind, group, tensors; the
    call site with ``with_site``), with a ``== label`` line before each ``(position, label)``
    of ``marks``: the schedule :func:`assert_schedule` compares."""
    rows = []
    for call in calls:
        row = [call.phase] if with_phase else []
        peer = f" peer={call.peer}" if call.peer is not None else ""
        row += [call.kind, call.group, call.tensors_text() + peer]
        if with_site:
            row.append(call.site)
        rows.append(row)
    widths = [
        max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows), default=0))
    ]
    lines = [" ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    labels_at: dict[int, list[str]] = {}
    for position, label in marks:
        labels_at.setdefault(position, []).append(f"== {label}")
    out = []
    for position in range(len(lines) + 1):
        out.extend(labels_at.get(position, ()))
        if position < len(lines):
            out.append(lines[position])
    return "".join(line + "\n" for line in out)


def current_rank() -> int:
    """The harness rank if inside one, else the c10d rank, else 0."""
    try:
        return get_rank_context().rank
    except RuntimeError:
        return dist.get_rank() if dist.is_initialized() else 0
