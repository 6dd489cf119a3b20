"""Structural patterns on top of the core (cases.md §5.1 items 5 and 6), checked for parity.

Non-root standalone forward/backward, a module called twice in one forward, two forwards
before one backward, a partial group forward followed by standalone chunks, recovery after an
exception, a forward method other than ``forward``, explicit prefetching and async unshard.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import MLP, ModelArgs, Transformer, TransformerBlock


def adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=1e-2)


@pytest.mark.world_size(2)
def test_non_root_forward_backward(rank_ctx, impl):
    model = nn.Sequential(MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model:
        impl.fully_shard(mlp)
    impl.fully_shard(model)
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42 + rank_ctx.rank)
    inp = torch.randn(8, 32)

    for m in (model, reference):
        loss = m(inp).sum()
        loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
    optimizer.step()
    reference_optimizer.step()
    optimizer.zero_grad()
    reference_optimizer.zero_grad()

    # The first MLP alone, as if it were a root.
    losses = [m[0](inp).sum() for m in (model, reference)]
    for loss in losses:
        loss.backward()
    assert_losses_equal(1, *losses)
    average_gradients(reference)
    assert_sharded_parity(reference, model)
    assert all(p.grad is None for p in model[1:].parameters())
    optimizer.step()
    reference_optimizer.step()
    assert_losses_equal(2, model(inp).sum(), reference(inp).sum())


class MultiForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("raf", [True, False], ids=lambda v: f"raf={v}")
def test_module_called_twice_in_one_forward(rank_ctx, impl, raf):
    model = MultiForward()
    reference = copy.deepcopy(model)
    impl.fully_shard(model.inner, reshard_after_forward=raf)
    impl.fully_shard(model)
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(5):
        inp = torch.randn(32, 4)
        losses = [m(inp).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("raf", [True, False], ids=lambda v: f"raf={v}")
def test_two_forwards_before_backward(rank_ctx, impl, raf):
    model = Transformer(ModelArgs(n_layers=2, dropout_p=0.0))
    reference = copy.deepcopy(model)
    for layer in model.layers:
        impl.fully_shard(layer.attention, reshard_after_forward=raf)
        impl.fully_shard(layer.feed_forward, reshard_after_forward=raf)
        impl.fully_shard(layer, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    torch.manual_seed(42 + rank_ctx.rank)
    inp1, inp2 = torch.randint(0, 8, (2, 16)), torch.randint(0, 8, (2, 16))
    for m in (model, reference):
        ((m(inp1).sum() - m(inp2).sum()) ** 2).backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)


class ChunkedHead(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def chunked_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Forward without the head, run the head per chunk with its own backward, then finish."""
    h = model(tokens, skip_head=True)
    total = torch.zeros(())
    chunk_grads = []
    for chunk in h.detach().chunk(4, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        out = model.head(chunk)
        total += out.detach().sum()
        out.sum().backward()
        chunk_grads.append(chunk.grad)
    h.backward(torch.cat(chunk_grads, dim=1))
    return total


@pytest.mark.world_size(2)
@pytest.mark.parametrize("raf", [True, False], ids=lambda v: f"raf={v}")
def test_partial_group_forward_then_standalone_chunks(rank_ctx, impl, raf):
    model = ChunkedHead()
    reference = copy.deepcopy(model)
    impl.fully_shard(model.embed, reshard_after_forward=raf)
    impl.fully_shard(model.body, reshard_after_forward=raf)
    impl.fully_shard([model.norm, model.head], reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42)
    tokens = torch.randint(0, 128, (2, 16))
    for step in range(5):
        assert_losses_equal(step, chunked_step(model, tokens), chunked_step(reference, tokens))
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)


class Raiser(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return self.inner(x)


@pytest.mark.world_size(2)
def test_reset_iter_state_after_an_exception(rank_ctx, impl):
    model = ChunkedHead()
    model.body = Raiser(model.body)
    impl.fully_shard([model.norm, model.head])
    impl.fully_shard(model)
    tokens = torch.randint(0, 128, (2, 16))
    model.body.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        model(tokens, skip_head=True)
    model.body.armed = False
    model.reset_iter_state()
    model(tokens).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class PatchEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 64, kernel_size=8, stride=8)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class Encoded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = PatchEncoder()
        self.projector = nn.Linear(64, 16)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder.forward_features(imgs))


@pytest.mark.world_size(2)
def test_registered_forward_method(rank_ctx, impl):
    model = Encoded()
    reference = copy.deepcopy(model)
    impl.fully_shard(model.encoder)
    impl.fully_shard(model.projector)
    impl.fully_shard(model)
    impl.register_fsdp_forward_method(model.encoder, "forward_features")
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(2, 3, 32, 32)
    losses = [m(inp).sum() for m in (model, reference)]
    assert_losses_equal(0, *losses)
    for loss in losses:
        loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("explicit", ["prefetch", "async_unshard"])
def test_prefetch_and_async_unshard_keep_numerics(rank_ctx, impl, explicit):
    model = Transformer(ModelArgs(n_layers=4, dropout_p=0.0))
    reference = copy.deepcopy(model)
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    layers = list(model.layers)
    if explicit == "prefetch":
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
            layer.set_modules_to_backward_prefetch(layers[max(i - 2, 0) : i][::-1])
    else:
        impl.set_unshard_async_op(model, True)
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(5):
        if explicit == "async_unshard":
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    module.unshard(async_op=True)  # handles dropped: forward waits
        inp = torch.randint(0, 8, (2, 8))
        losses = [m(inp).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    assert_sharded_parity(reference, model, check_grads=False)
