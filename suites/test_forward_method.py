"""``register_fsdp_forward_method``: a method other than ``forward`` gets the hooks (§2.13, §3.8).

The model calls ``vit.forward_features`` (never ``vit.forward``), so without registration
the ViT's parameters would still be sharded DTensors when the convolution runs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.cases import conformance


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
    model = Model()
    reference = copy.deepcopy(model)
    distribute(model.vit)
    distribute(model.projector)
    distribute(model)
    impl.register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(4, 3, 224, 224)
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
