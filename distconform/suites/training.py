"""Helpers the suites share: parity training loops, collective counts, checkpointing, delays.

Everything here works through ``distconform.impl.api`` objects and public torch APIs only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import (
    CommTracer,
    Interceptor,
    Proceed,
    RawCall,
    ReferenceModel,
    assert_losses_equal,
    assert_sharded_parity,
    average_gradients,
    busy_wait,
    device_sleep,
)
from distconform.suites.models import MLPStack, ModelArgs, Transformer, TransformerBlock, WidthStack
from distconform.suites.schedule import ScheduleRecorder, ShardingPlan

#: Three steps cover every gradient transition the loops check: fresh gradients (step 0),
#: gradients after ``zero_grad(set_to_none=True)`` (step 1) and after zeroing in place
#: (step 2), each followed by an optimizer step; more steps repeat the same transitions.
STEPS = 3
#: Injected delays. On an accelerator, as upstream (100 ms), the current stream is kept busy:
#: a consumer that skips the stream wait reads an unfinished result. The CPU has no stream:
#: the rank's thread busy-waits, which shifts its host work against the other ranks and
#: gloo's threads; 10 ms is 20x a small gloo all-gather at world size 2 (0.5 ms) and 2x one
#: at 4 ranks on 2 cores (4 ms; measured 2026-11-24), so the order still changes.
ACCELERATOR_DELAY_S = 0.1
CPU_DELAY_S = 0.01
#: ``Transformer.sum()`` over 3 x 64 x 1024 logits gives gradient entries around 2000 that
#: cancel to single digits when averaged; the implementation's flat group buffers and the
#: reference's one flat all-reduce (``distconform.harness.parity.average_gradients``) sum the ranks
#: in orders of their own (an ulp of 2048 is 1.2e-4; seen at 4 ranks). Still catches a factor of 2.
SUMMED_LOGITS_GRAD_TOLERANCE = (1e-3, 1e-3)
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def zero_grad(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Alternate set-to-None (even steps) and zeroing (odd), as the upstream loops do."""
    optimizer.zero_grad(set_to_none=step % 2 == 0)


# --- collective counts --------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """Collectives one rank issues in a measured region; every other kind must be absent."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    @classmethod
    def sharded(cls, groups: int, resharded_after_forward: int, *, hsdp: bool = False) -> Expected:
        return cls(
            all_gather=groups + resharded_after_forward,
            reduce_scatter=groups,
            all_reduce=groups if hsdp else 0,
        )

    def as_counts(self) -> dict[str, int]:
        counts = {
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
        }
        return {kind: n for kind, n in counts.items() if n}


@contextlib.contextmanager
def counting() -> Iterator[CommTracer]:
    """Trace this rank's collectives. ``functional=False``: the wrapped ``torch.distributed``
    functions are what FSDP2-style implementations call, and no torch function or dispatch
    mode then sits under every tensor op of the step."""
    with CommTracer(functional=False) as trace:
        yield trace


def _recorded(
    recorder: ScheduleRecorder | None, context: str
) -> contextlib.AbstractContextManager[CommTracer]:
    """A step checked against the schedule oracle, or only traced without a plan."""
    return recorder.step(context) if recorder is not None else counting()


def assert_counts(trace: CommTracer, expected: Expected, context: str) -> None:
    actual = {kind: n for kind, n in trace.counts("kind").items() if n}
    assert actual == expected.as_counts(), (
        f"{context}: collectives {actual}, expected {expected.as_counts()}"
    )


def accumulate_with_parity(
    model: nn.Module,
    reference: nn.Module,
    optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    *,
    iterations: int,
    microbatches: int,
    make_input: Callable[[], torch.Tensor],
    before_microbatch: Callable[[bool], None],
    expected: Expected,
    set_to_none: Callable[[int], bool],
    schedule: ShardingPlan | None = None,
) -> None:
    """Microbatched accumulation against a plain ``reference``, checked every iteration.

    ``before_microbatch(last)`` sets the implementation's flags (through the plan's
    controls when there is a ``schedule``). Losses must match per microbatch; the collectives
    summed over an iteration's microbatches must equal ``expected``, and with a ``schedule``
    every microbatch's collectives must be FSDP2's for the plan; the reference's accumulated
    gradients, averaged over ranks, must match the sharded ones before the step, and the
    parameters after it.
    """
    recorder = ScheduleRecorder(schedule, model) if schedule is not None else None
    for iteration in range(iterations):
        counts: Counter[str] = Counter()
        for microbatch in range(microbatches):
            before_microbatch(microbatch == microbatches - 1)
            inp = make_input()
            context = f"iteration {iteration}, microbatch {microbatch}"
            with _recorded(recorder, context) as trace:
                loss = model(inp).sum()
                loss.backward()
            counts.update(trace.counts("kind"))
            ref_loss = reference(inp).sum()
            ref_loss.backward()
            assert_losses_equal(iteration * microbatches + microbatch, loss, ref_loss)
        actual = {kind: n for kind, n in counts.items() if n}
        assert actual == expected.as_counts(), (
            f"iteration {iteration}: collectives {actual}, expected {expected.as_counts()}"
        )
        average_gradients(reference)
        assert_sharded_parity(reference, model)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none(iteration))
        assert_sharded_parity(reference, model, check_grads=False)


# --- training with parity -----------------------------------------------------------------------


def train_with_parity(
    rank: int,
    model: nn.Module,
    distribute: Callable[[nn.Module], object],
    make_input: Callable[[], torch.Tensor],
    *,
    expected: Expected | None = None,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x).sum(),
    steps: int = STEPS,
    make_optimizer: Callable = adam,
    grad_tolerance: tuple[float, float] | None = None,
    check_grads: bool = True,
    prefixes_to_ignore: tuple[str, ...] = (),
    after_forward: Callable[[], None] | None = None,
    before_step: Callable[[], None] | None = None,
    seed_offset: int = 1,
    reference_group=None,
    model_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    schedule: ShardingPlan | None = None,
    between_steps: Callable[[int, nn.Module, nn.Module], None] | None = None,
) -> None:
    """Train ``model`` (distributed by ``distribute``) next to an explicitly averaged copy.

    Losses are compared every step; parameters and gradients are compared shard by shard
    every step before ``step()`` and after it; collective counts per forward+backward when
    ``expected`` is given, and every step's collectives against FSDP2's schedule when
    ``distribute`` shards through the ``schedule`` plan. ``model_context`` wraps the
    distributed model's forward and backward only (delay injection must not slow the
    reference's own all-reduces). The reference is copied before ``distribute`` runs, so
    structural wrappers that ``distribute`` adds show up in ``prefixes_to_ignore``.
    ``between_steps(step, model, reference)`` runs after each step's optimizer steps (to change
    both models alike, freezing parameters say).
    """
    reference = ReferenceModel(model, make_optimizer, group=reference_group)
    distribute(model)
    recorder = ScheduleRecorder(schedule, model) if schedule is not None else None
    optimizer = make_optimizer(model.parameters())
    assert_sharded_parity(
        reference.module, model, check_grads=False, prefixes_to_ignore=prefixes_to_ignore
    )
    torch.manual_seed(42 + rank + seed_offset)
    grad_rtol, grad_atol = grad_tolerance or (None, None)
    for step in range(steps):
        inp = make_input()
        with (
            _recorded(recorder, f"step {step}") as trace,
            (model_context or contextlib.nullcontext)(),
        ):
            loss = loss_fn(model, inp)
            if after_forward is not None:
                after_forward()
            loss.backward()
        if before_step is not None:
            before_step()
        reference_loss = reference.forward_backward(lambda m, inp=inp: loss_fn(m, inp))
        assert_losses_equal(step, loss, reference_loss)
        if expected is not None:
            assert_counts(trace, expected, f"step {step}")
        if check_grads:
            assert_sharded_parity(
                reference.module,
                model,
                rtol=grad_rtol,
                atol=grad_atol,
                prefixes_to_ignore=prefixes_to_ignore,
            )
        optimizer.step()
        zero_grad(optimizer, step)
        reference.optimizer.step()
        zero_grad(reference.optimizer, step)
        # The parameters moved: the upstream replicate tests' zero_grad before step would not.
        assert_sharded_parity(
            reference.module, model, check_grads=False, prefixes_to_ignore=prefixes_to_ignore
        )
        if between_steps is not None:
            between_steps(step, model, reference.module)


def train_width_stack(
    rank_ctx,
    impl,
    n_blocks: int,
    shard: Callable[[ShardingPlan, WidthStack], None],
    *,
    steps: int = 3,
) -> None:
    """A :class:`WidthStack` sharded by ``shard(plan, model)`` and trained with parity and the
    schedule check; three steps show the schedule is kept from step to step."""
    with torch.device(rank_ctx.device):
        model = WidthStack(n_blocks=n_blocks)
    plan = ShardingPlan(impl)
    train_with_parity(
        rank_ctx.rank,
        model,
        lambda m: shard(plan, m),
        lambda: torch.randn(4, model.in_dim, device=rank_ctx.device),
        schedule=plan,
        steps=steps,
    )


def sharded_mlp_stack(
    impl: Any, device: torch.device, **shard_kwargs: Any
) -> tuple[nn.Module, nn.Module]:
    """An ``MLPStack(8)`` on ``device`` with each MLP and then the root under ``fully_shard``
    (``shard_kwargs`` for the MLPs; the root gets their ``mesh``), and the plain copy taken
    before sharding: the (model, reference) pair of the cases about one control of a sharded
    stack."""
    with torch.device(device):
        model = MLPStack(8)
    reference = copy.deepcopy(model)
    for mlp in model:
        impl.fully_shard(mlp, **shard_kwargs)
    impl.fully_shard(model, **{k: v for k, v in shard_kwargs.items() if k == "mesh"})
    return model, reference


def transformer(
    n_layers: int = 3, *, device: torch.device | str | None = None, **overrides
) -> Transformer:
    """The Transformer the upstream multi-group parity test trains (vocab 1024, seq 64, no
    dropout), built on ``device`` (``None``: the default device, for callers not yet
    converted)."""
    args = dict(n_layers=n_layers, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0.0)
    args.update(overrides)
    with _on(device):
        return Transformer(ModelArgs(**args))


def transformer_tokens(device: torch.device | str | None = None) -> torch.Tensor:
    """A batch for ``transformer()``; ``device=None`` is the default device (for callers that
    pass this function itself as a zero-argument ``make_input``)."""
    return torch.randint(0, 1024, (3, 64), device=device)


def _on(device: torch.device | str | None) -> contextlib.AbstractContextManager:
    # None keeps the caller's default device (and any ``with torch.device`` around the call).
    return torch.device(device) if device is not None else contextlib.nullcontext()


def blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def full_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in module.parameters()]


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- activation checkpointing, in three forms -------------------------------------------------


def checkpoint_in_place(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s forward in backward, keeping its class and parameter names.

    The role of the composable ``checkpoint(module)``: the instance's ``forward`` runs under
    ``torch.utils.checkpoint`` (non-reentrant), and hooks registered on the module later (by
    ``fully_shard``) still run around it.
    """
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    return module


class CheckpointWrapper(nn.Module):
    """A module wrapper whose child is recomputed in backward; names gain a prefix."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs
        )


def wrap_blocks_with_checkpoint(model: nn.Module) -> None:
    """Replace every TransformerBlock in a ``layers`` ModuleList by a CheckpointWrapper."""
    layers = model.layers
    for index, layer in enumerate(layers):
        layers[index] = CheckpointWrapper(layer)


# --- delays (those of the upstream multi-group parity test) -------------------------------------

DELAYS = ("after_forward", "before_all_gather", "before_reduce_scatter", "before_optim")


def delay_sets() -> list[tuple[str, ...]]:
    """No delay, each delay alone, all four (upstream skips 2 or 3 delays at once)."""
    return [(), *((d,) for d in DELAYS), DELAYS]


def delay_id(delays: tuple[str, ...]) -> str:
    if not delays:
        return "none"
    return "all" if len(delays) == len(DELAYS) else delays[0]


def inject_delay(device: torch.device | str) -> None:
    """The suites' delay on ``device``: the stream on an accelerator, the host on the CPU."""
    if torch.device(device).type == "cpu":
        busy_wait(CPU_DELAY_S)
    else:
        device_sleep(ACCELERATOR_DELAY_S, device)


class _DelayBefore(Interceptor):
    """Delays (``inject_delay``) each collective of ``kinds`` this rank issues.

    ``distconform.harness.comm.delay_collectives`` with the wrapped ``torch.distributed`` functions
    only: its default (function and dispatch modes) fails plain-tensor ops such as ``aten.detach``
    in torch 2.13 (reported to the comm tools' owner).
    """

    functional = False

    def __init__(self, kinds: frozenset[str], device: torch.device | str) -> None:
        self._kinds = kinds
        self._device = device

    def handle(self, raw: RawCall, proceed: Proceed):
        if raw.kind in self._kinds:
            inject_delay(self._device)
        return proceed()


def collective_delays(
    delays: tuple[str, ...], device: torch.device | str, *, replicate: bool = False
) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory delaying the chosen collectives of the distributed model.

    ``replicate`` issues no all-gather and reduces with all-reduce: there the
    reduce-scatter delay applies to the all-reduce (what the upstream patch meant to slow).
    """
    kinds = set()
    if "before_all_gather" in delays:
        kinds.add("all_gather")
    if "before_reduce_scatter" in delays:
        kinds.add("all_reduce" if replicate else "reduce_scatter")

    def delayed() -> contextlib.AbstractContextManager:
        return _DelayBefore(frozenset(kinds), device) if kinds else contextlib.nullcontext()

    return delayed


def host_delay(enabled: bool, device: torch.device | str) -> Callable[[], None] | None:
    return (lambda: inject_delay(device)) if enabled else None
