"""A module called twice in one forward.

Upstream never passed its ``reshard_after_forward`` subtest value to ``fully_shard``, so its
three subtests were one; here the value reaches both groups, so a group that reshards after
its first call must gather again for the second and once more in backward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distconform.suites.cases import conformance, grid
from distconform.suites.training import train_with_parity


class MultiForwardModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def run_multi_forward(rank_ctx, distribute) -> None:
    with torch.device(rank_ctx.device):
        model = MultiForwardModule()
    train_with_parity(
        rank_ctx.rank,
        model,
        distribute,
        lambda: torch.randn(32, 4, device=rank_ctx.device),
        seed_offset=0,
    )


@conformance("fsdp.multi_forward")
@pytest.mark.parametrize("point", grid(raf=[True, False, 2]))
def test_multi_forward_module(rank_ctx, impl, point):
    def distribute(model: nn.Module) -> None:
        impl.fully_shard(model.inner, reshard_after_forward=point["raf"])
        impl.fully_shard(model, reshard_after_forward=point["raf"])

    run_multi_forward(rank_ctx, distribute)


@conformance("replicate.multi_forward")
def test_replicate_multi_forward_module(rank_ctx, impl):
    def distribute(model: nn.Module) -> None:
        impl.replicate(model.inner)
        impl.replicate(model)

    run_multi_forward(rank_ctx, distribute)
