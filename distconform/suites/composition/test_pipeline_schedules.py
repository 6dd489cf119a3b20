"""Every schedule class of ``torch.distributed.pipelining`` with each of its arguments,
``PipelineStage``'s arguments and the tracer front end, on pipelines without data parallelism
(``pp.parity`` composes the schedules with it).

The oracle is a single-process replay of the whole model on every rank (``ScheduleReplay``):
each microbatch forward through every layer and backward from its loss, the inputs split as the
chunk specs say. Every rank checks its own stages:

* the last stage's per-microbatch losses (``step(losses=...)``, filled with one loss per
  microbatch from ``step(target=...)``) equal the replay's, ``loss_kwargs`` reaching the loss
  function (``scale=0.5``: ignored, every loss doubles);
* each stage gradient is the sum over the microbatches (``scale_grads=False``) or their mean
  (``True``), rtol 1e-4 / atol 1e-5, with fewer microbatches than stages where the schedule
  accepts fewer (at least two, so that the mean differs from the sum) and more where it
  refuses (1F1B and DualPipeV take at least one per stage);
* ``args_chunk_spec`` / ``kwargs_chunk_spec`` ``TensorChunkSpec(1)``: the inputs and the
  keyword input ``shift`` arrive features-first and are split along dim 1 (along dim 0 the
  first stage cannot compute); ScheduleLoopedBFS takes neither, so its inputs keep the batch
  in dim 0;
* ``step(return_outputs=True)``: the last stage returns the microbatch outputs merged by
  ``output_merge_spec`` (``TensorChunkSpec(1)``: concatenated along dim 1); every other rank,
  and every rank with ``return_outputs=False``, returns ``None``; with ``loss_fn`` left out the
  step runs forward only: the merged outputs, no gradient;
* ``defer_pp_recv``: torch documents that receives are posted as early as possible by default
  and, deferred, right before the computation that consumes them (on the lower rank of a pair,
  before a send to that peer too). On the last pipeline rank, above its peers, a deferred
  receive has at most the other half of a fused forward-backward action between it and its
  consumer, and all its receives are posted fewer computations ahead than the same schedule's
  early ones (recorded by wrapping the stages' receive and compute calls, ``ActionLog``);
* ``backward_requires_autograd``: ``step()`` under ``torch.no_grad()`` raises (naming
  ``eval()``) when True, and runs when False, the use it exists for: a model that records its
  own graph and stages whose weight passes are custom runners (``dw_builder``);
* ``dw_builder``: each stage calls its runner once per microbatch;
* ``get_schedule_class`` finds each class by its name in any case, and the single-stage and
  multi-stage classes derive from ``PipelineScheduleSingle`` / ``PipelineScheduleMulti``.

``PipelineStage``'s example tensors: with ``input_args`` and ``output_args`` on every stage the
pipeline skips shape inference (each stage's module runs once per microbatch, not once more
before the first); without them it infers, and then checks what was given: an
``output_args``, ``output_grads`` or ``input_grads`` one column too wide is refused, right ones
run. ``get_mesh`` gives a stage the mesh of DTensor activations (and gradients) it infers.

The tracer: ``pipeline()`` splits a traced model at ``pipe_split()``, at a ``split_spec``'s
``SplitPoint.END`` (after a layer) and ``BEGINNING`` (before one) and at a ``split_policy``'s
points, tracing its keyword input from ``mb_kwargs``; ``build_stage`` stages then match the
eager model replayed per microbatch.

The two-rank pipelines run on a mesh's "pp" group (the world); the checks that must end in an
error, and ``build_stage``'s group, run on each rank's own one-rank pipeline (a "pp" dimension
of size 1, every stage on the rank), so that an error on one rank cannot leave its peer
waiting for a message, and a stage built on the world instead is refused at once (two ranks
for one stage).

Where torch 2.13 itself goes wrong, the cases stay clear of it (read in its source, reproduced
here): forward only with two adjacent stages on one rank (see ``check_forward_only``), and
deferred receives of the zero-bubble schedules from three microbatches on (see
``defers_soundly``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.schedules as schedules
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.tensor import DTensor, Replicate

from distconform.api import assert_tensors_close
from distconform.suites.cases import conformance
from distconform.suites.composition.pipeline import (
    AT_LEAST_ONE_PER_STAGE,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ActionLog,
    ScaledSquaredError,
    ScheduleReplay,
    StageLayer,
    WeightRunners,
    stage_layers,
    stage_placement,
)

DIM = 8
MICROBATCH_ROWS = 2
LOSS_KWARGS = {"scale": 0.5}
GRAD_TOLERANCE = (1e-4, 1e-5)
#: Microbatches of the two-rank run of ``pp.schedules.arguments``: fewer than the schedule's
#: stages (2 for the single-stage schedules on two ranks, 4 for the others) where it accepts
#: fewer, but at least two; more where it refuses fewer.
PIPELINED_MICROBATCHES = {
    "GPipe": 3,
    "1F1B": 3,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 5,
}
#: Microbatches of the one-rank runs (one stage, or two for the multi-stage schedules).
LOCAL_MICROBATCHES = 3
#: ScheduleLoopedBFS takes no chunk specs (read in torch 2.13): its inputs stay batch-first.
WITHOUT_CHUNK_SPECS = frozenset({"LoopedBFS"})
FEATURES_DIM = TensorChunkSpec(1)


# --- building and driving the pipelines -------------------------------------------------------


def accepts(function: Callable, argument: str) -> bool:
    """Whether this release's ``function`` takes ``argument``: the window's releases add some
    (``step(loss_kwargs)`` and ``defer_pp_recv`` first in torch 2.13; ``PipelineStage``'s
    ``output_grads``, ``input_grads`` and ``get_mesh`` in 2.12), and a case checks what the
    installed release has."""
    return argument in inspect.signature(function).parameters


def loss_kwargs_for(schedule: str) -> dict:
    """The ``loss_kwargs`` this release's ``step`` passes to the loss (none before 2.13)."""
    return LOSS_KWARGS if accepts(SCHEDULES[schedule].step, "loss_kwargs") else {}


def step_options(schedule: str) -> dict:
    """``step``'s ``loss_kwargs`` argument, where this release has it."""
    loss_kwargs = loss_kwargs_for(schedule)
    return {"loss_kwargs": loss_kwargs} if loss_kwargs else {}


def can_defer(schedule: str) -> bool:
    """Whether ``schedule`` takes ``defer_pp_recv``: the multi-stage schedules, from 2.13."""
    return schedule not in SINGLE_STAGE_SCHEDULES and accepts(
        SCHEDULES[schedule].__init__, "defer_pp_recv"
    )


def features_first(schedule: str) -> bool:
    return schedule not in WITHOUT_CHUNK_SPECS


def chunking_options(schedule: str) -> dict:
    """The constructor's chunk arguments: inputs and ``shift`` split, outputs merged, along
    dim 1 (inputs along dim 0 where the schedule takes no input chunk specs)."""
    options: dict = {"output_merge_spec": FEATURES_DIM}
    if features_first(schedule):
        options["args_chunk_spec"] = (FEATURES_DIM,)
        options["kwargs_chunk_spec"] = {"shift": FEATURES_DIM}
    return options


def batch(
    n_microbatches: int, transposed: bool, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, ``shift`` and target for ``n_microbatches``, the same on every rank: the
    inputs and ``shift`` ``(dim, rows)`` when ``transposed``, else ``(rows, dim)``."""
    generator = torch.Generator(device="cpu").manual_seed(2000 + seed)
    rows = n_microbatches * MICROBATCH_ROWS

    def draw() -> torch.Tensor:
        return torch.rand(rows, DIM, generator=generator, device="cpu").to(device)

    inputs, shift, target = draw(), draw(), draw()
    if transposed:
        inputs, shift = inputs.t().contiguous(), shift.t().contiguous()
    return inputs, shift, target


def build_layers(
    num_stages: int, device: torch.device, **options: bool
) -> tuple[list[StageLayer], list[StageLayer]]:
    """The pipeline's layers and an identical copy for the replay (same seed on every rank)."""
    torch.manual_seed(7)
    with torch.device(device):
        layers = stage_layers(DIM, num_stages, **options)
    return layers, copy.deepcopy(layers)


def schedule_for(schedule: str, stages: list[PipelineStage], **options):
    """``schedule``'s class, found by ``get_schedule_class`` under its name in lower case, over
    ``stages`` (the one stage for a single-stage schedule)."""
    schedule_class = schedules.get_schedule_class(schedule.lower())
    assert schedule_class is SCHEDULES[schedule], (
        f"get_schedule_class({schedule.lower()!r}) gave {schedule_class.__name__}"
    )
    if schedule in SINGLE_STAGE_SCHEDULES:
        assert issubclass(schedule_class, schedules.PipelineScheduleSingle)
        (stage,) = stages
        return schedule_class(stage, **options)
    assert issubclass(schedule_class, schedules.PipelineScheduleMulti)
    return schedule_class(stages, **options)


def check_losses(losses: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(losses) == len(expected), f"{what}: {len(losses)} losses for {len(expected)}"
    for index, (loss, reference) in enumerate(zip(losses, expected, strict=True)):
        assert_tensors_close(f"{what}: loss of microbatch {index}", loss.detach(), reference)


def check_gradients(
    layers: list[StageLayer], replay: ScheduleReplay, indices: list[int], what: str
) -> None:
    rtol, atol = GRAD_TOLERANCE
    for index in indices:
        for name, param in layers[index].named_parameters():
            expected = replay.layers[index].get_parameter(name).grad
            assert param.grad is not None, f"{what}: stage {index} {name} has no gradient"
            assert_tensors_close(
                f"{what}: gradient of stage {index} {name}",
                param.grad,
                expected,
                rtol=rtol,
                atol=atol,
            )


def merged(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The microbatch outputs merged as ``output_merge_spec=TensorChunkSpec(1)`` says."""
    return torch.cat(outputs, dim=1)


# --- one pipeline over the ranks --------------------------------------------------------------


def replay_of(
    schedule: str,
    reference_layers: list[StageLayer],
    n_microbatches: int,
    *,
    scale_grads: bool = False,
) -> ScheduleReplay:
    """The single-process replay of ``schedule``'s step: the scaled squared error with this
    release's ``loss_kwargs``, the batch split along dim 1 where the schedule takes chunk
    specs."""
    return ScheduleReplay(
        reference_layers,
        n_microbatches,
        ScaledSquaredError(),
        loss_kwargs_for(schedule),
        batch_dim=1 if features_first(schedule) else 0,
        scale_grads=scale_grads,
    )


class RankStages(NamedTuple):
    """This rank's part of a pipeline: its stage indices, the pipeline's layers (this rank's
    filled in), their replay, and the stages built on them."""

    indices: list[int]
    num_stages: int
    layers: list[StageLayer]
    replay: ScheduleReplay
    stages: list[PipelineStage]


def stages_on_this_rank(
    schedule: str,
    group: dist.ProcessGroup,
    device: torch.device,
    n_microbatches: int,
    *,
    scale_grads: bool = False,
) -> RankStages:
    """The stages ``schedule`` places on this rank of ``group`` (batch split along dim 1 where
    the schedule takes chunk specs), with the replay of the whole model."""
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    indices = stage_placement(schedule, pp_rank, pp_size)
    num_stages = len(indices) * pp_size
    layers, reference_layers = build_layers(
        num_stages, device, features_first=features_first(schedule)
    )
    replay = replay_of(schedule, reference_layers, n_microbatches, scale_grads=scale_grads)
    stages = [
        PipelineStage(layers[index], index, num_stages, device, group=group) for index in indices
    ]
    return RankStages(indices, num_stages, layers, replay, stages)


def check_pipelined_run(
    schedule: str,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    *,
    n_microbatches: int,
    scale_grads: bool,
    defer_pp_recv: bool,
    return_outputs: bool,
    seed: int = 0,
) -> list[int]:
    """One step of ``schedule`` over the ranks of ``pp_group`` against the replay: losses,
    gradients, the returned outputs and, deferred, when the last rank's receives are posted.
    Returns how far ahead of its consumer each receive of this rank was posted."""
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    indices, num_stages, layers, replay, stages = stages_on_this_rank(
        schedule, pp_group, device, n_microbatches, scale_grads=scale_grads
    )
    log = ActionLog()
    for stage in stages:
        log.install(stage)
    options = chunking_options(schedule)
    defer_pp_recv = defer_pp_recv and can_defer(schedule)
    if can_defer(schedule):
        options["defer_pp_recv"] = defer_pp_recv
    pipeline = schedule_for(
        schedule,
        stages,
        n_microbatches=n_microbatches,
        loss_fn=ScaledSquaredError(),
        scale_grads=scale_grads,
        **options,
    )
    inputs, shift, target = batch(n_microbatches, features_first(schedule), device, seed)
    holds_first, holds_last = 0 in indices, num_stages - 1 in indices
    args = (inputs,) if holds_first else ()
    kwargs: dict = {"shift": shift} if holds_first else {}
    losses: list[torch.Tensor] = []
    if holds_last:
        kwargs |= {"target": target, "losses": losses}
    output = pipeline.step(*args, return_outputs=return_outputs, **step_options(schedule), **kwargs)
    expected_losses, expected_outputs = replay.run(inputs, shift, target)

    what = (
        f"{schedule} on {pp_size} ranks, {n_microbatches} microbatches for {num_stages} "
        f"stages, scale_grads={scale_grads}, defer_pp_recv={defer_pp_recv}"
    )
    if holds_last:
        check_losses(losses, expected_losses, what)
    if holds_last and return_outputs:
        assert output is not None, f"{what}: the last stage returned no output"
        assert_tensors_close(f"{what}: merged output", output, merged(expected_outputs))
    else:
        assert output is None, (
            f"{what}: step(return_outputs={return_outputs}) returned {type(output).__name__} "
            f"on a rank {'with' if holds_last else 'without'} the last stage"
        )
    check_gradients(layers, replay, indices, what)
    if defer_pp_recv and pp_rank == pp_size - 1:
        check_deferred_receives(log, what)
    return list(log.receive_leads().values())


def check_deferred_receives(log: ActionLog, what: str) -> None:
    """Deferred, a receive comes right before its consumer: nothing computes in between but,
    for a gradient, the forward that DualPipeV fuses with the consuming backward (one action,
    its forward half first)."""
    gaps = log.receive_gaps()
    assert gaps, f"{what}: no receive recorded"

    def fused_forward(receive: tuple[str, int, int], between: list) -> bool:
        return receive[0] == "recv_backward" and [kind for kind, *_ in between] == ["forward"]

    early = {
        receive: between
        for receive, between in gaps.items()
        if between and not fused_forward(receive, between)
    }
    assert not early, (
        f"{what}: receives posted ahead of their consumer (computations in between): {early}; "
        f"deferred, each comes right before it. All calls: {log.entries}"
    )


def check_forward_only(
    schedule: str, group: dist.ProcessGroup, device: torch.device, *, n_microbatches: int
) -> None:
    """Without ``loss_fn`` a step runs forward only: the last stage returns the merged outputs,
    no stage gets a gradient.

    Not for two adjacent stages on one rank (every multi-stage schedule on one rank, the V
    schedules on any number): torch 2.13 still runs their backward actions and hands the
    earlier stage a gradient the later never computed ("can't steal_bwd_input if this stage
    doesn't have backward")."""
    indices, num_stages, layers, replay, stages = stages_on_this_rank(
        schedule, group, device, n_microbatches
    )
    pipeline = schedule_for(
        schedule, stages, n_microbatches=n_microbatches, **chunking_options(schedule)
    )
    inputs, shift, target = batch(n_microbatches, features_first(schedule), device)
    holds_first, holds_last = 0 in indices, num_stages - 1 in indices
    kwargs = {"shift": shift} if holds_first else {}
    output = pipeline.step(*((inputs,) if holds_first else ()), **kwargs)
    _, expected_outputs = replay.run(inputs, shift, target)
    what = f"{schedule}, forward only (no loss_fn), {n_microbatches} microbatches"
    if holds_last:
        assert_tensors_close(f"{what}: merged output", output, merged(expected_outputs))
    else:
        assert output is None, f"{what}: a rank without the last stage returned an output"
    with_gradient = [
        f"stage {index} {name}"
        for index in indices
        for name, param in layers[index].named_parameters()
        if param.grad is not None
    ]
    assert not with_gradient, f"{what}: gradients: {with_gradient}"


# --- every stage on this rank -----------------------------------------------------------------


def local_stage_count(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def check_local_run(schedule: str, local_group: dist.ProcessGroup, device: torch.device) -> None:
    """``schedule`` with all its stages on this rank: the sum of the gradients, the merged
    outputs, the weight runners, the no-grad gate, and (one stage) forward only without a
    loss."""
    num_stages = local_stage_count(schedule)
    n_microbatches = LOCAL_MICROBATCHES
    layers, reference_layers = build_layers(
        num_stages, device, features_first=features_first(schedule), records_own_graph=True
    )
    replay = replay_of(schedule, reference_layers, n_microbatches)
    runners = WeightRunners()
    stages = [
        PipelineStage(
            layer, index, num_stages, device, group=local_group, dw_builder=runners.builder(index)
        )
        for index, layer in enumerate(layers)
    ]
    options = {
        "n_microbatches": n_microbatches,
        "loss_fn": ScaledSquaredError(records_own_graph=True),
        "scale_grads": False,
        **chunking_options(schedule),
    }
    multi_stage = schedule not in SINGLE_STAGE_SCHEDULES
    if multi_stage:
        options["backward_requires_autograd"] = False
    pipeline = schedule_for(schedule, stages, **options)
    inputs, shift, target = batch(n_microbatches, features_first(schedule), device)

    def step(runner) -> tuple[object, list[torch.Tensor]]:
        losses: list[torch.Tensor] = []
        output = runner.step(
            inputs,
            shift=shift,
            target=target,
            losses=losses,
            return_outputs=True,
            **step_options(schedule),
        )
        return output, losses

    what = f"{schedule}, {num_stages} stage(s) on one rank, scale_grads=False"
    output, losses = step(pipeline)
    expected_losses, expected_outputs = replay.run(inputs, shift, target)
    check_losses(losses, expected_losses, what)
    assert output is not None, f"{what}: step(return_outputs=True) returned None"
    assert_tensors_close(f"{what}: merged output", output, merged(expected_outputs))
    check_gradients(layers, replay, list(range(num_stages)), what)
    expected_runs = dict.fromkeys(range(num_stages), n_microbatches)
    assert runners.calls == expected_runs, (
        f"{what}: weight runners ran {runners.calls} times per stage, expected {expected_runs}"
    )

    if multi_stage:
        with torch.no_grad():
            _, losses = step(pipeline)
        check_losses(losses, expected_losses, f"{what}, backward_requires_autograd=False, no_grad")
        expected_runs = dict.fromkeys(range(num_stages), 2 * n_microbatches)
        assert runners.calls == expected_runs, (
            f"{what}: weight runners under no_grad: {runners.calls}, expected {expected_runs}"
        )
        gated = schedule_for(schedule, stages, **{**options, "backward_requires_autograd": True})
        with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients to be enabled"):
            step(gated)

    if not multi_stage:
        check_forward_only(schedule, local_group, device, n_microbatches=n_microbatches)


def pipeline_groups(rank_ctx) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The world as one pipeline's group, and a one-rank pipeline group for each rank."""
    pipelined = rank_ctx.mesh((rank_ctx.world_size,), ("pp",)).get_group()
    local = rank_ctx.mesh((rank_ctx.world_size, 1), ("replica", "pp"))["pp"].get_group()
    return pipelined, local


@conformance("pp.schedules.arguments")
def test_every_schedule_with_its_arguments(rank_ctx, impl):
    """``impl`` is not used: the pipelines are torch's alone. It is requested so that the ranks
    load it, with any change to torch it carries (tests/suites/parameter_mutants.py)."""
    pipelined, local = pipeline_groups(rank_ctx)
    for schedule in SCHEDULES:
        # The one-rank run first: an argument whose loss breaks a step raises there on each
        # rank alike, before the two-rank run could leave a peer waiting.
        check_local_run(schedule, local, rank_ctx.device)
        check_pipelined_run(
            schedule,
            pipelined,
            rank_ctx.device,
            n_microbatches=PIPELINED_MICROBATCHES[schedule],
            scale_grads=True,
            defer_pp_recv=True,
            return_outputs=False,
        )


# --- fewer and more microbatches than stages, both scalings -----------------------------------


def microbatch_grid() -> list:
    grid = []
    for schedule in SCHEDULES:
        for microbatches in ("fewer", "more"):
            if microbatches == "fewer" and schedule in AT_LEAST_ONE_PER_STAGE:
                continue
            grid.append(pytest.param(schedule, microbatches, id=f"{schedule}-{microbatches}"))
    return grid


#: Microbatches per stage count (2 stages for the single-stage schedules on two ranks, 4 for
#: the others).
MICROBATCHES = {"fewer": {2: 1, 4: 2}, "more": {2: 6, 4: 6}}


def defers_soundly(schedule: str, n_microbatches: int) -> bool:
    """Whether a step with ``defer_pp_recv=True`` is right on this release (which has it).

    Not the zero-bubble schedules from three microbatches on (two ranks): the deferral moves a
    rank's receive of one message past its receive of a later message from the same peer, the
    peer sends in its own order, and untagged point-to-point messages between two ranks match
    in the order they are posted, so an activation lands in a gradient's buffer (losses and
    gradients off, no error; found by this suite, read in ``_defer_recv_ops``)."""
    zero_bubble = schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")
    return can_defer(schedule) and not (zero_bubble and n_microbatches >= 3)


@conformance("pp.schedules.microbatches")
@pytest.mark.parametrize(("schedule", "microbatches"), microbatch_grid())
def test_schedule_parity_with_microbatches_other_than_stages(
    rank_ctx, impl, schedule, microbatches
):
    """``impl``: as in ``test_every_schedule_with_its_arguments``.

    Two steps: the mean with deferred receives and the merged output left on the rank, the sum
    with receives as early as possible and the output returned. The deferred receives of this
    rank are then posted, in all, fewer computations ahead than the early ones."""
    pipelined, _ = pipeline_groups(rank_ctx)
    num_stages = local_stage_count(schedule) * rank_ctx.world_size
    n_microbatches = MICROBATCHES[microbatches][num_stages]
    deferred = defers_soundly(schedule, n_microbatches)
    leads = []
    for seed, (scale_grads, defer_pp_recv, return_outputs) in enumerate(
        ((True, deferred, False), (False, False, True))
    ):
        leads.append(
            check_pipelined_run(
                schedule,
                pipelined,
                rank_ctx.device,
                n_microbatches=n_microbatches,
                scale_grads=scale_grads,
                defer_pp_recv=defer_pp_recv,
                return_outputs=return_outputs,
                seed=seed,
            )
        )
    if deferred:
        deferred_leads, early_leads = (sum(run) for run in leads)
        assert deferred_leads < early_leads, (
            f"{schedule}, {n_microbatches} microbatches: receives posted {deferred_leads} "
            f"computations ahead in all when deferred, {early_leads} by default (as early as "
            f"possible)"
        )
    if schedule not in V_SCHEDULES:
        check_forward_only(schedule, pipelined, rank_ctx.device, n_microbatches=n_microbatches)


# --- PipelineStage's example tensors and get_mesh ---------------------------------------------

STAGE_MICROBATCHES = 3


def activation(
    device: torch.device, *, requires_grad: bool = True, width: int = DIM
) -> torch.Tensor:
    """An example of one microbatch's activation, ``MICROBATCH_ROWS`` x ``width``: what a
    stage's ``input_args`` / ``output_args`` describe (shape, dtype, requires_grad; the values
    are never read)."""
    return torch.zeros(MICROBATCH_ROWS, width, device=device, requires_grad=requires_grad)


def gradient(device: torch.device, *, width: int = DIM) -> torch.Tensor:
    """An example of the gradient of one microbatch's activation (``output_grads`` /
    ``input_grads``)."""
    return torch.zeros(MICROBATCH_ROWS, width, device=device)


@dataclass
class StageRun:
    """One step of a small pipeline: this rank's stage indices, all layers, the replay."""

    indices: list[int]
    layers: list[nn.Module]
    replay: ScheduleReplay
    losses: list[torch.Tensor]
    expected_losses: list[torch.Tensor]

    def check(self, what: str) -> None:
        if len(self.layers) - 1 in self.indices:
            check_losses(self.losses, self.expected_losses, what)
        check_gradients(self.layers, self.replay, self.indices, what)


def run_pipeline(
    schedule: str,
    group: dist.ProcessGroup,
    device: torch.device,
    stage_options: dict[int, dict],
    layers: tuple[list[nn.Module], list[nn.Module]] | None = None,
) -> StageRun:
    """One step of ``schedule`` over ``group`` (batch-first inputs, no ``shift``), stage
    ``index`` built with ``stage_options[index]``, on ``layers`` (the pipeline's and the
    replay's; default: ``StageLayer``s)."""
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    indices = stage_placement(schedule, pp_rank, pp_size)
    num_stages = len(indices) * pp_size
    layers, reference_layers = layers or build_layers(num_stages, device)
    # scale_grads left at its default: the mean over the microbatches.
    replay = ScheduleReplay(
        reference_layers, STAGE_MICROBATCHES, ScaledSquaredError(), {}, scale_grads=True
    )
    stages = [
        PipelineStage(
            layers[index], index, num_stages, device, group=group, **stage_options.get(index, {})
        )
        for index in indices
    ]
    pipeline = schedule_for(
        schedule, stages, n_microbatches=STAGE_MICROBATCHES, loss_fn=ScaledSquaredError()
    )
    inputs, shift, target = batch(STAGE_MICROBATCHES, False, device)
    losses: list[torch.Tensor] = []
    kwargs: dict = {"target": target, "losses": losses} if num_stages - 1 in indices else {}
    pipeline.step(*((inputs,) if 0 in indices else ()), **kwargs)
    expected_losses, _ = replay.run(inputs, torch.zeros_like(shift), target)
    return StageRun(indices, layers, replay, losses, expected_losses)


def check_static_shapes(pp_group: dist.ProcessGroup, device: torch.device) -> None:
    """``input_args`` and ``output_args`` on every stage: no shape inference (each stage's
    module runs once per microbatch), and the step right; without them, one forward more."""
    pp_rank = dist.get_rank(pp_group)
    examples = {
        # The first stage's input is the data (no gradient); a later stage's input requires
        # grad, so that its gradient goes back to the stage before.
        "input_args": activation(device, requires_grad=pp_rank != 0),
        "output_args": activation(device),
    }
    forwards = {}
    for mode, options in (("given", examples), ("inferred", {})):
        run = run_pipeline("GPipe", pp_group, device, {pp_rank: options})
        run.check(f"GPipe over {dist.get_world_size(pp_group)} ranks, {mode} shapes")
        forwards[mode] = run.layers[pp_rank].forward_calls
    expected = {"given": STAGE_MICROBATCHES, "inferred": STAGE_MICROBATCHES + 1}
    assert forwards == expected, (
        f"stage {pp_rank}'s module ran {forwards} times in the first step; expected {expected}: "
        f"given input_args and output_args on every stage, no stage infers shapes"
    )


#: Wrong examples, each refused with the shapes inferred from the first microbatch (input_args
#: left out, so the stages infer): argument -> (the stage given it, the refusal's subject).
WRONG_EXAMPLES = {
    "output_args": (0, "Stage 0 output[0]"),
    "output_grads": (0, "Stage 0 output_grad[0]"),
    "input_grads": (1, "Stage 1 input_grad[0]"),
}


def check_inferred_shapes_checked(local_group: dist.ProcessGroup, device: torch.device) -> None:
    """With shapes inferred, a stage refuses an ``output_args``, ``output_grads`` (from the next
    stage) or ``input_grads`` (to the previous one) one column wider than what it infers, and
    runs with ones that match. Two stages on this rank, so that a refusal stops nobody else."""
    present = {arg for arg in WRONG_EXAMPLES if accepts(PipelineStage.__init__, arg)}
    for argument, (stage, subject) in WRONG_EXAMPLES.items():
        if argument not in present:
            continue
        make = activation if argument == "output_args" else gradient
        wide = {stage: {argument: make(device, width=DIM + 1)}}
        with pytest.raises(RuntimeError, match="shape mismatch") as refusal:
            run_pipeline("Interleaved1F1B", local_group, device, wide)
        assert str(refusal.value).startswith(subject), (
            f"a wide {argument} on stage {stage} was refused for another reason: {refusal.value}"
        )
    right = {
        0: {"output_args": activation(device), "output_grads": gradient(device)},
        1: {"input_grads": gradient(device)},
    }
    right = {
        stage: {name: example for name, example in given.items() if name in present}
        for stage, given in right.items()
    }
    run_pipeline("Interleaved1F1B", local_group, device, right).check(
        "two stages on one rank, right output_args, output_grads and input_grads"
    )


class ReplicatedOutput(nn.Module):
    """A layer whose output is a DTensor replicated over ``mesh`` (a stage that hands the next
    stage DTensor activations)."""

    def __init__(self, layer: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.layer = layer
        self.mesh = mesh

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> DTensor:
        return DTensor.from_local(self.layer(x, shift), self.mesh, [Replicate()], run_check=False)


class LocalInput(nn.Module):
    """A layer that takes a DTensor activation and computes on its local tensor."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: DTensor) -> torch.Tensor:
        return self.layer(x.to_local())


def check_mesh_callback(local_mesh: DeviceMesh, device: torch.device) -> None:
    """A stage that infers DTensor shapes gets the mesh of the DTensors it receives (and of
    their gradients) from its ``get_mesh`` callback; the step then matches the replay of the
    plain layers (a replicated DTensor over one rank is its local tensor)."""
    plain, reference_layers = build_layers(2, device)
    layers = [ReplicatedOutput(plain[0], local_mesh), LocalInput(plain[1])]
    looked_up: list[tuple[str, ...]] = []

    def get_mesh(mesh_dim_names: tuple[str, ...], mesh_layout) -> DeviceMesh:
        looked_up.append(tuple(mesh_dim_names))
        assert tuple(mesh_dim_names) == local_mesh.mesh_dim_names, mesh_dim_names
        return local_mesh

    options = {index: {"get_mesh": get_mesh} for index in range(2)}
    run = run_pipeline(
        "Interleaved1F1B", local_mesh.get_group(), device, options, (layers, reference_layers)
    )
    # The wrappers hold the plain layers, whose gradients the replay's mirror.
    replace(run, layers=plain).check("DTensor activations between two stages on one rank")
    assert looked_up, "no stage asked its get_mesh callback for the DTensors' mesh"


@conformance("pp.stage.examples")
def test_stage_example_tensors_and_mesh_callback(rank_ctx, impl):
    """``impl``: as in ``test_every_schedule_with_its_arguments``."""
    pipelined, _ = pipeline_groups(rank_ctx)
    local_mesh = rank_ctx.mesh((rank_ctx.world_size, 1), ("replica", "pp"))["pp"]
    check_static_shapes(pipelined, rank_ctx.device)
    check_inferred_shapes_checked(local_mesh.get_group(), rank_ctx.device)
    if accepts(PipelineStage.__init__, "get_mesh"):
        check_mesh_callback(local_mesh, rank_ctx.device)


# --- the tracer front end: pipeline(), pipe_split, SplitPoint, build_stage --------------------


class TracedStack(nn.Module):
    """``d(tanh(c(tanh(b(tanh(a(x + shift)))))))``, four ``Linear(dim, dim)``; ``shift`` is a
    required keyword (a trace without it fails). ``pipe_split_after_a`` puts a ``pipe_split()``
    after ``a``: a no-op eagerly, a stage boundary when traced."""

    def __init__(self, dim: int, *, pipe_split_after_a: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(dim, dim) for _ in range(4))
        self.pipe_split_after_a = pipe_split_after_a

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x + shift))
        if self.pipe_split_after_a:
            pipelining.pipe_split()
        x = torch.tanh(self.b(x))
        x = torch.tanh(self.c(x))
        return self.d(x)


def split_before(layer: str) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """A ``split_policy``: a split point before the first operation that reads ``layer``'s
    weight in the traced graph (the operator ``pipe_split()`` records)."""

    def policy(graph_module: fx.GraphModule) -> fx.GraphModule:
        graph = graph_module.graph
        weight = next(
            n for n in graph.nodes if n.op == "get_attr" and n.target == f"{layer}.weight"
        )
        first_use = next(n for n in graph.nodes if n in weight.users)
        with graph.inserting_before(first_use):
            graph.call_function(torch.ops.pippy._pipe_split.default, ())
        graph_module.recompile()
        return graph_module

    return policy


def stage_layers_of(pipe: pipelining.Pipe) -> list[set[str]]:
    """Which of ``a``..``d`` each stage module of ``pipe`` holds (by its parameters' names)."""
    return [
        {name.split(".")[0] for name, _ in pipe.get_stage_module(index).named_parameters()}
        for index in range(pipe.num_stages)
    ]


def traced(
    device: torch.device, **options
) -> tuple[TracedStack, TracedStack, torch.Tensor, torch.Tensor, torch.Tensor, pipelining.Pipe]:
    """A ``TracedStack``, an untouched copy for the replay (tracing with a ``split_spec``
    rewires the traced module), a two-microbatch batch, and ``pipeline()`` of the stack with
    ``options`` and one microbatch as example."""
    torch.manual_seed(11)
    with torch.device(device):
        stack = TracedStack(DIM, pipe_split_after_a=options.pop("pipe_split_after_a", False))
    reference = copy.deepcopy(stack)
    inputs, shift, target = batch(TRACER_MICROBATCHES, False, device)
    pipe = pipelining.pipeline(
        stack,
        (inputs[:MICROBATCH_ROWS],),
        mb_kwargs={"shift": shift[:MICROBATCH_ROWS]},
        **options,
    )
    return stack, reference, inputs, shift, target, pipe


TRACER_MICROBATCHES = 2


def run_traced_stages(
    pipe: pipelining.Pipe,
    reference: TracedStack,
    group: dist.ProcessGroup,
    device: torch.device,
    batch_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    what: str,
) -> None:
    """``build_stage`` for this rank's stage of ``pipe`` (one per rank of ``group``), one GPipe
    step, checked against the eager ``reference`` replayed per microbatch: the last stage's
    losses, each stage parameter's gradient (the mean, the schedule's default) by name."""
    inputs, shift, target = batch_tensors
    pp_rank, pp_size = dist.get_rank(group), dist.get_world_size(group)
    assert pipe.num_stages == pp_size, f"{what}: {pipe.num_stages} stages for {pp_size} ranks"
    stage = pipelining.build_stage(
        pipe.get_stage_module(pp_rank), pp_rank, pipe.info(), device, group=group
    )
    pipeline = schedule_for(
        "GPipe", [stage], n_microbatches=TRACER_MICROBATCHES, loss_fn=ScaledSquaredError()
    )
    losses: list[torch.Tensor] = []
    kwargs: dict = {"target": target, "losses": losses} if stage.is_last else {}
    if stage.is_first:
        pipeline.step(inputs, shift=shift, **kwargs)
    else:
        pipeline.step(**kwargs)
    expected_losses = []
    for x, x_shift, y in zip(
        inputs.tensor_split(TRACER_MICROBATCHES),
        shift.tensor_split(TRACER_MICROBATCHES),
        target.tensor_split(TRACER_MICROBATCHES),
        strict=True,
    ):
        loss = ScaledSquaredError()(reference(x, shift=x_shift), y)
        (loss / TRACER_MICROBATCHES).backward()
        expected_losses.append(loss.detach())
    if stage.is_last:
        check_losses(losses, expected_losses, what)
    rtol, atol = GRAD_TOLERANCE
    for name, param in stage.submod.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        assert_tensors_close(
            f"{what}: gradient of {name}",
            param.grad,
            reference.get_parameter(name).grad,
            rtol=rtol,
            atol=atol,
        )


@conformance("pp.tracer.split")
# torch.export's own deprecation notice, raised inside pipeline()'s trace.
@pytest.mark.filterwarnings("ignore:.*`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_traced_pipeline_splits_and_stages(rank_ctx, impl):
    """``impl``: as in ``test_every_schedule_with_its_arguments``."""
    pipelined, local = pipeline_groups(rank_ctx)
    device = rank_ctx.device

    # pipe_split() and a split_spec's points: a stage boundary at each (END: after the layer,
    # BEGINNING: before it), nothing run.
    split_spec = {"b": pipelining.SplitPoint.END, "d": pipelining.SplitPoint.BEGINNING}
    *_, pipe = traced(device, pipe_split_after_a=True, split_spec=split_spec)
    assert stage_layers_of(pipe) == [{"a"}, {"b"}, {"c"}, {"d"}], (
        f"pipe_split() after a and split_spec {split_spec}: stages {stage_layers_of(pipe)}"
    )
    assert pipe.info().has_loss_and_backward is False, "pipeline() traced no loss"

    # No split: one stage, on this rank's own one-rank group.
    _, reference, *tensors, pipe = traced(device)
    assert stage_layers_of(pipe) == [{"a", "b", "c", "d"}], stage_layers_of(pipe)
    run_traced_stages(pipe, reference, local, device, tensors, "one traced stage on one rank")

    # A split_policy's point, before c: two stages, over two ranks.
    _, reference, *tensors, pipe = traced(device, split_policy=split_before("c"))
    assert stage_layers_of(pipe) == [{"a", "b"}, {"c", "d"}], (
        f"a split_policy splitting before c: stages {stage_layers_of(pipe)}"
    )
    run_traced_stages(pipe, reference, pipelined, device, tensors, "two traced stages")
