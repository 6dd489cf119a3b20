"""Which form of each parameter is registered when, under fully_shard and replicate.

Before forward parameters are ``Shard(0)`` DTensors over the world; after forward they are
plain unsharded tensors iff the group does not reshard after forward (root + ``None`` keeps
them, non-root + ``None`` reshards, ``replicate`` never reshards); after backward they are
DTensors again; ``reshard()`` restores DTensors by hand, and an explicit ``unshard()`` (or
``unshard(async_op=True)`` then ``wait()``) outside forward registers plain tensors until
then. Values always equal the unsharded original. The harness seeds every rank
identically, so models start equal without a broadcast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from distconform.suites.cases import conformance, grid
from distconform.suites.models import MLP


def assert_all_dtensor(params: list[nn.Parameter], context: str) -> None:
    assert params, f"{context}: no parameters"
    for p in params:
        assert isinstance(p, DTensor), f"{context}: expected a DTensor, got {type(p).__name__}"


def assert_all_plain(params: list[nn.Parameter], context: str) -> None:
    assert params, f"{context}: no parameters"
    for p in params:
        assert not isinstance(p, DTensor), f"{context}: expected a plain tensor, got a DTensor"


def assert_dim0_over_the_world(model: nn.Module, world_size: int) -> None:
    for name, p in model.named_parameters():
        assert p.placements == (Shard(0),), f"{name}: placements {p.placements}"
        assert p.device_mesh.size() == world_size, f"{name}: mesh {p.device_mesh}"


def assert_same_values(model: nn.Module, reference: nn.Module) -> None:
    params, ref_params = list(model.parameters()), list(reference.parameters())
    assert len(params) == len(ref_params)
    for p, ref in zip(params, ref_params, strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.shape == ref.shape
        torch.testing.assert_close(full.detach(), ref.detach(), rtol=0, atol=0)


def managed_modules(impl, model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if impl.is_managed(m)]


def build_multi_group(distribute, model: nn.Module) -> None:
    """Groups ``model[0].in_proj``, ``model[0].out_proj`` and the root."""
    distribute(model[0].in_proj)
    distribute(model[0].out_proj)
    distribute(model)


def multi_group_params(model: nn.Module) -> tuple[list, list]:
    """(non-root, root-owned) parameters as registered now (forward re-registers them)."""
    non_root = [*model[0].in_proj.parameters(), *model[0].out_proj.parameters()]
    return non_root, list(model[1].parameters())


AFTER_FORWARD_GRID = grid(groups=["single", "multi"], raf=[True, False, 2, None])


@conformance("fsdp.registration.after_forward")
@pytest.mark.parametrize("point", AFTER_FORWARD_GRID)
def test_param_registration_after_forward(rank_ctx, impl, point):
    raf = point["raf"]

    def distribute(module: nn.Module) -> None:
        impl.fully_shard(module, reshard_after_forward=raf)

    inp = torch.randn(2, 3, device=rank_ctx.device)
    if point["groups"] == "single":
        with torch.device(rank_ctx.device):
            model = MLP(3)
        reference = copy.deepcopy(model)
        distribute(model)
        assert_all_dtensor(list(model.parameters()), "before forward")
        assert_dim0_over_the_world(model, rank_ctx.world_size)
        assert_same_values(model, reference)
        model(inp)
        if raf in (True, 2):
            assert_all_dtensor(list(model.parameters()), f"after forward, root raf={raf}")
        else:  # False, or None on the root
            assert_all_plain(list(model.parameters()), f"after forward, root raf={raf}")
        assert impl.is_group_unsharded(model) is (raf in (False, None))
    else:
        with torch.device(rank_ctx.device):
            model = nn.Sequential(MLP(3), MLP(3))
        reference = copy.deepcopy(model)
        build_multi_group(distribute, model)
        assert_all_dtensor(list(model.parameters()), "before forward")
        assert_dim0_over_the_world(model, rank_ctx.world_size)
        assert_same_values(model, reference)
        model(inp)
        non_root, root_owned = multi_group_params(model)
        if raf is None:
            assert_all_dtensor(non_root, "after forward, non-root with raf=None")
            assert_all_plain(root_owned, "after forward, root with raf=None")
        elif raf is False:
            assert_all_plain(non_root + root_owned, "after forward with raf=False")
        else:
            assert_all_dtensor(non_root + root_owned, f"after forward with raf={raf}")
    assert_same_values(model, reference)
    for module in managed_modules(impl, model):
        module.reshard()
    assert_all_dtensor(list(model.parameters()), "after reshard() of every group")
    for module in managed_modules(impl, model):
        assert not impl.is_group_unsharded(module)
    assert_same_values(model, reference)


AFTER_BACKWARD_GRID = grid(groups=["single", "multi"], raf=[True, False, 2])


@conformance("fsdp.registration.after_backward")
@pytest.mark.parametrize("point", AFTER_BACKWARD_GRID)
def test_param_registration_after_backward(rank_ctx, impl, point):
    raf = point["raf"]
    with torch.device(rank_ctx.device):
        model = MLP(8)
    if point["groups"] == "multi":
        impl.fully_shard(model.in_proj, reshard_after_forward=raf)
        impl.fully_shard(model.out_proj, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    assert_all_dtensor(list(model.parameters()), "before forward")
    model(torch.randn(2, 8, device=rank_ctx.device)).sum().backward()
    assert_all_dtensor(list(model.parameters()), "after backward")
    for module in managed_modules(impl, model):
        assert not impl.is_group_unsharded(module), "a group stayed unsharded after backward"
    for p in model.parameters():
        assert isinstance(p.grad, DTensor), "gradients must be DTensors"
        assert p.grad.placements == p.placements


@conformance("fsdp.registration.modules_to_run_forward")
def test_modules_to_run_forward_empty_for_single_module(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = MLP(8)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model.out_proj)
    impl.fully_shard(model)
    modules = [model.in_proj, model.out_proj, model]
    for module in modules:
        assert impl.modules_to_run_forward(module) == set(), "before forward"
    model(torch.randn(2, 8, device=rank_ctx.device)).sum().backward()
    for module in modules:
        assert impl.modules_to_run_forward(module) == set(), "after forward and backward"


@conformance("fsdp.registration.explicit_unshard")
@pytest.mark.parametrize("point", grid(async_op=[False, True]))
def test_explicit_unshard_then_reshard(rank_ctx, impl, point):
    with torch.device(rank_ctx.device):
        model = MLP(5)  # hidden 20, dim 5: uneven over 2 ranks
    reference = copy.deepcopy(model)
    impl.fully_shard(model)
    handle = model.unshard(async_op=point["async_op"])
    if point["async_op"]:
        assert handle is not None, "unshard(async_op=True) returned no handle"
        handle.wait()
    else:
        # Documented: async_op=False waits inside the call and returns None.
        assert handle is None, f"unshard(async_op=False) returned {handle!r}, not None"
    context = f"after unshard(async_op={point['async_op']})"
    assert_all_plain(list(model.parameters()), context)
    assert impl.is_group_unsharded(model), f"{context}: the group is not unsharded"
    assert_same_values(model, reference)
    model.reshard()
    assert_all_dtensor(list(model.parameters()), "after reshard()")
    assert not impl.is_group_unsharded(model), "reshard() left the group unsharded"
    assert_same_values(model, reference)


@conformance("replicate.registration.after_forward")
@pytest.mark.parametrize("point", grid(groups=["single", "multi"]))
def test_replicate_param_registration_after_forward(rank_ctx, impl, point):
    with torch.device(rank_ctx.device):
        model = MLP(3) if point["groups"] == "single" else nn.Sequential(MLP(3), MLP(3))
    reference = copy.deepcopy(model)
    if point["groups"] == "single":
        impl.replicate(model)
    else:
        build_multi_group(impl.replicate, model)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),), "before forward"
    assert_same_values(model, reference)
    model(torch.randn(2, 3, device=rank_ctx.device))
    # replicate never reshards after forward, root or not.
    assert_all_plain(list(model.parameters()), "replicate, after forward")
    assert_same_values(model, reference)
    for module in managed_modules(impl, model):
        module.reshard()
    assert_all_dtensor(list(model.parameters()), "replicate, after reshard()")
    assert_same_values(model, reference)


@conformance("replicate.registration.after_backward")
@pytest.mark.parametrize("point", grid(groups=["single", "multi"]))
def test_replicate_param_registration_after_backward(rank_ctx, impl, point):
    with torch.device(rank_ctx.device):
        model = MLP(8)
    if point["groups"] == "multi":
        impl.replicate(model.in_proj)
        impl.replicate(model.out_proj)
    impl.replicate(model)
    assert_all_dtensor(list(model.parameters()), "before forward")
    model(torch.randn(2, 8, device=rank_ctx.device)).sum().backward()
    assert_all_dtensor(list(model.parameters()), "after backward")
    for p in model.parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),)
