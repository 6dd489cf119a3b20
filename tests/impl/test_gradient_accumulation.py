"""Gradient accumulation flags and their collective counts (cases.md §2.9, 1-D mesh rows at
world size 2; the whole grid at world size 4 is ``test_accumulation_grid.py``), and the 1F1B
microbatching case of §2.9 / §3.7 for ``fully_shard`` and ``replicate``.

Model: ``Sequential(Linear(32, 32), MLP(32), MLP(32), MLP(32))``, each MLP its own group, the
root owning the first Linear: 4 groups. 5 iterations of 3 microbatches; the flags are set
before each microbatch, ``last`` being true on the third. Counts are summed over the three
microbatches of an iteration and compared with the catalogue's formulas; gradients are
compared with the reference (accumulated, then averaged) after the last microbatch.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from harness.parity import assert_losses_equal, assert_sharded_parity, average_gradients
from suites.models import MLP, ModelArgs, Transformer
from tests.impl.comm_count import count_collectives

MICROBATCHES = 3
ITERATIONS = 5

# (reshard_after_forward, mode, reshard_after_backward); the catalogue skips rab=False unless
# raf is False and the mode is not "some_mlps".
CASES = [
    (raf, mode, rab)
    for raf in (True, False)
    for mode in ("all", "root_only", "some_mlps")
    for rab in (False, True)
    if rab or (raf is False and mode != "some_mlps")
]


def case_id(case: tuple) -> str:
    raf, mode, rab = case
    return f"raf={raf}-{mode}-rab={rab}"


def expected_counts(raf: bool, mode: str, rab: bool) -> dict[str, int]:
    reduce_scatter = {"all": 4, "some_mlps": 8, "root_only": 10}[mode]
    if raf is not False:
        all_gather = (4 + 4) * MICROBATCHES
    elif rab:
        all_gather = 4 * MICROBATCHES
    elif mode == "all":
        all_gather = 4
    else:  # root_only: the root stays unsharded, the three MLPs reshard every microbatch
        all_gather = 4 + 3 * (MICROBATCHES - 1)
    return {
        "all_gather_single": all_gather,
        "reduce_scatter_single": reduce_scatter,
        "all_reduce": 0,
    }


def set_flags(model: nn.Module, mode: str, rab: bool, last: bool) -> None:
    if mode == "all":
        model.set_requires_gradient_sync(last)
        if not rab:
            model.set_reshard_after_backward(last)
    elif mode == "some_mlps":
        for mlp in model[1:3]:
            mlp.set_requires_gradient_sync(last)
            if not rab:
                mlp.set_reshard_after_backward(last)
    else:
        model.set_requires_gradient_sync(last, recurse=False)
        if not rab:
            model.set_reshard_after_backward(last, recurse=False)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gradient_accumulation(rank_ctx, impl, case):
    run_gradient_accumulation(rank_ctx, impl, *case)


def run_gradient_accumulation(rank_ctx, impl, raf: bool, mode: str, rab: bool) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 32), MLP(32), MLP(32), MLP(32))
    reference = copy.deepcopy(model)
    for mlp in model[1:]:
        impl.fully_shard(mlp, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)

    torch.manual_seed(42 + rank_ctx.rank + 1)
    for iteration in range(ITERATIONS):
        counts: Counter[str] = Counter()
        for microbatch in range(MICROBATCHES):
            last = microbatch == MICROBATCHES - 1
            set_flags(model, mode, rab, last)
            inp = torch.randn(2, 32)
            with count_collectives() as step_counts:
                loss = model(inp).sum()
                loss.backward()
            counts.update(step_counts)
            reference_loss = reference(inp).sum()
            reference_loss.backward()
            assert_losses_equal(iteration * MICROBATCHES + microbatch, loss, reference_loss)
        assert dict(counts) == expected_counts(raf, mode, rab), f"iteration {iteration}"
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        optimizer.step()
        reference_optimizer.step()
        set_to_none = iteration % 2 == 1
        optimizer.zero_grad(set_to_none=set_to_none)
        reference_optimizer.zero_grad(set_to_none=set_to_none)


# --- 1F1B microbatching (cases.md §2.9 test_1f1b_microbatching, §3.7 for replicate) -----------


def microbatching_params():
    # Two of the eight in the default run; the rest are slow.
    default = {("fully_shard", True, False), ("replicate", False, True)}
    return [
        pytest.param(
            api,
            explicit,
            rab,
            id=f"{api}-explicit={explicit}-rab={rab}",
            marks=() if (api, explicit, rab) in default else pytest.mark.slow,
        )
        for api in ("fully_shard", "replicate")
        for explicit in (False, True)
        for rab in (False, True)
    ]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("api", "explicit_unshard", "rab"), microbatching_params())
def test_1f1b_microbatching(rank_ctx, impl, api, explicit_unshard, rab):
    if api == "replicate" and not impl.supports("replicate"):
        pytest.skip(f"UNSUPPORTED: {impl.name} does not declare replicate")
    torch.manual_seed(42)
    model = Transformer(ModelArgs(dropout_p=0.0))
    reference = copy.deepcopy(model)
    if api == "fully_shard":
        for layer in model.layers:
            impl.fully_shard(layer, reshard_after_forward=False)
        impl.fully_shard(model, reshard_after_forward=False)
    else:
        for layer in model.layers:
            impl.replicate(layer)
        impl.replicate(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    torch.manual_seed(42 + rank_ctx.rank + 1)
    inputs = [torch.randint(0, 8, (2, 16)) for _ in range(MICROBATCHES)]
    if explicit_unshard:
        for module in model.modules():
            if isinstance(module, impl.FSDPModule):
                module.unshard(async_op=True)  # handles dropped: the forward waits
    losses, reference_losses = [], []
    for microbatch, inp in enumerate(inputs):
        last = microbatch == MICROBATCHES - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if not rab:
            model.set_reshard_after_backward(last)
        losses.append(model(inp).sum())
        losses[-1].backward()
        reference_losses.append(reference(inp).sum())
        reference_losses[-1].backward()
    average_gradients(reference)
    for microbatch, (loss, reference_loss) in enumerate(zip(losses, reference_losses, strict=True)):
        assert_losses_equal(microbatch, loss, reference_loss)
    assert_sharded_parity(reference, model)
    optimizer.step()
    reference_optimizer.step()
    assert_sharded_parity(reference, model, check_grads=False)
