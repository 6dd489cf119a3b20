"""``set_manual_backward_finalization`` and ``finalize_backward``: the caller, not the end of
autograd's pass, finishes a backward.

FSDP2's documented contract (torch 2.15): manual mode is set on the root before backward;
``finalize_backward()`` after the backward passes of one logical step completes what is still
pending, gradient reduction and resharding, by the current settings; with several backward
passes, gradient sync is off for all but the last, which it is on for. ``async_op=True``
returns a handle whose ``wait()`` makes the gradients final. Before the root's first forward the
call is a no-op; without manual mode it is refused. Until finalization the gradients may
remain unreduced, so only what holds after it is checked, against the plain model's gradients
summed over the microbatches and averaged over the ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from distconform.api import CommTracer, assert_sharded_parity, average_gradients
from distconform.suites.cases import conformance, grid
from distconform.suites.training import sharded_mlp_stack

MICROBATCHES = 2


@conformance("fsdp.manual_backward_finalization")
@pytest.mark.parametrize("point", grid(async_op=[False, True]))
def test_finalize_backward_completes_the_step(rank_ctx, impl, point):
    """Manual mode on the root; two microbatches (gradient sync off, then on); then
    ``finalize_backward(async_op=...)`` (and the handle's ``wait()``): every parameter is a
    sharded ``DTensor`` again and its gradient the average over ranks of both microbatches' sum.
    Before the first forward the call is a no-op that communicates nothing; once manual mode is
    off again it is refused. Fails on ``tests.suites.broken:finalize_backward_does_nothing_torch``
    ("'0.in_proj.weight' is a Parameter after finalize_backward, not a sharded DTensor")."""
    model, reference = sharded_mlp_stack(impl, rank_ctx.device)
    with CommTracer(functional=False) as trace:
        early = model.finalize_backward()
    assert early is None and not trace.calls, (
        f"finalize_backward before the first forward returned {early!r} and issued "
        f"{len(trace.calls)} collectives; expected a no-op"
    )
    model.set_manual_backward_finalization(True)
    torch.manual_seed(42 + rank_ctx.rank + 1)
    for microbatch in range(MICROBATCHES):
        model.set_requires_gradient_sync(microbatch == MICROBATCHES - 1)
        inp = torch.randn(4, 8, device=rank_ctx.device)
        model(inp).sum().backward()
        reference(inp).sum().backward()
    handle = model.finalize_backward(async_op=point["async_op"])
    if point["async_op"]:
        assert handle is not None, "finalize_backward(async_op=True) returned no handle"
        handle.wait()
    unsharded = [
        f"{name!r} is a {type(param).__name__} after finalize_backward, not a sharded DTensor"
        for name, param in model.named_parameters()
        if not isinstance(param, DTensor)
    ]
    assert not unsharded, "\n".join(unsharded)
    average_gradients(reference)
    assert_sharded_parity(reference, model)

    model.set_manual_backward_finalization(False)
    model(torch.randn(4, 8, device=rank_ctx.device)).sum().backward()
    with pytest.raises(RuntimeError):
        model.finalize_backward()
