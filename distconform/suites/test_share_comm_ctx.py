"""``share_comm_ctx``: several roots share one communication context.

Three MLPs each get ``fully_shard`` with no root above them, so each is its own root; their
communication context is shared. The upstream stream-identity assertions read FSDP2's
internals; what the public API shows instead:

* everywhere: sharing keeps every root's collectives and numerics: the loss and the sharded
  gradients equal the reference's, and each root issues one all-gather and one
  reduce-scatter of its own;
* on a device with streams (``share_comm_ctx``'s documented purpose is to share the streams
  of all-gather, reduce-scatter and all-reduce): the stream current when each collective is
  issued. Once every root has run, every root's all-gathers run on one stream, and every
  root's reduce-scatters on one stream; an implementation that keeps a context per root runs
  them on three. The CPU has no streams.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from distconform.api import (
    Interceptor,
    Proceed,
    RawCall,
    assert_losses_equal,
    assert_sharded_parity,
    average_gradients,
)
from distconform.suites.cases import conformance
from distconform.suites.models import MLP
from distconform.suites.training import Expected, assert_counts, counting


def shared_roots(rank_ctx, impl) -> tuple[nn.Module, nn.Module]:
    """Three MLPs, each its own root, sharing one context; and the plain copy."""
    model = nn.Sequential(*(MLP(16, rank_ctx.device) for _ in range(3)))
    reference = copy.deepcopy(model)
    for layer in model:
        impl.fully_shard(layer)
    impl.share_comm_ctx(list(model))
    return model, reference


@conformance("fsdp.share_comm_ctx")
def test_share_comm_context(rank_ctx, impl):
    model, reference = shared_roots(rank_ctx, impl)
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


class StreamOfEachCollective(Interceptor):
    """The id of the stream current when each all-gather and reduce-scatter is issued."""

    functional = False

    def __init__(self) -> None:
        self.streams: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        if raw.kind in self.streams:
            self.streams[raw.kind].append(torch.accelerator.current_stream().stream_id)
        return proceed()


@conformance("fsdp.share_comm_ctx.streams")
def test_shared_context_shares_the_streams(rank_ctx, impl):
    model, reference = shared_roots(rank_ctx, impl)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    # The streams are checked in the second step: torch 2.13 makes the shared context's
    # streams anew in each root's lazy initialization, so during the first step each root
    # still issues on the streams its own initialization made.
    for _ in range(2):
        inp = torch.randn(4, 3, 16, device=rank_ctx.device)
        reference(inp).sum().backward()
        with StreamOfEachCollective() as seen:
            model(inp).sum().backward()
    for kind, streams in seen.streams.items():
        assert len(streams) == len(model), f"{len(streams)} {kind}s, expected one per root"
        assert len(set(streams)) == 1, (
            f"the three roots' {kind}s ran on streams {streams}: share_comm_ctx shares one "
            f"{kind} stream among them"
        )
    average_gradients(reference)
    assert_sharded_parity(reference, model)
