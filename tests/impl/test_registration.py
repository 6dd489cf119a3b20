"""Which form of each parameter is registered when (cases.md §2.2, §3.2, §5.1 item 2).

Every test body runs on every rank; the harness seeds RNG identically on all ranks, so models
built here start equal everywhere without a broadcast.

Checked by the conformance suites in the default run instead, so not repeated here:
``modules_to_run_forward``
(``suites/test_registration.py::test_modules_to_run_forward_empty_for_single_module[ws4]``),
contiguous parameters and gradients under ``shard_placement_fn``
(``suites/test_shard_placement.py::test_shard_placement_fn_contiguous_params_grads[ws4]``), and
root forward inputs (``suites/test_forward_inputs.py::test_root_no_forward_inputs[ws2]``,
``::test_root_move_forward_input_to_device[ws2]``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from suites.models import MLP
from tests.impl.comm_count import trace_collectives

RESHARD_AFTER_FORWARD = [True, False, 2, None]


def raf_id(value: object) -> str:
    return f"raf={value}"


def assert_all_dtensor(params: list[nn.Parameter], context: str) -> None:
    assert params, f"{context}: no parameters"
    for p in params:
        assert isinstance(p, DTensor), f"{context}: expected a DTensor, got {type(p).__name__}"


def assert_all_plain(params: list[nn.Parameter], context: str) -> None:
    assert params, f"{context}: no parameters"
    for p in params:
        assert not isinstance(p, DTensor), f"{context}: expected a plain tensor, got a DTensor"


def assert_same_values(model: nn.Module, reference: nn.Module) -> None:
    params, ref_params = list(model.parameters()), list(reference.parameters())
    assert len(params) == len(ref_params)
    for p, ref in zip(params, ref_params, strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert full.shape == ref.shape
        torch.testing.assert_close(full.detach(), ref.detach(), rtol=0, atol=0)


def managed_modules(impl, model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if impl.is_managed(m)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("raf", RESHARD_AFTER_FORWARD, ids=raf_id)
def test_single_group_registration(rank_ctx, impl, raf):
    model = MLP(3)
    reference = copy.deepcopy(model)
    impl.fully_shard(model, reshard_after_forward=raf)
    assert_all_dtensor(list(model.parameters()), "before forward")
    assert_same_values(model, reference)
    for p in model.parameters():
        assert p.placements == (Shard(0),)
        assert p.device_mesh.size() == rank_ctx.world_size

    model(torch.randn(2, 3))
    after_forward = list(model.parameters())
    if raf in (True, 2):
        assert_all_dtensor(after_forward, f"after forward, root raf={raf}")
    else:  # False, or None on the root
        assert_all_plain(after_forward, f"after forward, root raf={raf}")
    assert impl.is_group_unsharded(model) is (raf in (False, None))
    assert_same_values(model, reference)

    model.reshard()
    assert_all_dtensor(list(model.parameters()), "after reshard()")
    assert not impl.is_group_unsharded(model)
    assert_same_values(model, reference)


# raf=None: suites/test_registration.py::test_param_registration_after_forward
# [ws4-groups=multi-raf=None].
@pytest.mark.world_size(4)
@pytest.mark.parametrize("raf", [True, False, 2], ids=raf_id)
def test_multi_group_registration(rank_ctx, impl, raf):
    model = nn.Sequential(MLP(3), MLP(3))
    reference = copy.deepcopy(model)
    impl.fully_shard(model[0].in_proj, reshard_after_forward=raf)
    impl.fully_shard(model[0].out_proj, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    non_root = [*model[0].in_proj.parameters(), *model[0].out_proj.parameters()]
    assert_all_dtensor(list(model.parameters()), "before forward")

    model(torch.randn(2, 3))
    non_root = [*model[0].in_proj.parameters(), *model[0].out_proj.parameters()]
    root_owned = list(model[1].parameters())
    if raf is False:
        assert_all_plain(non_root + root_owned, "after forward with raf=False")
    else:
        assert_all_dtensor(non_root + root_owned, f"after forward with raf={raf}")
    assert_same_values(model, reference)

    for module in managed_modules(impl, model):
        module.reshard()
    assert_all_dtensor(list(model.parameters()), "after reshard() of every group")
    assert_same_values(model, reference)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("raf", [True, False, 2], ids=raf_id)
def test_registration_after_backward(rank_ctx, impl, raf):
    single = MLP(8)
    impl.fully_shard(single, reshard_after_forward=raf)
    multi = MLP(8)
    impl.fully_shard(multi.in_proj, reshard_after_forward=raf)
    impl.fully_shard(multi.out_proj, reshard_after_forward=raf)
    impl.fully_shard(multi, reshard_after_forward=raf)
    for name, model in (("single group", single), ("multi group", multi)):
        assert_all_dtensor(list(model.parameters()), f"{name}, before forward")
        model(torch.randn(2, 8)).sum().backward()
        assert_all_dtensor(list(model.parameters()), f"{name}, after backward")
        for module in managed_modules(impl, model):
            assert not impl.is_group_unsharded(module)
        for p in model.parameters():
            assert isinstance(p.grad, DTensor)
            assert p.grad.placements == p.placements


@pytest.mark.world_size(2)
def test_explicit_unshard_and_reshard(rank_ctx, impl):
    model = MLP(5)  # hidden 20, dim 5: uneven over 2 ranks
    reference = copy.deepcopy(model)
    impl.fully_shard(model)
    model.unshard()
    assert_all_plain(list(model.parameters()), "after unshard()")
    assert impl.is_group_unsharded(model)
    assert_same_values(model, reference)
    model.reshard()
    assert_all_dtensor(list(model.parameters()), "after reshard()")

    handle = model.unshard(async_op=True)
    handle.wait()
    assert_all_plain(list(model.parameters()), "after unshard(async_op=True).wait()")
    assert_same_values(model, reference)
    model.reshard()


@pytest.mark.world_size(4)
def test_replicate_registration(rank_ctx, impl):
    model = nn.Sequential(MLP(3), MLP(3))
    reference = copy.deepcopy(model)
    impl.replicate(model[0].in_proj)
    impl.replicate(model[0].out_proj)
    impl.replicate(model)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),)
    assert_same_values(model, reference)
    model(torch.randn(2, 3))
    # replicate never reshards after forward, root or not.
    assert_all_plain(list(model.parameters()), "replicate, after forward")
    for module in managed_modules(impl, model):
        module.reshard()
    assert_all_dtensor(list(model.parameters()), "replicate, after reshard()")

    model(torch.randn(2, 3)).sum().backward()
    assert_all_dtensor(list(model.parameters()), "replicate, after backward")
    for p in model.parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),)


@pytest.mark.world_size(4)
def test_int_reshard_after_forward_gathers_within_smaller_groups(rank_ctx, impl):
    model = MLP(8)
    impl.fully_shard(model.in_proj, reshard_after_forward=2)
    impl.fully_shard(model, reshard_after_forward=2)
    with trace_collectives() as calls:
        out = model(torch.randn(2, 8))
        forward_calls = list(calls)
        out.sum().backward()
    backward_calls = calls[len(forward_calls) :]
    ws = rank_ctx.world_size
    assert forward_calls == [("all_gather_single", ws)] * 2
    # Between forward and backward each rank keeps half of every parameter: the backward
    # all-gathers run within pairs; the reduce-scatters still span the whole world.
    assert sorted(backward_calls) == sorted(
        [("all_gather_single", 2)] * 2 + [("reduce_scatter_single", ws)] * 2
    )
