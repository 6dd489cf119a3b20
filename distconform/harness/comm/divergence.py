"""Comparing the ranks' collective traces: where did they stop agreeing?

Calls are matched per process group by their per-group sequence number. The first
divergence is the earliest (by issue time) group position where the ranks that arrived
disagree on kind, shapes or dtypes, or where some members never arrived. Point-to-point
calls are not matched (send and recv are not symmetric).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distconform.harness.comm.records import POINT_TO_POINT, CollectiveCall


@dataclass(frozen=True)
class Divergence:
    """The first collective the ranks of one group do not agree on."""

    group: str
    group_ranks: tuple[int, ...]
    group_seq: int
    arrived: dict[int, CollectiveCall]
    missing: tuple[int, ...]
    last_calls: dict[int, CollectiveCall | None]  # each missing rank's last call on the group

    @property
    def mismatched(self) -> bool:
        return len({c.signature for c in self.arrived.values()}) > 1

    @property
    def kind(self) -> str:
        return next(iter(self.arrived.values())).kind

    def describe(self, rank_states: Mapping[int, str] | None = None) -> str:
        states = rank_states or {}
        ranks = ", ".join(str(r) for r in self.group_ranks)
        lines = []
        if self.mismatched:
            lines.append(
                f"the ranks called different collectives at position #{self.group_seq} of "
                f"group {self.group} (ranks {ranks}):"
            )
        else:
            lines.append(
                f"rank{'s' if len(self.missing) > 1 else ''} "
                f"{', '.join(str(r) for r in self.missing)} never arrived at {self.kind} "
                f"#{self.group_seq} on group {self.group} (ranks {ranks}):"
            )
        for rank, call in sorted(self.arrived.items()):
            state = f" [{states[rank]}]" if rank in states else ""
            lines.append(
                f"  rank {rank} called {call.kind} {call.tensors_text()} ({call.api}) "
                f"at {call.site}{state}"
            )
        for rank in self.missing:
            state = f" [{states[rank]}]" if rank in states else ""
            last = self.last_calls.get(rank)
            if last is None:
                lines.append(f"  rank {rank} issued no collective on this group{state}")
            else:
                lines.append(
                    f"  rank {rank} never arrived; its last call on this group was "
                    f"{last.kind} #{last.group_seq} {last.tensors_text()} at {last.site}{state}"
                )
        return "\n".join(lines)


def find_divergence(traces: Mapping[int, Sequence[CollectiveCall]]) -> Divergence | None:
    """The first divergence between the ranks' traces, or None if they agree.

    ``traces`` maps every rank of the world to its calls (empty for a rank that issued
    none). Ranks that ended early are "missing" from the collectives the others wait in.
    """
    groups: dict[str, tuple[str, tuple[int, ...]]] = {}
    by_group: dict[str, dict[int, dict[int, CollectiveCall]]] = {}
    for rank, calls in traces.items():
        for call in calls:
            if call.kind in POINT_TO_POINT or not call.group_ranks:
                continue
            groups.setdefault(call.group_name, (call.group, call.group_ranks))
            by_group.setdefault(call.group_name, {}).setdefault(rank, {})[call.group_seq] = call
    found: list[tuple[float, Divergence]] = []
    for name, (label, members) in groups.items():
        per_rank = {r: by_group[name].get(r, {}) for r in members}
        divergence = _first_in_group(label, members, per_rank)
        if divergence is not None:
            when = min(c.time for c in divergence.arrived.values())
            found.append((when, divergence))
    if not found:
        return None
    return min(found, key=lambda item: item[0])[1]


def _first_in_group(
    label: str, members: tuple[int, ...], per_rank: dict[int, dict[int, CollectiveCall]]
) -> Divergence | None:
    present = [seqs for seqs in per_rank.values() if seqs]
    # A rank whose ring dropped old calls can only be compared from its oldest kept one.
    start = max(min(seqs) for seqs in present)
    end = max(max(seqs) for seqs in present)
    for seq in range(start, end + 1):
        arrived = {r: seqs[seq] for r, seqs in per_rank.items() if seq in seqs}
        missing = tuple(r for r in members if r not in arrived)
        if not arrived:
            continue
        if missing or len({c.signature for c in arrived.values()}) > 1:
            last_calls = {
                r: per_rank[r][max(per_rank[r])] if per_rank[r] else None for r in missing
            }
            label = next(iter(arrived.values())).group
            return Divergence(label, members, seq, arrived, missing, last_calls)
    return None
