"""Structural patterns on top of the core (cases.md §5.1 items 5 and 6), checked for parity.

A module called twice in one forward, two forwards before one backward, a partial group
forward followed by standalone chunks, the head of a partial group kept unsharded across
chunks (gathered once), a forward method other than ``forward`` with ``replicate``, a weight
tied across groups (the error names the modules). Prefetching and async unshard:
``test_prefetch.py``.

What a conformance suite already checks in the default run is not repeated here: non-root
standalone steps (``suites/test_non_root.py::test_non_root_forward_backward[ws2]``),
``register_fsdp_forward_method`` with ``fully_shard``
(``suites/test_forward_method.py::test_register_fsdp_forward_method[ws2]``), and in
``suites/test_partial_forward.py``: ``::test_reset_iter_state_after_exception[ws2]``,
``::test_double_partial_forward_then_backward[ws2]``,
``::test_partial_group_forward_grad_accum_chunked[ws2-raf=True]``; the ``raf=True`` items of
the two parametrized tests below name theirs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.comm import CommTracer
from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import ModelArgs, TiedModel, Transformer


def adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=1e-2)


class MultiForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


# raf=True: suites/test_multi_forward.py::test_multi_forward_module[ws2-raf=True].
@pytest.mark.world_size(2)
@pytest.mark.parametrize("raf", [False], ids=lambda v: f"raf={v}")
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


# raf=True: suites/test_partial_forward.py::test_partial_group_forward_then_standalone
# [ws2-raf=True-tie=False-mp=none-ac=False].
@pytest.mark.world_size(2)
@pytest.mark.parametrize("raf", [False], ids=lambda v: f"raf={v}")
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


# --- more of cases.md §2.5, §2.8 and §2.13 -------------------------------------------------------


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "initial_reshard", [pytest.param(False, marks=pytest.mark.slow), True], ids=lambda v: f"raf={v}"
)
def test_partial_group_reshard_toggle(rank_ctx, impl, initial_reshard):
    """cases.md §2.5: the head of a [norm, head] group is kept unsharded across chunked
    standalone calls (both reshard flags off, no recurse), then resharded by hand."""
    torch.manual_seed(42)
    model = ChunkedHead()
    impl.fully_shard(model.embed)
    impl.fully_shard(model.body)
    impl.fully_shard([model.norm, model.head], reshard_after_forward=initial_reshard)
    impl.fully_shard(model)
    optimizer = adam(model)
    tokens = torch.randint(0, 128, (2, 16))
    for step in range(3):
        h = model(tokens, skip_head=True)
        model.head.set_reshard_after_forward(False, recurse=False)
        model.head.set_reshard_after_backward(False, recurse=False)
        chunk_grads = []
        with CommTracer(functional=False) as trace:
            for chunk in h.detach().chunk(4, dim=1):
                chunk = chunk.contiguous().requires_grad_(True)
                model.head(chunk).sum().backward()
                chunk_grads.append(chunk.grad)
                assert impl.is_group_unsharded(model.head), f"step {step}"
        # Gathered in forward at most once for the four chunks: it stays unsharded between them.
        # (Backward may prefetch another group: the implicit guess from forward order.)
        assert trace.count("all_gather", phase="forward") <= 1, trace.schedule()
        model.head.set_reshard_after_forward(True, recurse=False)
        model.head.set_reshard_after_backward(True, recurse=False)
        model.head.reshard()
        assert not impl.is_group_unsharded(model.head)
        h.backward(torch.cat(chunk_grads, dim=1))
        assert all(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)


@pytest.mark.world_size(2)
def test_tied_weight_across_groups_error_names_the_modules(rank_ctx, impl):
    model = TiedModel()
    impl.fully_shard(model.tok_embeddings)
    impl.fully_shard(model.output)
    impl.fully_shard(model)
    with pytest.raises(ValueError, match="already managed by another") as info:
        model(torch.randint(0, 17, (2, 8)))
    message = str(info.value)
    assert "output" in message, message  # the parameter found a second time
    if impl.name == "reference":
        # Stricter than torch (whose message names only the parameter): both groups' modules.
        assert "tok_embeddings" in message and "output (" in message, message


@pytest.mark.world_size(2)
def test_registered_forward_method_replicate(rank_ctx, impl):
    """cases.md §3.8: the same with ``replicate``."""
    if not impl.supports("replicate"):
        pytest.skip(f"UNSUPPORTED: {impl.name} does not declare replicate")
    model = Encoded()
    reference = copy.deepcopy(model)
    impl.replicate(model.encoder)
    impl.replicate(model.projector)
    impl.replicate(model)
    impl.register_fsdp_forward_method(model.encoder, "forward_features")
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(2, 3, 32, 32)
    losses = [m(inp).sum() for m in (model, reference)]
    assert_losses_equal(0, *losses)
    for loss in losses:
        loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
