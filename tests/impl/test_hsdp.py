"""HSDP: ``fully_shard`` on a 2-D mesh ``(dp_replicate, dp_shard)`` (cases.md §2.12, §5.1 1, 4).

Parameters are ``(Replicate(), Shard(d))`` DTensors on the 2-D mesh. Per forward+backward each
group all-gathers within ``dp_shard`` (once more in backward if resharded), reduce-scatters
within ``dp_shard`` and then all-reduces across ``dp_replicate``: one all-reduce per
reduce-scatter. Gradients are the mean over all ranks, so the plain reference averages over
the whole world. ``set_requires_all_reduce(False)`` keeps the reduce-scatters and skips the
all-reduces; the sharded gradient appears only at the next all-reduce and then holds the sum
of every microbatch's mean.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from harness.comm import CommTracer
from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import MLP
from tests.impl.comm_count import count_collectives
from tests.impl.test_training_parity import Expected, adam, train_with_parity

slow = pytest.mark.slow
HSDP_NAMES = ("dp_replicate", "dp_shard")


def hsdp_model(dim: int) -> nn.Sequential:
    """cases.md §2.12's model: a LayerNorm and three MLPs, every child its own group."""
    return nn.Sequential(
        nn.LayerNorm(dim, bias=False),
        MLP(dim, dim_multiplier=3),
        MLP(dim),
        MLP(dim, dim_multiplier=3),
    )


def shard_children_and_root(impl, mesh, raf: bool, **kwargs):
    def distribute(model: nn.Module) -> None:
        for child in model:
            impl.fully_shard(child, mesh=mesh, reshard_after_forward=raf, **kwargs)
        impl.fully_shard(model, mesh=mesh, reshard_after_forward=raf, **kwargs)

    return distribute


def hsdp_expected(groups: int, resharded: int) -> Expected:
    return Expected(all_gather=groups + resharded, reduce_scatter=groups, all_reduce=groups)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "raf, mlp_dim",
    [
        (True, 17),
        pytest.param(False, 17, marks=slow),
        pytest.param(True, 3, marks=slow),
        pytest.param(False, 16, marks=slow),
    ],
    ids=lambda v: str(v),
)
def test_hsdp_training_parity(rank_ctx, impl, raf, mlp_dim):
    mesh = rank_ctx.mesh((2, 2), HSDP_NAMES)
    # The root owns no parameters: 4 groups, each all-reduces once per backward.
    resharded = 4 if raf else 0
    train_with_parity(
        rank_ctx.rank,
        hsdp_model(mlp_dim),
        shard_children_and_root(impl, mesh, raf),
        lambda: torch.randn(8, mlp_dim),
        hsdp_expected(groups=4, resharded=resharded),
    )


@pytest.mark.world_size(2)
def test_hsdp_shard_dim_of_one_rank(rank_ctx, impl):
    """A (2, 1) mesh: nothing to all-gather or reduce-scatter, only the all-reduce remains."""
    mesh = rank_ctx.mesh((2, 1), HSDP_NAMES)
    model = hsdp_model(5)
    reference = copy.deepcopy(model)
    shard_children_and_root(impl, mesh, True)(model)
    inp = torch.randn(4, 5)
    with CommTracer(mesh=mesh, functional=False) as trace:
        model(inp).sum().backward()
    reference(inp).sum().backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
    assert trace.count("all_reduce", group="dp_replicate") == 4
    assert trace.count("reduce_scatter") == 0
    # Whether a 1-rank shard group "all-gathers" is an implementation detail (it moves no
    # data); gathering across replicas never is.
    assert trace.count("all_gather", group="dp_replicate") == 0


@pytest.mark.world_size(4)
def test_hsdp_placements_and_comm_groups(rank_ctx, impl):
    mesh = rank_ctx.mesh((2, 2), HSDP_NAMES)
    model = hsdp_model(6)
    reference = copy.deepcopy(model)
    shard_children_and_root(impl, mesh, True)(model)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.device_mesh.ndim == 2, name
        assert param.placements == (Replicate(), Shard(0)), (name, param.placements)
        assert param.device_mesh.mesh_dim_names == HSDP_NAMES
    inp = torch.randn(8, 6)
    with CommTracer(mesh=mesh, functional=False) as trace:
        model(inp).sum().backward()
    # Every group: gathers and reduce-scatters within dp_shard, all-reduces across
    # dp_replicate, one all-reduce after each reduce-scatter.
    assert trace.count("all_gather", group="dp_shard") == 8
    assert trace.count("reduce_scatter", group="dp_shard") == 4
    assert trace.count("all_reduce", group="dp_replicate") == 4
    assert trace.count("all_gather", group="dp_replicate") == 0
    assert trace.count("reduce_scatter", group="dp_replicate") == 0
    assert trace.count("all_reduce", group="dp_shard") == 0
    reductions = [c.kind for c in trace.calls if c.kind in ("reduce_scatter", "all_reduce")]
    assert reductions == ["reduce_scatter", "all_reduce"] * 4, reductions
    reference(inp).sum().backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)


@pytest.mark.world_size(4)
def test_hsdp_shard_placement_fn(rank_ctx, impl):
    """A placement per parameter on HSDP: the largest dim of each weight, dim 0 for biases."""
    mesh = rank_ctx.mesh((2, 2), HSDP_NAMES)

    def largest_dim(param: nn.Parameter) -> Shard:
        return Shard(param.shape.index(max(param.shape)))

    def distribute(model: nn.Module) -> None:
        impl.fully_shard(model, mesh=mesh, shard_placement_fn=largest_dim)
        # Weights are (out, in): (32, 16) shards dim 0, (8, 32) shards dim 1.
        assert model[0].weight.placements == (Replicate(), Shard(0)), model[0].weight.placements
        assert model[2].weight.placements == (Replicate(), Shard(1)), model[2].weight.placements
        assert model[2].bias.placements == (Replicate(), Shard(0)), model[2].bias.placements

    train_with_parity(
        rank_ctx.rank,
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)),
        distribute,
        lambda: torch.randn(4, 16),
        hsdp_expected(groups=1, resharded=0),
    )


MICROBATCHES = 3


@pytest.mark.world_size(4)
@pytest.mark.parametrize("raf", [True, pytest.param(False, marks=slow)], ids=lambda v: f"raf={v}")
def test_hsdp_requires_all_reduce_false_accumulates_partial_sums(rank_ctx, impl, raf):
    mesh = rank_ctx.mesh((2, 2), HSDP_NAMES)
    model = hsdp_model(9)
    reference = copy.deepcopy(model)
    shard_children_and_root(impl, mesh, raf)(model)
    optimizer = adam(model.parameters())
    reference_optimizer = adam(reference.parameters())
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for iteration in range(2):
        for microbatch in range(MICROBATCHES):
            last = microbatch == MICROBATCHES - 1
            model.set_requires_all_reduce(last)
            inp = torch.randn(4, 9)
            with count_collectives() as counts:
                loss = model(inp).sum()
                loss.backward()
            reference_loss = reference(inp).sum()
            reference_loss.backward()
            assert_losses_equal(microbatch, loss, reference_loss)
            assert counts["reduce_scatter_single"] == 4, (microbatch, dict(counts))
            assert counts["all_reduce"] == (4 if last else 0), (microbatch, dict(counts))
            if not last:
                # Gradients wait for the all-reduce (optimizer zeroed them with set_to_none).
                assert all(p.grad is None for p in model.parameters()), (iteration, microbatch)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_optimizer.zero_grad(set_to_none=True)
    assert_sharded_parity(reference, model, check_grads=False)
