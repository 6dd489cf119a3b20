"""Shared (tied) parameters, under fully_shard and replicate.

* parity: a weight-tied Transformer, blocks optionally checkpointed, 3 steps;
* uneven shard: a tied 17-row weight over 4 ranks (the last rank holds padding) trains
  every row, padded rows included;
* tied parameters in two groups raise ``ValueError`` ("already managed by another", naming
  the parameter) at the first forward;
* sharding layer by layer while building the model (with ``gc.collect()`` between, so
  ``id()``s of freed objects are reused) raises no false duplicate-parameter error and trains
  like the plain model.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance, grid
from distconform.suites.models import ModelArgs, TiedModel, Transformer
from distconform.suites.schedule import ShardingPlan
from distconform.suites.training import adamw, checkpoint_in_place, train_with_parity


def tied_transformer() -> Transformer:
    return Transformer(ModelArgs(n_layers=3, dropout_p=0.0, weight_tying=True))


def run_shared_parity(rank_ctx, impl, manage: str, ac: bool, **kwargs) -> None:
    plan = ShardingPlan(impl)

    def distribute(model: nn.Module) -> None:
        for layer in model.layers:
            if ac:
                checkpoint_in_place(layer)
            getattr(plan, manage)(layer, **kwargs)
        getattr(plan, manage)(model, **kwargs)

    with torch.device(rank_ctx.device):
        model = tied_transformer()
    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randint(0, 8, (2, 16), device=rank_ctx.device),
        # Recomputation in backward runs forwards the schedule oracle does not model.
        schedule=None if ac else plan,
    )


@conformance("fsdp.shared_params.parity")
@pytest.mark.parametrize("point", grid(raf=[False, True], ac=[False, True]))
def test_train_parity_with_shared_params(rank_ctx, impl, point):
    run_shared_parity(
        rank_ctx, impl, "fully_shard", point["ac"], reshard_after_forward=point["raf"]
    )


@conformance("replicate.shared_params.parity")
@pytest.mark.parametrize("point", grid(ac=[False, True]))
def test_replicate_train_parity_with_shared_params(rank_ctx, impl, point):
    run_shared_parity(rank_ctx, impl, "replicate", point["ac"])


@conformance("fsdp.shared_params.uneven_shard_every_row")
@pytest.mark.parametrize("point", grid(raf=[True, False]))
def test_train_shared_params_uneven_shard(rank_ctx, impl, point):
    raf = point["raf"]
    vocab = rank_ctx.world_size * 4 + 1  # 17 rows over 4 ranks: the last rank holds 2 of 5
    with torch.device(rank_ctx.device):
        model = TiedModel(vocab, 16)
    plan = ShardingPlan(impl)

    def distribute(m: nn.Module) -> None:
        plan.fully_shard([m.tok_embeddings, m.output], reshard_after_forward=raf)
        plan.fully_shard(m, reshard_after_forward=raf)

    def cross_entropy(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids).view(-1, vocab).float(), ids.view(-1))

    initial = model.tok_embeddings.weight.detach().clone()
    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randint(0, vocab, (2, 8), device=rank_ctx.device),
        schedule=plan,
        loss_fn=cross_entropy,
        make_optimizer=adamw,
        seed_offset=0,
    )
    model.tok_embeddings.unshard()
    final = model.tok_embeddings.weight.detach().clone()
    model.tok_embeddings.reshard()
    unchanged = [row for row in range(vocab) if torch.equal(final[row], initial[row])]
    assert not unchanged, f"rows {unchanged} of the tied weight did not train"


@conformance("fsdp.shared_params.separate_groups_error")
def test_shared_params_separate_fsdp_groups_error(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = TiedModel(17, 16)
    impl.fully_shard(model.tok_embeddings)
    impl.fully_shard(model.output)
    impl.fully_shard(model)
    with pytest.raises(ValueError, match="already managed by another") as info:
        model(torch.randint(0, 17, (2, 8), device=rank_ctx.device))
    # The parameter met a second time is the output's.
    assert "output" in str(info.value), str(info.value)


class SimpleBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class BlockStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@conformance("fsdp.shared_params.layer_by_layer")
def test_layer_by_layer_shard_no_false_positive(rank_ctx, impl):
    dim, n_blocks = 16, 8
    reference = BlockStack()
    for index in range(n_blocks):
        torch.manual_seed(index)
        with torch.device(rank_ctx.device):
            reference.blocks.append(SimpleBlock(dim))
    model = BlockStack()
    for index in range(n_blocks):
        torch.manual_seed(index)
        with torch.device(rank_ctx.device):
            block = SimpleBlock(dim)
        model.blocks.append(block)
        impl.fully_shard(block)
        gc.collect()
    impl.fully_shard(model)
    torch.manual_seed(42 + rank_ctx.rank)
    x = torch.randn(2, 4, dim, device=rank_ctx.device)
    losses = [m(x).sum() for m in (model, reference)]
    for loss in losses:
        loss.backward()
    assert_losses_equal(0, *losses)
    average_gradients(reference)
    assert_sharded_parity(reference, model)
