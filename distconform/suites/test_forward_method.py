"""``register_fsdp_forward_method``: a method other than ``forward`` gets the hooks.

The model calls ``vit.forward_features`` (never ``vit.forward``), so without registration
the ViT's parameters would still be sharded DTensors when the convolution runs. The hooks
run on every call, not only the first: called three times in one forward, the registered
method all-gathers the ViT's group each time and reshards it after (its
``reshard_after_forward`` is ``True``), and the gradients sum over the three calls.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance
from distconform.suites.training import counting


class VisionTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 1024, kernel_size=14, stride=14)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit = VisionTransformer()
        self.projector = nn.Linear(1024, 256)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))


def run_forward_method(rank_ctx, impl, distribute) -> None:
    with torch.device(rank_ctx.device):
        model = Model()
    reference = copy.deepcopy(model)
    distribute(model.vit)
    distribute(model.projector)
    distribute(model)
    impl.register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(4, 3, 224, 224, device=rank_ctx.device)
    losses = [m(inp).sum() for m in (model, reference)]
    assert_losses_equal(0, *losses)
    for loss in losses:
        loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)


@conformance("fsdp.forward_method")
def test_register_fsdp_forward_method(rank_ctx, impl):
    run_forward_method(rank_ctx, impl, impl.fully_shard)


@conformance("replicate.forward_method")
def test_replicate_register_fsdp_forward_method(rank_ctx, impl):
    run_forward_method(rank_ctx, impl, impl.replicate)


class RepeatedFeatures(nn.Module):
    """Calls the ViT's registered method once per crop."""

    def __init__(self, crops: int = 3) -> None:
        super().__init__()
        self.vit = VisionTransformer()
        self.projector = nn.Linear(1024, 16)
        self.crops = crops

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        crops = imgs.chunk(self.crops)
        return sum(self.projector(self.vit.forward_features(crop)).sum(1) for crop in crops)


@conformance("fsdp.forward_method.repeated_calls")
def test_forward_method_hooks_run_on_every_call(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = RepeatedFeatures()
    reference = copy.deepcopy(model)
    for module in (model.vit, model.projector, model):
        impl.fully_shard(module)
    impl.register_fsdp_forward_method(model.vit, "forward_features")
    vit_params = sum(p.numel() for p in reference.vit.parameters())
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(6, 3, 28, 28, device=rank_ctx.device)
    with counting() as trace:
        loss = model(inp).sum()
    # The ViT's group is gathered once per call (its weight has 1024 rows: no padding).
    vit_gathers = [c for c in trace.select("all_gather") if c.out_numel == vit_params]
    assert len(vit_gathers) == model.crops, (
        f"the registered method ran {model.crops} times but the ViT's group was all-gathered "
        f"{len(vit_gathers)} times in forward:\n{trace.schedule()}"
    )
    assert not impl.is_group_unsharded(model.vit), (
        "the ViT's group is still unsharded after its registered method returned"
    )
    reference_loss = reference(inp).sum()
    assert_losses_equal(0, loss, reference_loss)
    loss.backward()
    reference_loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
