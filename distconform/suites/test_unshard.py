"""Explicit unsharding: ``unshard(async_op=True)``, ``set_unshard_in_backward``.

* ``unshard(async_op=True)`` returns a handle *before* its all-gather has completed: one rank
  joins the all-gather only after every other rank's call has returned (they meet on a
  group of their own first), so an implementation that waits inside the call never returns
  and the meeting times out with a message saying so. ``wait()`` then leaves the group
  unsharded, and the next forward does not gather it again (the schedule oracle knows the
  group is held).
* ``set_unshard_async_op(True)`` every step: same numerics, same schedule (slow).
* ``set_unshard_in_backward(False)``: that group is never all-gathered in backward, not even
  as a prefetch target, and still gets the right gradients; set back to ``True`` for one
  step, it is gathered in backward again.
* ``reshard()`` frees the unsharded parameters; ``set_keep_unsharded_storage(True)``: reshard
  keeps the unsharded storage, and the next unshard fills the same memory.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance
from distconform.suites.models import ModelArgs, Transformer
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan
from distconform.suites.training import adam, sharded_mlp_stack, train_with_parity

N_LAYERS = 4
#: How long the held-back rank waits for the others' unshard calls to return.
MEETING_TIMEOUT = timedelta(seconds=10)


def sharded_transformer(
    plan: ShardingPlan, device: torch.device, n_layers: int = N_LAYERS
) -> tuple[nn.Module, nn.Module]:
    """The sharded model and a plain copy taken before sharding, both on ``device``."""
    torch.manual_seed(42)
    with torch.device(device):
        model = Transformer(ModelArgs(n_layers=n_layers, dropout_p=0.0))
    reference = copy.deepcopy(model)
    for layer in model.layers:
        plan.fully_shard(layer)
    plan.fully_shard(model)
    return model, reference


def unshard_before_the_last_rank_joins(
    plan: ShardingPlan, recorder: ScheduleRecorder, module: nn.Module
) -> object:
    """``unshard(async_op=True)`` on every rank; the last rank calls it only once the others'
    calls have returned, which they can only do if the call does not wait for completion."""
    last = dist.get_world_size() - 1
    meeting = dist.new_group(timeout=MEETING_TIMEOUT)
    if dist.get_rank() != last:
        handle = plan.controls(module).unshard(async_op=True)
        with recorder.suite_traffic():
            dist.barrier(group=meeting)
        return handle
    try:
        with recorder.suite_traffic():
            dist.barrier(group=meeting)
    except RuntimeError as error:
        raise AssertionError(
            f"rank {last} waited {MEETING_TIMEOUT.total_seconds():g} s for the other ranks' "
            f"unshard(async_op=True) to return before joining their all-gather; they never "
            f"returned: unshard(async_op=True) waits for its all-gather to complete instead "
            f"of returning a handle ({error})"
        ) from error
    return plan.controls(module).unshard(async_op=True)


@conformance("fsdp.unshard.async_handle")
def test_async_unshard_returns_before_its_all_gather_completes(rank_ctx, impl):
    plan = ShardingPlan(impl)
    model, reference = sharded_transformer(plan, rank_ctx.device, n_layers=2)
    recorder = ScheduleRecorder(plan, model)
    layer = model.layers[0]
    with recorder.step("unshard(async_op=True)"):
        handle = unshard_before_the_last_rank_joins(plan, recorder, layer)
        assert handle is not None, "unshard(async_op=True) returned no handle"
        handle.wait()
    assert impl.is_group_unsharded(layer), "layers.0 is not unsharded after wait()"
    assert not impl.is_group_unsharded(model.layers[1])
    inp = torch.randint(0, 8, (2, 8), device=rank_ctx.device)
    # layers.0 is held unsharded: the oracle expects no all-gather for it in this forward.
    with recorder.step("forward and backward"):
        loss = model(inp).sum()
        loss.backward()
    reference_loss = reference(inp).sum()
    reference_loss.backward()
    assert_losses_equal(0, loss, reference_loss)
    average_gradients(reference)
    assert_sharded_parity(reference, model)


@conformance("fsdp.unshard.async_every_step")
def test_async_unshard_every_step_keeps_numerics(rank_ctx, impl):
    plan = ShardingPlan(impl)
    model, reference = sharded_transformer(plan, rank_ctx.device)
    impl.set_unshard_async_op(model, True)
    recorder = ScheduleRecorder(plan, model)
    optimizer, reference_optimizer = adam(model.parameters()), adam(reference.parameters())
    torch.manual_seed(42 + rank_ctx.rank)
    for step in range(4):
        inp = torch.randint(0, 8, (2, 8), device=rank_ctx.device)
        with recorder.step(f"step {step}"):
            for layer in model.layers:
                plan.controls(layer).unshard(async_op=True)  # handles dropped: forward waits
            loss = model(inp).sum()
            loss.backward()
        reference_loss = reference(inp).sum()
        reference_loss.backward()
        assert_losses_equal(step, loss, reference_loss)
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()


@conformance("fsdp.unshard.in_backward_false")
def test_unshard_in_backward_false_skips_the_gather(rank_ctx, impl):
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(n_layers=2, dropout_p=0.0, weight_tying=False))
    plan = ShardingPlan(impl)

    def shard(model: nn.Module) -> None:
        # The upstream checkpointing test's "mem_eff" grouping: embeddings' backward never
        # reads their weights.
        plan.fully_shard([model.tok_embeddings, model.pos_embeddings])
        for layer in model.layers:
            plan.fully_shard(layer)
        plan.fully_shard([model.norm, model.output])
        plan.fully_shard(model)
        plan.controls(model.tok_embeddings).set_unshard_in_backward(False)

    steps_done = []

    def toggle() -> None:
        # Step 1 runs with True again (the embeddings are gathered in backward, as by
        # default), steps 0 and 2 with False.
        steps_done.append(None)
        unshard = len(steps_done) == 1
        plan.controls(model.tok_embeddings).set_unshard_in_backward(unshard)

    train_with_parity(
        rank_ctx.rank,
        model,
        shard,
        lambda: torch.randint(0, 8, (2, 8), device=rank_ctx.device),
        schedule=plan,
        steps=3,
        make_optimizer=adam,
        before_step=toggle,
    )


@conformance("fsdp.reshard.frees_unsharded")
def test_reshard_frees_the_unsharded_parameters(rank_ctx, impl):
    """``reshard()`` frees the unsharded parameters (``FSDPModule.reshard``: "freeing the
    unsharded parameters if they are allocated"): one held after ``unshard()`` has its storage
    resized to 0 bytes by ``reshard()``, and the next ``unshard()`` gathers the plain model's
    values again. An implementation that keeps the unsharded memory by default (what
    ``set_keep_unsharded_storage(True)`` asks for) holds a whole copy of every group."""
    model, reference = sharded_mlp_stack(impl, rank_ctx.device)
    mlp, plain = model[0], reference[0]
    for attempt in ("first", "second"):
        mlp.unshard()
        held = dict(mlp.named_parameters())
        for name, param in held.items():
            torch.testing.assert_close(
                param.detach(),
                plain.get_parameter(name).detach(),
                msg=lambda m, name=name, attempt=attempt: f"{attempt} unshard(): {name}: {m}",
            )
        mlp.reshard()
        kept = [
            f"{name!r} still holds {param.untyped_storage().nbytes()} bytes after reshard()"
            for name, param in held.items()
            if param.untyped_storage().nbytes() != 0
        ]
        assert not kept, "\n".join(kept)


@conformance("fsdp.keep_unsharded_storage")
def test_kept_unsharded_storage_survives_reshard(rank_ctx, impl):
    """``set_keep_unsharded_storage(True)`` on the root: after ``unshard()`` and ``reshard()``
    the unsharded parameters the module held keep their storage (not freed to 0 bytes), the
    next ``unshard()`` registers parameters on the same data pointers, and a training step's
    numbers are unchanged. Fails on ``tests.suites.broken:ignore_keep_unsharded_storage``
    ("storage of 'in_proj.weight' freed by reshard")."""
    torch.manual_seed(42)
    model, reference = sharded_mlp_stack(impl, rank_ctx.device)
    model.set_keep_unsharded_storage(True)
    mlp = model[0]
    mlp.unshard()
    held = dict(mlp.named_parameters())
    pointers = {name: param.data_ptr() for name, param in held.items()}
    mlp.reshard()
    freed = [
        f"storage of {name!r} freed by reshard"
        for name, param in held.items()
        if param.untyped_storage().nbytes() == 0
    ]
    assert not freed, "\n".join(freed)
    mlp.unshard()
    moved = [
        f"{name!r} unsharded at {param.data_ptr():#x}, first at {pointers[name]:#x}"
        for name, param in mlp.named_parameters()
        if param.data_ptr() != pointers[name]
    ]
    assert not moved, "\n".join(moved)
    mlp.reshard()
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(4, 8, device=rank_ctx.device)
    model(inp).sum().backward()
    reference(inp).sum().backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
