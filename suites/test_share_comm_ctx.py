"""``share_comm_ctx``: several roots share one communication context.

Three MLPs each get ``fully_shard`` with no root above them, so each is its own root; their
communication context is shared. The upstream stream-identity assertions read FSDP2's
internals and have no ``impl.api`` equivalent (on CPU the streams are the default stream
anyway); what stays observable is that sharing keeps every root's collectives and
numerics: the loss and the sharded gradients equal the reference's, and each root issues
one all-gather and one reduce-scatter of its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.cases import conformance
from suites.models import MLP
from suites.training import Expected, assert_counts, counting


@conformance("fsdp.share_comm_ctx")
def test_share_comm_context(rank_ctx, impl):
    model = nn.Sequential(*(MLP(16, rank_ctx.device) for _ in range(3)))
    reference = copy.deepcopy(model)
    for layer in model:
        impl.fully_shard(layer)
    impl.share_comm_ctx(list(model))
    torch.manual_seed(42 + rank_ctx.rank + 1)
    inp = torch.randn(4, 3, 16, device=rank_ctx.device)
    ref_loss = reference(inp).sum()
    with counting() as trace:
        loss = model(inp).sum()
        loss.backward()
    assert_losses_equal(0, loss, ref_loss)
    ref_loss.backward()
    average_gradients(reference)
    assert_sharded_parity(reference, model)
    # Each MLP is a root: it keeps its parameters after forward, so no backward all-gather.
    assert_counts(trace, Expected.sharded(3, 0), "one step with a shared context")
