"""Explicit prefetching keeps numerics and the collective count (§2.4, §3.4).

An 8-layer Transformer; layer i prefetches layers i+1 and i+2 in forward (i < 6) and layers
i-1 and i-2 in backward (i >= 2). Prefetching moves all-gathers earlier but must not add
any: per step, one all-gather per group in forward, one more per resharded block in
backward, one reduction per group. The order of the all-gathers is the comm tools' test
(tests/comm/test_prefetch_schedule.py).
"""

from __future__ import annotations

import torch
from torch import nn

from suites.cases import conformance
from suites.models import ModelArgs, Transformer
from suites.training import Expected, adamw, train_with_parity

N_LAYERS = 8


def set_prefetching(model: nn.Module) -> None:
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i < N_LAYERS - 2:
            layer.set_modules_to_forward_prefetch([layers[i + 1], layers[i + 2]])
        if i >= 2:
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])


def run_prefetching(rank_ctx, distribute, expected: Expected) -> None:
    def shard(model: nn.Module) -> None:
        for layer in model.layers:
            distribute(layer)
        distribute(model)
        set_prefetching(model)

    train_with_parity(
        rank_ctx.rank,
        Transformer(ModelArgs(n_layers=N_LAYERS, dropout_p=0.0)),
        shard,
        lambda: torch.randint(0, 8, (2, 8)),
        expected=expected,
        make_optimizer=adamw,
        seed_offset=0,
    )


@conformance("fsdp.prefetch.explicit")
def test_explicit_prefetching(rank_ctx, impl):
    # Default reshard policy: the 8 blocks reshard after forward, the root does not.
    run_prefetching(rank_ctx, impl.fully_shard, Expected.sharded(N_LAYERS + 1, N_LAYERS))


@conformance("replicate.prefetch.explicit")
def test_replicate_explicit_prefetching(rank_ctx, impl):
    run_prefetching(rank_ctx, impl.replicate, Expected(all_reduce=N_LAYERS + 1))
