"""Activation checkpointing composed with sharding (cases.md §2.5 and §3.5, §2.8 with AC).

Three kinds of checkpointing, each recomputing a ``TransformerBlock`` in backward:

* ``utils``: ``torch.utils.checkpoint.checkpoint(layer, h)`` inside ``Transformer.forward``: the
  recomputation calls the layer, so the implementation's forward hooks run again *inside*
  backward;
* ``wrapper``: torch's ``apply_activation_checkpointing`` (a ``CheckpointWrapper`` around each
  block, reached through ``impl/_torch_private.py``): the same, and parameter names gain the
  wrapper's prefix;
* ``in_place``: the block's own ``forward`` is replaced, on the instance, by a checkpointed call
  of the class's forward (``torch.utils.checkpoint`` again). This stands in for upstream's
  "composable" ``checkpoint(block)``, which lives in a private torch module: like it, the
  module tree and names do not change and the hooks of the block itself are not re-run by the
  recomputation (nested sharded modules' hooks are).

Groupings (§2.5): ``block`` (each layer), ``mem_eff`` (layers.0; [layers.1, layers.2];
[tok, pos embeddings] with ``set_unshard_in_backward(False)``; [norm, output]) and
``mem_eff_weight_tied`` ([tok_embeddings, output] tied; each layer); then the root.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from impl import _torch_private
from suites.models import ModelArgs, Transformer, TransformerBlock

KINDS = ("utils", "wrapper", "in_place")
GROUPINGS = ("block", "mem_eff", "mem_eff_weight_tied")
STEPS = 4


def checkpoint_in_place(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward without wrapping it (public API only)."""
    forward = type(module).forward

    def checkpointed(self: nn.Module, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            forward, self, *args, use_reentrant=False, **kwargs
        )

    module.forward = types.MethodType(checkpointed, module)


def build(kind: str, weight_tying: bool, n_layers: int = 3) -> tuple[nn.Module, nn.Module, str]:
    """The model with checkpointing applied, a plain copy without any (the reference), and the
    prefix to strip from the model's names."""
    torch.manual_seed(42)
    model = Transformer(
        ModelArgs(
            n_layers=n_layers,
            n_heads=4,
            vocab_size=64,
            max_seq_len=32,
            dropout_p=0.0,
            weight_tying=weight_tying,
            checkpoint_activations=kind == "utils",
        )
    )
    reference = copy.deepcopy(model)
    reference.checkpoint_activations = False
    prefix = ""
    if kind == "wrapper":
        _wrapper, apply_activation_checkpointing, prefix = _torch_private.checkpoint_wrapper_api()
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif kind == "in_place":
        for layer in model.layers:
            checkpoint_in_place(layer)
    return model, reference, prefix


def shard(impl, model: nn.Module, grouping: str, raf: bool) -> None:
    layers = list(model.layers)
    if grouping == "block":
        for layer in layers:
            impl.fully_shard(layer, reshard_after_forward=raf)
    elif grouping == "mem_eff":
        impl.fully_shard(layers[0], reshard_after_forward=raf)
        impl.fully_shard(layers[1:3], reshard_after_forward=raf)
        impl.fully_shard([model.tok_embeddings, model.pos_embeddings], reshard_after_forward=raf)
        model.tok_embeddings.set_unshard_in_backward(False)
        impl.fully_shard([model.norm, model.output], reshard_after_forward=raf)
    else:
        impl.fully_shard([model.tok_embeddings, model.output], reshard_after_forward=raf)
        for layer in layers:
            impl.fully_shard(layer, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)


def params(kind: str, grouping: str, raf: bool):
    # One of each kind and each grouping in the default run; the other 15 are slow.
    default = {("utils", "block", True), ("wrapper", "mem_eff", False)}
    default.add(("in_place", "mem_eff_weight_tied", True))
    marks = () if (kind, grouping, raf) in default else pytest.mark.slow
    return pytest.param(kind, grouping, raf, id=f"{kind}-{grouping}-raf={raf}", marks=marks)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("kind", "grouping", "raf"),
    [params(k, g, r) for r in (True, False) for k in KINDS for g in GROUPINGS],
)
def test_train_parity_with_activation_checkpointing(rank_ctx, impl, kind, grouping, raf):
    model, reference, prefix = build(kind, weight_tying=grouping != "mem_eff")
    shard(impl, model, grouping, raf)
    ignore = (prefix,) if prefix else ()
    assert_sharded_parity(reference, model, check_grads=False, prefixes_to_ignore=ignore)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank_ctx.rank)
    inp = torch.randint(0, 64, (3, 32))
    for step in range(STEPS):
        losses = []
        for m in (model, reference):
            torch.manual_seed(step + 1)
            losses.append(m(inp).sum())
            losses[-1].backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        assert_sharded_parity(reference, model, prefixes_to_ignore=ignore)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        assert_sharded_parity(reference, model, check_grads=False, prefixes_to_ignore=ignore)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    ("kind", "raf"),
    [
        pytest.param("utils", True, id="utils-raf=True"),
        pytest.param("utils", False, id="utils-raf=False", marks=pytest.mark.slow),
        pytest.param("in_place", True, id="in_place-raf=True", marks=pytest.mark.slow),
        pytest.param("in_place", False, id="in_place-raf=False", marks=pytest.mark.slow),
    ],
)
def test_double_forward_with_nested_groups_and_checkpointing(rank_ctx, impl, kind, raf):
    """cases.md §2.5: two forwards, one backward, with attention and feed-forward sharded
    inside each (checkpointed) block; every parameter gets the reference's gradient."""
    model, reference, _ = build(kind, weight_tying=True, n_layers=2)
    for layer in model.layers:
        impl.fully_shard(layer.attention, reshard_after_forward=raf)
        impl.fully_shard(layer.feed_forward, reshard_after_forward=raf)
        impl.fully_shard(layer, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    torch.manual_seed(42 + rank_ctx.rank)
    inp1, inp2 = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))
    for m in (model, reference):
        ((m(inp1).sum() - m(inp2).sum()) ** 2).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    average_gradients(reference)
    # Squared difference of sums of ~3000 logits: values near 1e5, so fp32 rounding of the
    # two paths' summation orders shows at a few 1e-5 relative.
    assert_sharded_parity(reference, model, rtol=1e-4, atol=1e-3)


@pytest.mark.world_size(2, 4, slow=(4,))
def test_shared_params_parity(rank_ctx, impl):
    run_shared_params_parity(rank_ctx.rank, impl, checkpointed=False)


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_shared_params_parity_with_checkpointing(rank_ctx, impl):
    run_shared_params_parity(rank_ctx.rank, impl, checkpointed=True)


def run_shared_params_parity(rank: int, impl, checkpointed: bool) -> None:
    """cases.md §2.8: a weight-tied Transformer, each block (optionally checkpointed) its own
    group, the tied embedding/output in the root's group; 10 steps of fresh inputs."""
    torch.manual_seed(42)
    model = Transformer(ModelArgs(n_layers=3, dropout_p=0.0, weight_tying=True))
    if checkpointed:
        for layer in model.layers:
            checkpoint_in_place(layer)
    reference = copy.deepcopy(model)
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank + 1)
    for step in range(10):
        inp = torch.randint(0, 8, (2, 16))
        losses = [m(inp).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    assert_sharded_parity(reference, model, check_grads=False)
