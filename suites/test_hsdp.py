"""HSDP training: shard within a replica group, all-reduce across replicas (§2.12).

Mesh ``(replicate, shard)`` = ``(ws // 2, 2)`` named ``("dp_replicate", "dp_shard")``. Every
child (the LayerNorm too), optionally checkpointed, is its own group, then the root. 5
iterations of 3 microbatches, optionally syncing gradients only on the last; losses per
microbatch, gradients and parameters per iteration, and the collectives: one reduce-scatter
and one all-reduce per group per synced backward, and (without checkpointing) each
microbatch's schedule: gathers and reduce-scatters within ``dp_shard``, all-reduces across
``dp_replicate``. ``offload=none`` is added to the upstream
grid so that HSDP is checked without CPU offload too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from harness.parity import assert_sharded_parity
from suites.cases import conformance, grid
from suites.models import MLP
from suites.schedule import ShardingPlan
from suites.training import Expected, accumulate_with_parity, adam, checkpoint_in_place

ITERATIONS, MICROBATCHES = 5, 3
GROUPS = 4  # the LayerNorm and three MLPs; the root owns no parameters


def expected_counts(raf: bool, sync_last: bool) -> Expected:
    synced = 1 if sync_last else MICROBATCHES
    gathers_per_microbatch = 2 * GROUPS if raf else GROUPS
    return Expected(
        all_gather=gathers_per_microbatch * MICROBATCHES,
        reduce_scatter=GROUPS * synced,
        all_reduce=GROUPS * synced,
    )


@conformance("fsdp.hsdp.parity")
@pytest.mark.parametrize(
    "point",
    grid(
        raf=[True, False],
        ac=[False, True],
        mlp_dim=[3, 16, 17],
        sync_last=[True, False],
        offload=["none", "cpu", "cpu_pinned"],
    ),
)
def test_train_parity_hsdp(rank_ctx, impl, point):
    ws = rank_ctx.world_size
    shard = 2 if ws > 2 else 1
    mesh = rank_ctx.mesh((ws // shard, shard), ("dp_replicate", "dp_shard"))
    dim, raf = point["mlp_dim"], point["raf"]
    offload = (
        None
        if point["offload"] == "none"
        else impl.CPUOffloadPolicy(pin_memory=point["offload"] == "cpu_pinned")
    )
    torch.manual_seed(42)
    model = nn.Sequential(
        nn.LayerNorm(dim, bias=False),
        MLP(dim, dim_multiplier=3),
        MLP(dim),
        MLP(dim, dim_multiplier=3),
    )
    reference = copy.deepcopy(model)
    plan = ShardingPlan(impl, mesh=mesh)
    for child in model:
        if point["ac"]:
            checkpoint_in_place(child)
        plan.fully_shard(child, mesh=mesh, reshard_after_forward=raf, offload_policy=offload)
    plan.fully_shard(model, mesh=mesh, reshard_after_forward=raf, offload_policy=offload)
    for p in model.parameters():
        assert p.placements == (Replicate(), Shard(0)), f"HSDP placements {p.placements}"
    optimizer, ref_optimizer = adam(model.parameters()), adam(reference.parameters())
    assert_sharded_parity(reference, model, check_grads=False)
    expected = expected_counts(raf, point["sync_last"])

    def before_microbatch(last: bool) -> None:
        if point["sync_last"]:
            plan.controls(model).set_requires_gradient_sync(last)

    torch.manual_seed(42 + rank_ctx.rank + 1)
    accumulate_with_parity(
        model,
        reference,
        (optimizer, ref_optimizer),
        iterations=ITERATIONS,
        microbatches=MICROBATCHES,
        make_input=lambda: torch.randn(8, dim),
        before_microbatch=before_microbatch,
        expected=expected,
        set_to_none=lambda iteration: iteration % 2 == 0,  # as suites.training.zero_grad
        # Recomputation in backward runs forwards the schedule oracle does not model.
        schedule=None if point["ac"] else plan,
    )
