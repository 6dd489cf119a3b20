"""Prefetching and explicit unsharding (cases.md §2.4 explicit prefetching and post-optim event,
§2.5 ``set_unshard_in_backward``, §5.1 items 5 and 6).

* Implicit backward prefetch: with no prefetch lists, entering a group's backward starts the
  all-gather of the group that finished forward just before it (one module ahead). The
  order is asserted on a trace whose marks are the layers' backward pre-hooks.
* Explicit lists (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``): numerics
  and collective counts are ``suites/test_prefetch.py`` (default run), their order
  ``tests/comm/test_prefetch_schedule.py``.
* ``unshard(async_op=True)``: one all-gather, the handle's ``wait()`` leaves the group
  unsharded, and the next forward does not gather it again.
* ``set_unshard_in_backward(False)``: that group is never all-gathered in backward and still
  gets the right gradients.
* ``set_post_optim_event``: accepted; on CPU there are no events (``record_event()`` gives
  ``None``), so it is a documented no-op there, and training must not change.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.comm import CommTracer, assert_schedule
from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import ModelArgs, Transformer

N_LAYERS = 4


def adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=1e-2)


def require(impl, *capabilities: str) -> None:
    missing = [c for c in capabilities if not impl.supports(c)]
    if missing:
        pytest.skip(f"UNSUPPORTED: {impl.name} does not declare {', '.join(missing)}")


def sharded_transformer(impl, n_layers: int = N_LAYERS) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(42)
    model = Transformer(ModelArgs(n_layers=n_layers, dropout_p=0.0))
    reference = copy.deepcopy(model)
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    return model, reference


def mark_layers(trace: CommTracer, layers: list[nn.Module]) -> None:
    for i, layer in enumerate(layers):
        # Prepended: each mark precedes the implementation's own hooks of that layer.
        layer.register_forward_pre_hook(
            lambda *a, i=i: trace.mark(f"forward layers.{i}"), prepend=True
        )
        layer.register_full_backward_pre_hook(
            lambda *a, i=i: trace.mark(f"backward layers.{i}"), prepend=True
        )


@pytest.mark.world_size(2)
def test_implicit_backward_prefetch_is_one_module_ahead(rank_ctx, impl):
    require(impl, "prefetch")
    model, _ = sharded_transformer(impl)
    trace = CommTracer(functional=False)
    mark_layers(trace, list(model.layers))
    with trace:
        model(torch.randint(0, 8, (2, 8))).sum().backward()
    # The root keeps its parameters (reshard_after_forward defaults to False for it), so its
    # pre-backward gathers nothing itself but prefetches layers.3, the last group to finish
    # forward before it; each layer's pre-backward then prefetches the one before it, and
    # layers.0 has nothing left to prefetch. Without implicit prefetching every backward
    # all-gather would come after its own layer's mark.
    assert_schedule(
        trace,
        """\
forward  all_gather     world f32[208]
== forward layers.0
forward  all_gather     world f32[1608]
== forward layers.1
forward  all_gather     world f32[1608]
== forward layers.2
forward  all_gather     world f32[1608]
== forward layers.3
forward  all_gather     world f32[1608]
backward all_gather     world f32[1608]
== backward layers.3
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.2
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.1
backward all_gather     world f32[1608]
backward reduce_scatter world f32[3216]
== backward layers.0
backward reduce_scatter world f32[3216]
backward reduce_scatter world f32[416]
""",
    )


@pytest.mark.world_size(2)
def test_async_unshard_handle(rank_ctx, impl):
    require(impl, "async_unshard")
    model, reference = sharded_transformer(impl, n_layers=2)
    layer = model.layers[0]
    with CommTracer(functional=False) as trace:
        handle = layer.unshard(async_op=True)
        assert handle is not None
        handle.wait()
    assert trace.count("all_gather") == 1 and len(trace.calls) == 1, trace.schedule()
    assert impl.is_group_unsharded(layer)
    assert not impl.is_group_unsharded(model.layers[1])
    inp = torch.randint(0, 8, (2, 8))
    with CommTracer(functional=False) as trace:
        loss = model(inp).sum()
    # The root and layers.1 only: layers.0 is already unsharded.
    assert trace.count("all_gather") == 2, trace.schedule()
    loss.backward()
    reference_loss = reference(inp).sum()
    reference_loss.backward()
    assert_losses_equal(0, loss, reference_loss)
    average_gradients(reference)
    assert_sharded_parity(reference, model)


@pytest.mark.slow
@pytest.mark.world_size(2, 4)
def test_async_unshard_every_step_keeps_numerics(rank_ctx, impl):
    require(impl, "async_unshard")
    model, reference = sharded_transformer(impl)
    impl.set_unshard_async_op(model, True)
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(4):
        for layer in model.layers:
            layer.unshard(async_op=True)  # handles dropped: forward waits for them
        inp = torch.randint(0, 8, (2, 8))
        losses = [m(inp).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()


@pytest.mark.world_size(2, 4, slow=(4,))
def test_unshard_in_backward_false_skips_the_gather(rank_ctx, impl):
    run_unshard_in_backward_false(rank_ctx, impl)


def run_unshard_in_backward_false(rank_ctx, impl) -> None:
    torch.manual_seed(42)
    model = Transformer(ModelArgs(n_layers=2, dropout_p=0.0, weight_tying=False))
    reference = copy.deepcopy(model)
    # cases.md §2.5's "mem_eff" grouping: embeddings' backward never reads their weights.
    impl.fully_shard([model.tok_embeddings, model.pos_embeddings])
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard([model.norm, model.output])
    impl.fully_shard(model)
    model.tok_embeddings.set_unshard_in_backward(False)
    embeddings_numel = sum(
        p.numel()
        for m in (reference.tok_embeddings, reference.pos_embeddings)
        for p in m.parameters()
    )
    optimizer, reference_optimizer = adam(model), adam(reference)
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(3):
        inp = torch.randint(0, 8, (2, 8))
        with CommTracer(functional=False) as trace:
            loss = model(inp).sum()
            loss.backward()
        gathered = [c.out_numel for c in trace.select("all_gather", phase="backward")]
        # Layers and [norm, output] reshard after forward and gather again; embeddings not.
        assert len(gathered) == len(model.layers) + 1, trace.schedule()
        assert embeddings_numel not in gathered, trace.schedule()
        reference_loss = reference(inp).sum()
        reference_loss.backward()
        assert_losses_equal(step, loss, reference_loss)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()


@pytest.mark.world_size(2)
def test_post_optim_event_is_accepted(rank_ctx, impl):
    model, reference = sharded_transformer(impl, n_layers=2)
    optimizer, reference_optimizer = adam(model), adam(reference)
    events = []

    def record_post_optim_event(*_args) -> None:
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None
        # On CPU there is no event to record (cases.md §6.1: record_event() gives None).
        event = stream.record_event() if stream is not None else None
        events.append(event)
        model.set_post_optim_event(event)

    optimizer.register_step_post_hook(record_post_optim_event)
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(4):
        inp = torch.randint(0, 8, (2, 8))
        losses = [m(inp).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert_losses_equal(step, *losses)
        average_gradients(reference)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    assert len(events) == 4
    assert_sharded_parity(reference, model, check_grads=False)
