"""A model sharded by the reference dies with its last reference.

A state or parameter group kept alive from outside the model (a registry keyed weakly by a
module whose value refers back to it, a gradient hook closing over its group) keeps every
sharded model of a session alive: on a warm rank pool each test's process groups then stay
behind, and gloo's event loops of groups whose peers closed their ends spin, one core's
share per dozen groups. (The mesh itself may outlive the model in DTensor's caches until the
harness clears them after the test; that is torch's, not the reference's.)
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from distconform.impl import reference
from distconform.impl.reference.state import state_of


def _train_sharded_model(rank_ctx) -> tuple[weakref.ref, weakref.ref]:
    mesh = rank_ctx.mesh((rank_ctx.world_size,))
    with torch.device(rank_ctx.device):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for layer in (model[0], model[2]):
        reference.fully_shard(layer, mesh=mesh)
    reference.fully_shard(model, mesh=mesh)
    for _ in range(2):
        model(torch.randn(4, 8, device=rank_ctx.device)).sum().backward()
    state = state_of(model)
    assert state is not None
    return weakref.ref(model), weakref.ref(state)


@pytest.mark.world_size(2)
def test_a_trained_sharded_model_is_freed_with_its_state(rank_ctx):
    model, state = _train_sharded_model(rank_ctx)
    gc.collect()
    alive = [name for name, ref in (("model", model), ("state", state)) if ref() is not None]
    assert not alive, f"still alive after the last reference went away: {', '.join(alive)}"
