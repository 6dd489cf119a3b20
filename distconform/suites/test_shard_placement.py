"""``shard_placement_fn``: sharding on a dim other than 0."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import Shard

from distconform.suites.cases import conformance
from distconform.suites.models import MLP, ModelArgs, Transformer
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import adamw, full_tensors, train_with_parity


def shard_largest_dim(param: nn.Parameter) -> Shard:
    return Shard(param.shape.index(max(param.shape)))


@conformance("fsdp.shard_placement.largest_dim")
def test_train_parity_shard_placement_fn_shard_largest_dim(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(n_layers=3, dropout_p=0.0))
    plan = ShardingPlan(impl)

    def distribute(m: nn.Module) -> None:
        for layer in m.layers:
            plan.fully_shard(layer, shard_placement_fn=shard_largest_dim)
        plan.fully_shard(m, shard_placement_fn=shard_largest_dim)
        placements = {p.placements for p in m.parameters()}
        assert placements == {(Shard(0),), (Shard(1),)}, f"placements {placements}"
        for p in m.parameters():
            assert p.placements == (shard_largest_dim(p),), f"{tuple(p.shape)}: {p.placements}"

    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randint(0, 8, (2, 16), device=rank_ctx.device),
        schedule=plan,
        steps=5,
        make_optimizer=adamw,
        seed_offset=0,
    )


def shard_dim1_for_matrices(param: nn.Parameter) -> Shard:
    return Shard(1) if param.ndim > 1 else Shard(0)


@conformance("fsdp.shard_placement.contiguous")
def test_shard_placement_fn_contiguous_params_grads(rank_ctx, impl):
    model = MLP(4, rank_ctx.device)
    reference = copy.deepcopy(model)
    for module in (model.in_proj, model.out_proj, model):
        impl.fully_shard(module, shard_placement_fn=shard_dim1_for_matrices)
    checked: list[str] = []

    def assert_unsharded_contiguous(module: nn.Module, args: object) -> None:
        for name, p in module.named_parameters():
            assert p.is_contiguous(), f"unsharded {name} {tuple(p.shape)} is not contiguous"
            checked.append(name)

    model.in_proj.register_forward_pre_hook(assert_unsharded_contiguous)
    model.out_proj.register_forward_pre_hook(assert_unsharded_contiguous)
    for p in model.parameters():
        assert p.placements == ((Shard(1),) if p.ndim > 1 else (Shard(0),))
        assert p.is_contiguous() and p.to_local().is_contiguous()
    for full, ref in zip(full_tensors(model), reference.parameters(), strict=True):
        torch.testing.assert_close(full, ref.detach(), rtol=0, atol=0)
    model(torch.randn(2, 4, device=rank_ctx.device)).sum().backward()
    assert len(checked) == 4, f"the pre-forward hooks saw {checked}"
    for p in model.parameters():
        assert p.is_contiguous() and p.to_local().is_contiguous()
        assert p.grad.is_contiguous() and p.grad.to_local().is_contiguous()
