"""The gradient-accumulation grid of cases.md §2.9 at world size 4, and its replicate form (§3.7).

Model: ``Sequential(Linear(32, 32), MLP(32), MLP(32), MLP(32))``; each MLP is its own group
and the root owns the first Linear, so there are 4 groups. 5 iterations of 3 microbatches;
the flags are set before each microbatch (``last`` on the third) and every microbatch's
collectives are counted with the harness's tracer and compared with what the flags imply.
The sums over an iteration are also compared with the catalogue's closed-form totals
(``catalogue_totals``), written independently of the per-microbatch derivation. Losses are
compared every microbatch; after the last one, gradients (the reference's accumulated and
averaged over ranks) and, after the optimizer step, parameters.

Grid: mesh {1-D (4,), HSDP (2, 2)} x reshard_after_forward {True, False, 2} x mode
{all, root_only, some_mlps} x reshard_after_backward {False, True} x offload
{OffloadPolicy(), CPUOffloadPolicy(pin_memory=False)} x reduce_scatter_only, minus the
catalogue's early returns. Upstream's offload rows use ``CPUOffloadPolicy()`` (pinned), which
cannot run without an accelerator, so on CPU it runs 33 rows; we run those 33 plus the 9
offload rows with ``pin_memory=False``: 42 items. Rows needing a capability the
implementation does not declare (``hsdp``, ``cpu_offload``) are skipped as unsupported.
Everything is ``slow`` except a few representative rows.

The replicate form upstream is vacuous (its early return fires for every 1-D mesh); here it
runs what it meant to check: one all-reduce per synced group, no all-gather, no
reduce-scatter, and parity.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from harness.comm import CommTracer
from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import MLP

MICROBATCHES = 3
ITERATIONS = 5
GROUPS = 4  # the root (first Linear) and three MLPs
MODES = ("all", "root_only", "some_mlps")


@dataclass(frozen=True)
class Row:
    hsdp: bool
    raf: bool | int
    mode: str
    rab: bool
    offload: bool
    reduce_scatter_only: bool

    @property
    def id(self) -> str:
        return (
            f"{'hsdp' if self.hsdp else '1d'}-raf={self.raf}-{self.mode}-rab={self.rab}"
            f"-{'cpuoffload' if self.offload else 'nooffload'}"
            f"-{'rsonly' if self.reduce_scatter_only else 'sync'}"
        )


def catalogue_skips(row: Row) -> bool:
    """The early returns of cases.md §2.9 (the pinned-memory one does not apply: unpinned)."""
    return (
        (not row.rab and (row.raf is not False or row.mode == "some_mlps"))
        or (row.offload and row.raf is not True)
        or (not row.hsdp and row.reduce_scatter_only)
    )


ALL_ROWS = [
    row
    for hsdp in (False, True)
    for raf in (True, False, 2)
    for mode in MODES
    for rab in (False, True)
    for offload in (False, True)
    for reduce_scatter_only in (False, True)
    if not catalogue_skips(row := Row(hsdp, raf, mode, rab, offload, reduce_scatter_only))
]
# What runs in the default (not slow) selection: one row per feature the grid exercises.
DEFAULT_ROWS = {
    Row(False, False, "root_only", False, False, False),
    Row(True, False, "some_mlps", True, False, True),
    Row(True, True, "all", True, True, False),
}


def grid_param(row: Row):
    marks = [] if row in DEFAULT_ROWS else [pytest.mark.slow]
    if row.raf == 2:
        # torch caches its post-forward sub-mesh across the harness's group teardown.
        marks.append(pytest.mark.fresh_pool)
    return pytest.param(row, id=row.id, marks=marks)


def flag_targets(mode: str) -> set[int]:
    """Indices (0 = root, 1..3 = MLPs) of the groups whose flags the mode toggles."""
    return {"all": {0, 1, 2, 3}, "some_mlps": {1, 2}, "root_only": {0}}[mode]


def expected_per_microbatch(row: Row, microbatch: int) -> dict[str, int]:
    """Collectives of one microbatch, derived from which groups the flags touch."""
    last = microbatch == MICROBATCHES - 1
    targets = flag_targets(row.mode)
    others = GROUPS - len(targets)
    toggled_on = len(targets) if last else 0
    if row.reduce_scatter_only:
        reduce_scatters = GROUPS
        all_reduces = others + toggled_on
    else:
        reduce_scatters = others + toggled_on
        all_reduces = reduce_scatters
    if not row.hsdp:
        all_reduces = 0
    # Sharded at the start of a microbatch: every group on the first one (the previous
    # iteration ended with reshard_after_backward on), then the groups that resharded after
    # the previous microbatch's backward.
    forward_gathers = GROUPS if microbatch == 0 or row.rab else others
    backward_gathers = GROUPS if row.raf is not False else 0
    return {
        "all_gather": forward_gathers + backward_gathers,
        "reduce_scatter": reduce_scatters,
        "all_reduce": all_reduces,
    }


def catalogue_totals(row: Row) -> dict[str, int]:
    """cases.md §2.9's formulas for one iteration, transcribed as written."""
    expected_rs = 4
    if row.mode == "some_mlps":
        expected_rs += (3 - 2 + 1) * 2
    elif row.mode == "root_only":
        expected_rs += 3 * 2
    expected_ar = expected_rs if row.hsdp else 0
    if row.reduce_scatter_only:
        expected_rs = 4 * 3
    expected_ag = 4
    if row.raf is not False:
        expected_ag = (4 + 4) * 3
    elif row.rab:
        expected_ag = 4 * 3
    elif row.mode == "all":
        pass
    elif row.mode == "root_only":
        expected_ag = 4 + 3 * 2
    return {"all_gather": expected_ag, "reduce_scatter": expected_rs, "all_reduce": expected_ar}


def set_flags(
    model: nn.Module, mode: str, rab: bool, reduce_scatter_only: bool, last: bool
) -> None:
    def sync(module: nn.Module, recurse: bool) -> None:
        if reduce_scatter_only:
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)
        if not rab:
            module.set_reshard_after_backward(last, recurse=recurse)

    if mode == "all":
        sync(model, True)
    elif mode == "some_mlps":
        for mlp in model[1:3]:
            sync(mlp, True)
    else:
        sync(model, False)


def require(impl, *capabilities: str) -> None:
    missing = [c for c in capabilities if not impl.supports(c)]
    if missing:
        pytest.skip(f"UNSUPPORTED: {impl.name} does not declare {', '.join(missing)}")


def test_per_microbatch_counts_add_up_to_the_catalogue_totals():
    for row in ALL_ROWS:
        summed = {kind: 0 for kind in ("all_gather", "reduce_scatter", "all_reduce")}
        for microbatch in range(MICROBATCHES):
            for kind, n in expected_per_microbatch(row, microbatch).items():
                summed[kind] += n
        assert summed == catalogue_totals(row), row.id


def test_the_grid_has_the_catalogue_rows():
    upstream_on_cpu = [row for row in ALL_ROWS if not row.offload]
    assert len(upstream_on_cpu) == 33  # cases.md §2.9: 33 on CPU at ws 4 [observed]
    assert len(ALL_ROWS) == 42  # 42 on GPU: the offload rows, here unpinned


@pytest.mark.world_size(4)
@pytest.mark.parametrize("row", [grid_param(row) for row in ALL_ROWS])
def test_gradient_accumulation_grid(rank_ctx, impl, row: Row):
    require(impl, "gradient_accumulation")
    if row.hsdp:
        require(impl, "hsdp")
    if row.offload:
        require(impl, "cpu_offload")
    if row.hsdp:
        mesh = rank_ctx.mesh((2, 2), ("dp_replicate", "dp_shard"))
    else:
        mesh = rank_ctx.mesh((rank_ctx.world_size,), ("dp",))
    offload_policy = (
        impl.CPUOffloadPolicy(pin_memory=False) if row.offload else impl.OffloadPolicy()
    )

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 32), MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model[1:]:
        impl.fully_shard(
            mlp, mesh=mesh, reshard_after_forward=row.raf, offload_policy=offload_policy
        )
    impl.fully_shard(model, mesh=mesh, reshard_after_forward=row.raf, offload_policy=offload_policy)
    run_accumulation(rank_ctx.rank, model, reference, row, expected_per_microbatch)


def run_accumulation(rank: int, model: nn.Module, reference: nn.Module, row: Row, expected) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    for iteration in range(ITERATIONS):
        for microbatch in range(MICROBATCHES):
            last = microbatch == MICROBATCHES - 1
            set_flags(model, row.mode, row.rab, row.reduce_scatter_only, last)
            inp = torch.randn(2, 32)
            with CommTracer(functional=False) as trace:
                loss = model(inp).sum()
                loss.backward()
            counts = {
                kind: trace.count(kind) for kind in ("all_gather", "reduce_scatter", "all_reduce")
            }
            assert counts == expected(row, microbatch), (
                f"iteration {iteration}, microbatch {microbatch}:\n{trace.schedule()}"
            )
            assert len(trace.calls) == sum(counts.values()), trace.schedule()
            reference_loss = reference(inp).sum()
            reference_loss.backward()
            assert_losses_equal(iteration * MICROBATCHES + microbatch, loss, reference_loss)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        optimizer.step()
        reference_optimizer.step()
        set_to_none = iteration % 2 == 1
        optimizer.zero_grad(set_to_none=set_to_none)
        reference_optimizer.zero_grad(set_to_none=set_to_none)
    assert_sharded_parity(reference, model, check_grads=False)


# --- replicate (cases.md §3.7, what it meant to check) ------------------------------------------

REPLICATE_ROWS = sorted(
    {
        Row(False, False, row.mode, row.rab, row.offload, False)
        for row in ALL_ROWS
        if not row.hsdp and not row.reduce_scatter_only
    },
    key=lambda row: row.id,
)


def expected_replicate_per_microbatch(row: Row, microbatch: int) -> dict[str, int]:
    last = microbatch == MICROBATCHES - 1
    targets = flag_targets(row.mode)
    synced = GROUPS - len(targets) + (len(targets) if last else 0)
    return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": synced}


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row, id=row.id.replace("-raf=False", ""), marks=() if i == 0 else pytest.mark.slow
        )
        for i, row in enumerate(REPLICATE_ROWS)
    ],
)
def test_replicate_gradient_accumulation(rank_ctx, impl, row: Row):
    require(impl, "replicate", "gradient_accumulation")
    if row.offload:
        require(impl, "cpu_offload")
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("replicate",))
    offload_policy = (
        impl.CPUOffloadPolicy(pin_memory=False) if row.offload else impl.OffloadPolicy()
    )
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 32), MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model[1:]:
        impl.replicate(mlp, mesh=mesh, offload_policy=offload_policy)
    impl.replicate(model, mesh=mesh, offload_policy=offload_policy)
    run_accumulation(rank_ctx.rank, model, reference, row, expected_replicate_per_microbatch)
