"""Gradient accumulation flags and their exact collective counts (upstream's grid).

``Sequential(Linear(32, 32), MLP(32) x 3)``: each MLP its own group, the root owning the
first Linear (4 groups). 3 iterations of 3 microbatches; before each microbatch the flags
are set (``last`` on the third): gradient sync (or, with ``rso``, only the HSDP all-reduce),
and, without ``rab``, reshard-after-backward. Counts are summed over an iteration's
microbatches and must equal upstream's expected counts; every microbatch's collectives must be
FSDP2's schedule for the flags then in force (``suites/schedule``); gradients equal the
accumulated, averaged reference after each iteration.

The replicate variant was vacuous upstream (every subtest returned early);
here it checks what it meant: only all-reduces, 4 / 8 / 10 per iteration.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distconform.suites.cases import conformance
from distconform.suites.models import MLP
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import Expected, accumulate_with_parity

MICROBATCHES = 3
#: Three iterations: fresh gradients, then after zeroing in place, then after set-to-None.
ITERATIONS = 3
MODES = ("all", "root_only", "some_mlps")
OFFLOADS = ("none", "cpu", "cpu_pinned")


def runs(raf, mode: str, rab: bool, offload: str, rso: bool, hsdp: bool) -> bool:
    """The upstream grid's early returns (combinations it skips), as a filter."""
    if not rab and (raf is not False or mode == "some_mlps"):
        return False
    if offload != "none" and raf is not True:
        return False
    return hsdp or not rso


def accumulation_grid(mesh: str) -> list:
    hsdp = mesh == "hsdp"
    points = [
        dict(mesh=mesh, raf=raf, mode=mode, rab=rab, offload=offload, rso=rso)
        for raf in (True, False, 2)
        for mode in MODES
        for rab in (False, True)
        for offload in OFFLOADS
        for rso in (False, True)
        if runs(raf, mode, rab, offload, rso, hsdp)
    ]
    return [pytest.param(p, id="-".join(f"{k}={v}" for k, v in p.items())) for p in points]


def expected_counts(raf, mode: str, rab: bool, rso: bool, hsdp: bool) -> Expected:
    reduce_scatter = {"all": 4, "some_mlps": 4 + 2 * 2, "root_only": 4 + 3 * 2}[mode]
    all_reduce = reduce_scatter if hsdp else 0
    if rso:
        reduce_scatter = 4 * MICROBATCHES
    if raf is not False:
        all_gather = (4 + 4) * MICROBATCHES
    elif rab:
        all_gather = 4 * MICROBATCHES
    elif mode == "all":
        all_gather = 4
    else:  # root_only: the root stays unsharded, the three MLPs reshard every microbatch
        all_gather = 4 + 3 * (MICROBATCHES - 1)
    return Expected(all_gather=all_gather, reduce_scatter=reduce_scatter, all_reduce=all_reduce)


def set_flags(
    plan: ShardingPlan, model: nn.Module, mode: str, rab: bool, rso: bool, last: bool
) -> None:
    def sync(module: nn.Module, recurse: bool = True) -> None:
        if rso:
            plan.controls(module).set_requires_all_reduce(last, recurse=recurse)
        else:
            plan.controls(module).set_requires_gradient_sync(last, recurse=recurse)

    if mode == "all":
        sync(model)
        if not rab:
            plan.controls(model).set_reshard_after_backward(last)
    elif mode == "some_mlps":
        for mlp in model[1:3]:
            sync(mlp)
            if not rab:
                plan.controls(mlp).set_reshard_after_backward(last)
    else:
        sync(model, recurse=False)
        if not rab:
            plan.controls(model).set_reshard_after_backward(last, recurse=False)


def offload_policy(impl, offload: str):
    if offload == "none":
        return None
    return impl.CPUOffloadPolicy(pin_memory=offload == "cpu_pinned")


def run_accumulation(rank_ctx, plan: ShardingPlan, manage, point: dict, expected: Expected) -> None:
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = nn.Sequential(nn.Linear(32, 32), MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model[1:]:
        manage(mlp)
    manage(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)

    torch.manual_seed(42 + rank_ctx.rank + 1)
    accumulate_with_parity(
        model,
        reference,
        (optimizer, ref_optimizer),
        iterations=ITERATIONS,
        microbatches=MICROBATCHES,
        make_input=lambda: torch.randn(2, 32, device=rank_ctx.device),
        before_microbatch=lambda last: set_flags(
            plan, model, point["mode"], point["rab"], point.get("rso", False), last
        ),
        expected=expected,
        schedule=plan,
        # As upstream: odd iterations set gradients to None.
        set_to_none=lambda iteration: iteration % 2 == 1,
    )


def run_fsdp_accumulation(rank_ctx, impl, point: dict) -> None:
    hsdp = point["mesh"] == "hsdp"
    if hsdp:
        mesh = rank_ctx.mesh((2, rank_ctx.world_size // 2), ("dp_replicate", "dp_shard"))
    else:
        mesh = rank_ctx.mesh((rank_ctx.world_size,))

    plan = ShardingPlan(impl, mesh=mesh)

    def manage(module: nn.Module) -> None:
        plan.fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=point["raf"],
            offload_policy=offload_policy(impl, point["offload"]),
        )

    expected = expected_counts(point["raf"], point["mode"], point["rab"], point["rso"], hsdp)
    run_accumulation(rank_ctx, plan, manage, point, expected)


@conformance("fsdp.grad_accum.grid")
@pytest.mark.parametrize("point", accumulation_grid("1d"))
def test_gradient_accumulation(rank_ctx, impl, point):
    run_fsdp_accumulation(rank_ctx, impl, point)


@conformance("fsdp.grad_accum.grid_hsdp")
@pytest.mark.parametrize("point", accumulation_grid("hsdp"))
def test_gradient_accumulation_hsdp(rank_ctx, impl, point):
    run_fsdp_accumulation(rank_ctx, impl, point)


REPLICATE_GRID = [
    pytest.param(
        dict(mode=mode, rab=rab, offload=offload), id=f"mode={mode}-rab={rab}-offload={offload}"
    )
    for mode in MODES
    for rab in (False, True)
    for offload in OFFLOADS
    if rab or mode != "some_mlps"
]


@conformance("replicate.grad_accum.grid")
@pytest.mark.parametrize("point", REPLICATE_GRID)
def test_replicate_gradient_accumulation(rank_ctx, impl, point):
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("replicate",))
    plan = ShardingPlan(impl, mesh=mesh)

    def manage(module: nn.Module) -> None:
        plan.replicate(module, mesh=mesh, offload_policy=offload_policy(impl, point["offload"]))

    all_reduce = {"all": 4, "some_mlps": 4 + 2 * 2, "root_only": 4 + 3 * 2}[point["mode"]]
    run_accumulation(rank_ctx, plan, manage, point, Expected(all_reduce=all_reduce))
