"""FSDP2's collective schedule, computed from the plan and the step's module events.

This is the specification the wire-level checks hold an implementation to, written from
FSDP2's documented semantics (the ``fully_shard`` and ``FSDPModule`` docstrings), never
recorded from an implementation:

* **Forward.** The first time a pass enters a group, the group is all-gathered over its
  shard ranks in ``param_dtype`` unless it is already unsharded; then the groups on its
  forward-prefetch list, in list order. Both happen before the group's own computation.
  After the group's forward: ``reshard_after_forward=True`` frees the parameters, ``False``
  keeps them, an int ``k`` keeps a ``1/k`` slice so the next all-gather runs over ``k``
  consecutive shard ranks; the root's default is ``False``, everyone else's ``True``
  (``k == 1`` means ``False``, ``k == S`` means ``True``).
* **Backward.** When the gradient reaches a group's output: the group is all-gathered again
  if it was resharded (unless ``set_unshard_in_backward(False)``), then its backward-prefetch
  list in list order or, without a list, the group whose forward finished just before this
  one's (implicit prefetching; a module without parameters of its own has no group, so it
  neither prefetches implicitly nor counts as the one before). Once the group's gradients
  exist: one reduce-scatter over the shard ranks in ``reduce_dtype`` (default
  ``param_dtype``), then on an HSDP mesh one
  all-reduce over the replicate ranks; ``replicate`` all-reduces only. A group that is not
  the root reduces before the backward reaches a group outside it; the root's reduction may
  come at any point after its backward began. ``set_requires_gradient_sync(False)`` skips
  the reduction, ``set_requires_all_reduce(False)`` the all-reduce;
  ``set_force_sum_reduction_for_comms(True)`` makes the reductions SUM.
* **After backward.** Groups are resharded unless ``set_reshard_after_backward(False)``.

Where FSDP2 leaves the interleaving open (the root's reduction, two implementations
prefetching the same group at different points of the same window) the oracle gives a
window, not a position: see :class:`ExpectedCall`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distconform.api import dtype_name
from distconform.suites.schedule.plan import REPLICATE, GroupPlan, ShardingPlan

# Module events, in the order the program ran them (suites/schedule/observe.py).
FORWARD_ENTER = "F>"  # a group's module is called
FORWARD_COMPUTE = "F."  # the first computation inside it starts
FORWARD_EXIT = "F<"  # the module returned
BACKWARD_ENTER = "B>"  # the gradient reached the module's output
BACKWARD_COMPUTE = "B."  # the backward of its first computation starts
UNSHARD = "unshard"  # an explicit ``module.unshard()``
RESHARD = "reshard"  # an explicit ``module.reshard()``
FLAG = "flag"  # a setter through the plan's controls

SHARDED, UNSHARDED, POST_FORWARD = "sharded", "unsharded", "post-forward"


@dataclass(frozen=True)
class Event:
    code: str
    group: GroupPlan
    module: int = 0  # which module of a grouped fully_shard([a, b])
    values: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        if self.code == FLAG:
            settings = ", ".join(f"{k}={_show(v)}" for k, v in self.values.items())
            return f"{self.group.name}: {settings}"
        return f"{self.code} {self.group.name}"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(v.name if isinstance(v, GroupPlan) else str(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class ExpectedCall:
    """One collective the step must issue, and where it may be issued.

    The call must come after event ``after`` and before event ``before`` (``None``: before
    the step ends). Calls sharing a ``block`` (a group's own all-gather and its prefetches,
    a reduce-scatter and its all-reduce) must be issued in their order here.
    """

    kind: str
    ranks: tuple[int, ...]
    dtype: str
    numel: int
    group: str
    why: str
    after: int
    before: int | None
    block: int
    op: str | None = None
    over: str = ""  # the mesh dim the ranks are, for messages

    @property
    def signature(self) -> tuple[str, tuple[int, ...], str, int]:
        return (self.kind, self.ranks, self.dtype, self.numel)

    def describe(self) -> str:
        op = f" op={self.op}" if self.op else ""
        return (
            f"{self.kind} {self.dtype}[{self.numel}] over {self.over} ranks {list(self.ranks)}"
            f"{op} ({self.why})"
        )


@dataclass
class _Held:
    """What one group holds between events: nothing extra, its full parameters, or a
    post-forward slice over ``ranks``."""

    state: str = SHARDED
    ranks: tuple[int, ...] = ()


class Oracle:
    """Runs FSDP2's rules over a step's events; keeps what each group holds across steps."""

    def __init__(self, plan: ShardingPlan) -> None:
        self.plan = plan
        self.root = plan.root()
        self.held = {id(g): _Held() for g in plan.groups}
        self.flags = {id(g): g.flags.copy() for g in plan.groups}
        self._reset_pass()

    def _reset_pass(self) -> None:
        self.entered: set[int] = set()
        self.modules_to_exit: dict[int, set[int]] = {}
        self.post_forward_order: list[GroupPlan] = []
        self.backward_started: list[GroupPlan] = []

    # --- one step -----------------------------------------------------------------------

    def expected(self, events: Sequence[Event]) -> list[ExpectedCall]:
        """The collectives ``events`` call for; advances what the groups hold."""
        self._events = events
        self._calls: list[ExpectedCall] = []
        self._block = 0
        pending_reductions: list[tuple[GroupPlan, int]] = []
        for index, event in enumerate(events):
            group = event.group
            if event.code == FLAG:
                for name, value in event.values.items():
                    setattr(self.flags[id(group)], name, value)
            elif event.code == UNSHARD:
                self._block += 1
                self._gather(group, index, index + 1, "explicit unshard()", backward=False)
            elif event.code == RESHARD:
                self.held[id(group)] = _Held()
            elif event.code == FORWARD_ENTER:
                if self.backward_started:  # a new forward pass after a backward
                    self.finish_backward()
                self._enter_forward(group, event, index)
            elif event.code == FORWARD_EXIT:
                self._exit_forward(group, event)
            elif event.code == BACKWARD_ENTER and group not in self.backward_started:
                self.backward_started.append(group)
                compute = self._next(index, (BACKWARD_COMPUTE,), group)
                # A group with no computation of its own to mark computes right away.
                before = index + 1 if compute is None else compute
                self._enter_backward(group, index, before)
                pending_reductions.append((group, index if compute is None else compute))
        for group, start in pending_reductions:
            self._reduce(group, start)
        return self._calls

    def end_step(self) -> None:
        """A recorded step ends; a backward it ran is over."""
        if self.backward_started:
            self.finish_backward()

    def finish_backward(self) -> None:
        """The end of a backward pass: groups reshard unless told not to."""
        for group in self.backward_started:
            if self.flags[id(group)].reshard_after_backward:
                self.held[id(group)] = _Held()
        self._reset_pass()

    # --- forward ------------------------------------------------------------------------

    def _enter_forward(self, group: GroupPlan, event: Event, index: int) -> None:
        key = id(group)
        if key in self.entered:
            return
        self.entered.add(key)
        self.modules_to_exit[key] = set(range(len(group.modules)))
        compute = self._next(index, (FORWARD_COMPUTE, FORWARD_EXIT), group)
        self._block += 1
        self._gather(group, index, compute, f"forward of {group.name}", backward=False)
        for target in self.flags[key].forward_prefetch:
            self._gather(target, index, compute, f"forward prefetch by {group.name}", False)

    def _exit_forward(self, group: GroupPlan, event: Event) -> None:
        remaining = self.modules_to_exit.get(id(group))
        if remaining is None:
            return
        remaining.discard(event.module)
        if remaining:
            return
        del self.modules_to_exit[id(group)]
        self.entered.discard(id(group))  # a later call of the module is a new entry
        if not group.layout.empty:  # a module without parameters has no group to order
            self.post_forward_order.append(group)
        reshard = self._reshard_after_forward(group)
        if reshard is True:
            self.held[id(group)] = _Held()
        elif reshard is not False:
            ranks = group.ranks.post_forward(reshard, self.plan.rank)
            self.held[id(group)] = _Held(POST_FORWARD, ranks)

    def _reshard_after_forward(self, group: GroupPlan) -> bool | int:
        value = self.flags[id(group)].reshard_after_forward
        if value is None:
            return group is not self.root
        if isinstance(value, bool):
            return value
        if value == 1:
            return False
        return True if value == group.ranks.shard_size else value

    # --- backward -----------------------------------------------------------------------

    def _enter_backward(self, group: GroupPlan, index: int, compute: int | None) -> None:
        self._block += 1
        self._gather(group, index, compute, f"backward of {group.name}", backward=True)
        explicit = self.flags[id(group)].backward_prefetch
        if explicit is not None:
            for target in explicit:
                self._gather(target, index, compute, f"backward prefetch by {group.name}", True)
            return
        previous = None if group.layout.empty else self._finished_forward_before(group)
        if previous is not None:
            why = f"implicit backward prefetch by {group.name}"
            self._gather(previous, index, compute, why, backward=True)

    def _finished_forward_before(self, group: GroupPlan) -> GroupPlan | None:
        order = self.post_forward_order
        positions = [i for i, g in enumerate(order) if g is group]
        if not positions or positions[-1] == 0:
            return None
        return order[positions[-1] - 1]

    def _reduce(self, group: GroupPlan, start: int) -> None:
        flags = self.flags[id(group)]
        layout = group.trainable_layout()
        if layout.empty or not flags.requires_gradient_sync:
            return
        deadline = self._reduction_deadline(group, start)
        dtype = dtype_name(group.gradient_dtype)
        op = "SUM" if flags.force_sum_reduction else None
        shard_size = group.ranks.shard_size
        per_rank = layout.padded_numel(shard_size) // shard_size
        self._block += 1
        if shard_size > 1:
            self._add(
                "reduce_scatter",
                group.ranks.shard,
                dtype,
                layout.padded_numel(shard_size),
                group,
                f"gradients of {group.name}",
                start,
                deadline,
                op,
                over=group.ranks.shard_dim,
            )
        all_reduce = flags.requires_all_reduce or group.kind == REPLICATE
        if group.ranks.replicate_size > 1 and all_reduce:
            why = f"gradients of {group.name} across replicas"
            self._add(
                "all_reduce",
                group.ranks.replicate,
                dtype,
                per_rank,
                group,
                why,
                start,
                deadline,
                op,
                over=group.ranks.replicate_dim,
            )

    def _reduction_deadline(self, group: GroupPlan, start: int) -> int | None:
        """The first later event where the backward reaches a group outside ``group``."""
        for index in range(start + 1, len(self._events)):
            event = self._events[index]
            other = event.group
            if (
                event.code == BACKWARD_ENTER
                and other is not group
                and not self.plan.nested(other, group)
            ):
                return index
        return None

    # --- helpers ------------------------------------------------------------------------

    def _gather(
        self, group: GroupPlan, after: int, before: int | None, why: str, backward: bool
    ) -> None:
        held = self.held[id(group)]
        if held.state == UNSHARDED or group.layout.empty:
            return
        if backward and not self.flags[id(group)].unshard_in_backward:
            return
        self.held[id(group)] = _Held(UNSHARDED)
        shard_size = group.ranks.shard_size
        if shard_size == 1:
            return  # nothing to gather: every rank holds the whole group
        over = group.ranks.shard_dim
        if held.state == POST_FORWARD:
            ranks = held.ranks
            over = f"{len(ranks)} consecutive {over}"
        else:
            ranks = group.ranks.shard
        numel = group.layout.padded_numel(shard_size) // len(ranks)
        dtype = dtype_name(group.gather_dtype)
        self._add("all_gather", ranks, dtype, numel, group, why, after, before, over=over)

    def _add(
        self,
        kind: str,
        ranks: tuple[int, ...],
        dtype: str,
        numel: int,
        group: GroupPlan,
        why: str,
        after: int,
        before: int | None,
        op: str | None = None,
        *,
        over: str,
    ) -> None:
        self._calls.append(
            ExpectedCall(
                kind, ranks, dtype, numel, group.name, why, after, before, self._block, op, over
            )
        )

    def _next(self, index: int, codes: tuple[str, ...], group: GroupPlan) -> int | None:
        for later in range(index + 1, len(self._events)):
            event = self._events[later]
            if event.code in codes and event.group is group:
                return later
        return None
