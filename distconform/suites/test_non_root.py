"""A non-root module runs forward and backward standalone after a root step.

``Sequential(MLP(32) x 3)``, each MLP its own group and the root on top. A full step, then
a 100 ms pause (the upstream device sleep; here the host waits, so a gradient reduction
still in flight would be caught by the comparisons that follow), then the first MLP alone
as if it were a root: its gradients equal the reference's, the other MLPs get none, and
after a second step the whole model still computes the reference's loss.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from distconform.api import assert_losses_equal, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance
from distconform.suites.models import MLP
from distconform.suites.training import inject_delay


def run_non_root(rank_ctx, distribute) -> None:
    with torch.device(rank_ctx.device):
        model = nn.Sequential(MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model:
        distribute(mlp)
    distribute(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank_ctx.rank)
    inp = torch.randn(8, 32, device=rank_ctx.device)

    root_losses = [m(inp).sum() for m in (model, reference)]
    for loss in root_losses:
        loss.backward()
    assert_losses_equal(0, *root_losses)
    average_gradients(reference)
    inject_delay(rank_ctx.device)
    assert_sharded_parity(reference, model)
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad()

    non_root_losses = [m[0](inp).sum() for m in (model, reference)]
    for loss in non_root_losses:
        loss.backward()
    assert_losses_equal(1, *non_root_losses)
    average_gradients(reference)
    assert_sharded_parity(reference, model)
    assert all(p.grad is None for p in model[1:].parameters()), "unused MLPs got gradients"
    for opt in (optimizer, ref_optimizer):
        opt.step()
    assert_sharded_parity(reference, model, check_grads=False)
    assert_losses_equal(2, model(inp).sum(), reference(inp).sum())


@conformance("fsdp.non_root_forward_backward")
def test_non_root_forward_backward(rank_ctx, impl):
    run_non_root(rank_ctx, impl.fully_shard)


@conformance("replicate.non_root_forward_backward")
def test_replicate_non_root_forward_backward(rank_ctx, impl):
    run_non_root(rank_ctx, impl.replicate)
