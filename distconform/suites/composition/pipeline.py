"""Pipeline pieces shared by the composition suites.

The models are those of upstream's pipeline tests, ``MLPModule`` / ``MLPModuleEven``, stacked
as a ``ModuleDict`` keyed ``"0".."N-1"``; a stage holds a ``LayerChunk`` that keeps those keys,
so every parameter keeps its original FQN (``layers.3.net1.weight``) whether it lives in the
full model or in a stage. That is what lets gradients be compared by name with a
single-process reference and a stage checkpoint be loaded into the whole model.

The schedule checks (``test_pipeline_schedules.py``) use smaller pieces, at the end: one
``StageLayer`` per stage, their replay (``ScheduleReplay``), a record of what the stages did
(``ActionLog``) and counting weight runners for ``dw_builder`` (``WeightRunners``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from distconform.api import compare_tensors
from distconform.impl.api import Implementation

#: Every schedule class of torch.distributed.pipelining, under the name
#: ``get_schedule_class`` knows it by.
SCHEDULES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
}
#: Schedules that take one stage per rank; the others take two (virtual stages).
SINGLE_STAGE_SCHEDULES = frozenset({"GPipe", "1F1B"})
#: Schedules whose two stages per rank sit in a V (rank r holds stages r and 2 pp - 1 - r, so
#: the first rank also holds the last stage); the other multi-stage ones loop (r and r + pp).
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV"})
#: The smallest number of microbatches each schedule accepts, in stages: 1F1B and DualPipeV
#: refuse fewer microbatches than stages (read in torch 2.13's constructors).
AT_LEAST_ONE_PER_STAGE = frozenset({"1F1B", "DualPipeV"})


class MLPModule(nn.Module):
    """``net2(relu(net1(x)))``, both ``Linear(dim, dim)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net1 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MLPModuleEven(nn.Module):
    """``dim -> dim -> dim -> 2*dim`` with a ReLU after each; under the 3-D TP+DP+PP plan the
    column-parallel ``net3`` leaves a local ``dim``-wide output for the next layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net1 = nn.Linear(dim, dim)
        self.net2 = nn.Linear(dim, dim)
        self.net3 = nn.Linear(dim, dim * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.net1(x))
        x = torch.relu(self.net2(x))
        return torch.relu(self.net3(x))


class LayerChunk(nn.Module):
    """Some layers of a stack, run in order, under their original keys."""

    def __init__(self, layers: nn.ModuleDict, indices: Iterable[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layers[str(i)] for i in indices})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def layer_stack(make_layer: Callable[[], nn.Module], n_layers: int) -> nn.ModuleDict:
    return nn.ModuleDict({str(i): make_layer() for i in range(n_layers)})


def whole_model(layers: nn.ModuleDict) -> LayerChunk:
    return LayerChunk(layers, range(len(layers)))


def squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed squared error: the loss every pipeline case uses (a sum, like upstream's
    ``y.sum()``, but with the target in it so that the labels' transport is checked too)."""
    return (output - target).pow(2).sum()


@dataclass(frozen=True)
class PipelineLayout:
    """Which stages (and so which layers) a pipeline rank holds."""

    schedule: str
    pp_rank: int
    pp_size: int
    n_layers: int

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    @property
    def layers_per_stage(self) -> int:
        if self.n_layers % self.num_stages:
            raise ValueError(f"{self.n_layers} layers do not split into {self.num_stages} stages")
        return self.n_layers // self.num_stages

    def stage_indices(self) -> list[int]:
        return stage_placement(self.schedule, self.pp_rank, self.pp_size)

    def layer_indices(self, stage_index: int) -> range:
        start = stage_index * self.layers_per_stage
        return range(start, start + self.layers_per_stage)

    @property
    def is_first_rank(self) -> bool:
        """Whether this rank holds the first stage (it feeds the inputs)."""
        return 0 in self.stage_indices()

    @property
    def is_last_rank(self) -> bool:
        """Whether this rank holds the last stage (it computes the losses): the last pipeline
        rank, or the first under a V placement."""
        return self.num_stages - 1 in self.stage_indices()


def stage_placement(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` of ``pp_size`` holds under ``schedule``: its own
    index for the single-stage schedules, ``r`` and ``2 pp - 1 - r`` for the V schedules (what
    they map stages to ranks by), ``r`` and ``r + pp`` (looped) for the others."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return [pp_rank]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]


@dataclass
class Pipeline:
    """This rank's stages, their chunks and the schedule that drives them."""

    layout: PipelineLayout
    chunks: list[LayerChunk]
    stages: list[PipelineStage]
    schedule: object

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """One schedule step; returns the per-microbatch losses on the last rank, else []."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.layout.is_first_rank else ()
        if self.layout.is_last_rank:
            self.schedule.step(*args, target=labels, losses=losses)
        else:
            self.schedule.step(*args)
        return losses

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [item for chunk in self.chunks for item in chunk.named_parameters()]


class DataParallelStage(PipelineStage):
    """A pipeline stage whose data parallelism is driven through the FSDP2 controls, whoever
    implements them.

    Why this exists: ``torch.distributed.pipelining`` knows only torch's own ``FSDPModule``
    (and DDP). Its ``isinstance`` checks decide whether a stage accumulates gradients without
    communicating and without resharding on every microbatch but the last, and whether the
    reduction runs once at the end (``perform_reduce_grad``, through torch's private FSDP state).
    Any other implementation's stage is a plain module to the engine, so each microbatch's
    backward reduces and reshards by itself. For a full backward that is only wasteful (the
    sum of averages is the average of sums). For the split backward of the zero-bubble
    schedules it is wrong: the input pass ends with a backward flush that reshards, which
    registers the sharded parameters, and the later weight pass then maps parameters that the
    forward graph never used (``KeyError: <AccumulateGrad ...>`` in ``stage_backward_weight``).

    So, for the outermost managed modules of the stage, before each backward pass:

    * an input pass (any microbatch), every pass of the microbatches before the last, and the
      last weight pass: no gradient sync, no reshard after backward, not the last backward.
      The parameters stay unsharded, and registered, from a microbatch's input pass to its
      weight pass; gradients accumulate unreduced;
    * the last microbatch's full backward: sync, reshard, last backward, so the
      implementation's own end of backward reduces what accumulated, once per step, and
      reshards.

    The weight pass writes each ``.grad`` itself after its ``autograd.grad`` call, bypassing
    the parameters' gradient accumulators, so no hook of any implementation sees the last
    weight pass's gradients (an end-of-backward flush inside it runs before they are written:
    tried, the last microbatch's share went missing). After the last weight pass, gradient
    sync goes back on and a zero gradient goes through every parameter's accumulator: an
    implementation that reduces on its accumulators' hooks (this project's reference, like DDP)
    reduces then, once. One whose post-backward hangs on module hooks only would not: its
    gradients would stay unreduced, and the gradient check would say so.

    Either way the step ends with the flags back at their defaults, the gradients reduced once
    and the groups resharded (``test_pipeline_reduces_once_per_step`` checks the last two), so
    the engine's ``perform_reduce_grad`` has nothing left to do for these stages.

    Torch's own ``FSDPModule`` is left to the engine, which already drives it: driving it here
    too would flip its flags behind the engine's back. The implementation is driven through
    public FSDP2 methods only (``set_requires_gradient_sync``, ``set_reshard_after_backward``,
    ``set_is_last_backward``; ``torch.autograd.backward``). The engine side is not public: the
    class overrides ``PipelineStage.backward_maybe_with_nosync``, an undocumented method whose
    calls were read in torch 2.13 (``"full"`` passes on single-backward schedules, ``"input"``
    then ``"weight"`` on the zero-bubble ones, ``last_backward`` only on a microbatch's final
    pass); ``test_pipeline_reduces_once_per_step`` fails if another version calls it
    otherwise. Resharding after forward is not touched: with
    it on, a forward of another microbatch between an input pass and its weight pass would
    reshard the group, so the split schedules need ``reshard_after_forward=False`` (what the
    suite uses).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        group: dist.ProcessGroup,
        data_parallel_modules: Sequence[nn.Module],
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.data_parallel_modules = list(data_parallel_modules)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ):
        self._set_last_backward_flags(last_backward and backward_type == "full")
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if last_backward and backward_type == "weight":
            self._reduce_through_accumulators()
        return result

    def _set_last_backward_flags(self, enabled: bool) -> None:
        for module in self.data_parallel_modules:
            module.set_requires_gradient_sync(enabled)
            module.set_reshard_after_backward(enabled)
            module.set_is_last_backward(enabled)

    def _reduce_through_accumulators(self) -> None:
        self._set_last_backward_flags(True)
        # Every trainable parameter, not only those whose ``.grad`` is set: under no-sync an
        # implementation may keep the accumulated gradient elsewhere (the reference keeps it in
        # the reduce dtype under mixed precision, ``.grad`` None; filtering on ``.grad`` failed
        # the bf16 replicate items). Adding zeros changes no gradient; it only runs the
        # accumulators and their hooks. A parameter unused by every microbatch would get a zero
        # gradient instead of None: the suite's stages use all of theirs.
        params = [p for p in self.submod.parameters() if p.requires_grad]
        torch.autograd.backward(params, grad_tensors=[torch.zeros_like(p) for p in params])


def data_parallel_modules(module: nn.Module, impl: Implementation) -> list[nn.Module]:
    """The outermost modules under ``module`` that ``impl`` manages; the FSDP2 controls recurse
    from them.

    Empty as soon as a torch ``FSDPModule`` is found on the way down: the engine drives a
    stage whose root is one, and a stage with torch's FSDP2 only below its root is left as
    the engine leaves it (not driven by anybody), so this suite tests torch as torch is used."""
    if isinstance(module, TorchFSDPModule):
        return []
    if impl.is_managed(module):
        return [module]
    return [found for child in module.children() for found in data_parallel_modules(child, impl)]


def build_pipeline(
    layers: nn.ModuleDict,
    layout: PipelineLayout,
    *,
    distribute: Callable[[LayerChunk], None],
    pp_group: dist.ProcessGroup,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = squared_error,
    impl: Implementation | None = None,
    scale_grads: bool = False,
) -> Pipeline:
    """Cut ``layers`` into this rank's stages, apply ``distribute`` to each, and schedule them
    with ``scale_grads`` (False: gradients are the sum over microbatches; True: the schedule
    divides them by the number of microbatches after the step).

    With ``impl``, stages whose modules it manages are ``DataParallelStage``s (accumulate
    without communication, reduce once per step); without, plain ``PipelineStage``s, which
    the engine drives only for torch's ``FSDPModule``.
    """
    chunks: list[LayerChunk] = []
    stages: list[PipelineStage] = []
    for stage_index in layout.stage_indices():
        chunk = LayerChunk(layers, layout.layer_indices(stage_index)).to(device)
        distribute(chunk)
        chunks.append(chunk)
        driven = data_parallel_modules(chunk, impl) if impl is not None else []
        if driven:
            stage: PipelineStage = DataParallelStage(
                chunk,
                stage_index,
                layout.num_stages,
                device,
                group=pp_group,
                data_parallel_modules=driven,
            )
        else:
            stage = PipelineStage(chunk, stage_index, layout.num_stages, device, group=pp_group)
        stages.append(stage)
    schedule_class = SCHEDULES[layout.schedule]
    stage_arg = stages[0] if layout.schedule in SINGLE_STAGE_SCHEDULES else stages
    schedule = schedule_class(
        stage_arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads
    )
    return Pipeline(layout, chunks, stages, schedule)


# --- the single-process reference -------------------------------------------------------------


@dataclass
class MicrobatchReference:
    """The whole model on one rank, replaying every data-parallel replica's microbatches.

    ``run(batches)`` takes one ``(inputs, labels)`` per replica, runs each microbatch forward
    and backward on a copy cast to ``compute_dtype`` (what a mixed-precision all-gather gives
    the stage), sums the per-microbatch gradients in fp32 (``scale_grads=False``; with
    ``scale_grads`` the sum is divided by the number of microbatches), divides by the number
    of replicas (the data-parallel average) and returns each replica's per-microbatch losses.
    """

    model: nn.Module
    n_microbatches: int
    compute_dtype: torch.dtype = torch.float32
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = squared_error
    losses: list[list[torch.Tensor]] = field(default_factory=list)
    scale_grads: bool = False

    def run(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        compute = copy.deepcopy(self.model).to(self.compute_dtype)
        summed = {name: torch.zeros_like(p) for name, p in self.model.named_parameters()}
        losses: list[list[torch.Tensor]] = []
        for inputs, labels in batches:
            replica_losses = []
            for x, y in zip(
                inputs.chunk(self.n_microbatches), labels.chunk(self.n_microbatches), strict=True
            ):
                compute.zero_grad(set_to_none=True)
                loss = self.loss_fn(compute(x), y)
                loss.backward()
                replica_losses.append(loss.detach())
                for name, p in compute.named_parameters():
                    if p.grad is not None:
                        summed[name] += p.grad.to(summed[name].dtype)
            losses.append(replica_losses)
        divisor = len(batches) * (self.n_microbatches if self.scale_grads else 1)
        for name, p in self.model.named_parameters():
            p.grad = summed[name] / divisor
        return losses


def replica_batches(
    step: int, replicas: int, rows: int, dim: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different inputs and labels for every data-parallel replica, the same on every rank
    (so the tensor-parallel ranks of a replica agree, and each rank can replay all replicas),
    on ``device``."""
    # Drawn on the CPU and then moved: the data must not depend on which device the run
    # uses (an accelerator's generator draws other numbers from the same seed).
    generator = torch.Generator(device="cpu").manual_seed(1000 + step)

    def draw() -> torch.Tensor:
        return torch.rand(rows, dim, generator=generator, device="cpu").to(device, dtype)

    return [(draw(), draw()) for _ in range(replicas)]


def local_shard(reference: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``reference`` cut as ``like`` is (its local shard); no communication."""
    if not isinstance(like, DTensor):
        return reference.detach()
    return distribute_tensor(
        reference.detach(), like.device_mesh, like.placements, src_data_rank=None
    ).to_local()


def gradient_mismatches(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    reference: nn.Module,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[str]:
    """One line per stage parameter whose gradient differs from the reference's (by FQN)."""
    problems: list[str] = []
    count = 0
    for name, param in named_parameters:
        count += 1
        ref_param = reference.get_parameter(name)
        if param.grad is None or ref_param.grad is None:
            if (param.grad is None) != (ref_param.grad is None):
                problems.append(
                    f"gradient of {name!r}: stage has {param.grad is not None}, "
                    f"reference has {ref_param.grad is not None}"
                )
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        expected = local_shard(ref_param.grad, param).to(grad.dtype)
        mismatch = compare_tensors(f"gradient of {name!r}", grad, expected, rtol=rtol, atol=atol)
        if mismatch is not None:
            problems.append(mismatch.describe())
    if count == 0:
        problems.append("the stage has no parameters to compare")
    return problems


# --- what a stage actually executed -----------------------------------------------------------


@dataclass
class ExecutedOrder:
    """Records the forward and backward chunks each stage runs, as the schedule calls them.

    Wraps the stage's ``forward_one_chunk`` / ``backward_one_chunk`` on the instance, so the
    record is what executed, not the schedule's declared ``pipeline_order`` table.
    """

    actions: dict[int, list[str]] = field(default_factory=dict)

    def install(self, stage: PipelineStage) -> None:
        record = self.actions.setdefault(stage.stage_index, [])
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def recorded_forward(chunk_id: int, *args, **kwargs):
            record.append(f"F{chunk_id}")
            return forward(chunk_id, *args, **kwargs)

        def recorded_backward(chunk_id: int, *args, **kwargs):
            record.append(f"B{chunk_id}")
            return backward(chunk_id, *args, **kwargs)

        stage.forward_one_chunk = recorded_forward
        stage.backward_one_chunk = recorded_backward

    def clear(self) -> None:
        for record in self.actions.values():
            record.clear()


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[str]:
    """1F1B by definition: stage s runs ``num_stages - s`` warm-up forwards, then alternates one
    backward and one forward, then drains the remaining backwards (all in microbatch order)."""
    warmup = min(n_microbatches, num_stages - stage_index)
    order = [f"F{i}" for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_backward < n_microbatches:
        order.append(f"B{next_backward}")
        next_backward += 1
        if next_forward < n_microbatches:
            order.append(f"F{next_forward}")
            next_forward += 1
    return order


def gpipe_order(n_microbatches: int) -> list[str]:
    """All forwards, then all backwards."""
    return [f"F{i}" for i in range(n_microbatches)] + [f"B{i}" for i in range(n_microbatches)]


# --- the schedule checks: one pipeline, no data parallelism -----------------------------------


class StageLayer(nn.Module):
    """One stage of the schedule checks' model: ``tanh(Linear(dim, dim))``.

    The first stage also adds a keyword input ``shift`` to its input, and with
    ``features_first`` both arrive transposed, ``(dim, rows)``: the batch is then their dim 1,
    which only ``TensorChunkSpec(1)`` splits right. Every stage accepts ``shift``, because a
    rank hands the step's keyword arguments to each of its stages. With ``records_own_graph``
    the layer computes under ``torch.enable_grad()`` whatever the caller's grad mode, as a
    model whose backward the schedule does not drive through the caller's autograd would.
    ``forward_calls`` counts its forwards (shape inference runs one of its own).
    """

    def __init__(
        self,
        dim: int,
        *,
        first: bool,
        features_first: bool = False,
        records_own_graph: bool = False,
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.first = first
        self.features_first = features_first
        self.records_own_graph = records_own_graph
        self.forward_calls = 0

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        self.forward_calls += 1
        grad_mode = torch.enable_grad() if self.records_own_graph else contextlib.nullcontext()
        with grad_mode:
            if self.first:
                if shift is not None:
                    x = x + shift
                if self.features_first:
                    x = x.t()
            return torch.tanh(self.linear(x))


def stage_layers(dim: int, num_stages: int, **options: bool) -> list[StageLayer]:
    """``num_stages`` layers, the first one first (``options`` go to every layer)."""
    return [StageLayer(dim, first=index == 0, **options) for index in range(num_stages)]


@dataclass(frozen=True)
class ScaledSquaredError:
    """``scale * sum((output - target)^2)``, ``scale`` a keyword the schedule's ``loss_kwargs``
    carries; like ``StageLayer`` it may record its own graph under ``torch.no_grad()``."""

    records_own_graph: bool = False

    def __call__(
        self, output: torch.Tensor, target: torch.Tensor, scale: float = 1.0
    ) -> torch.Tensor:
        grad_mode = torch.enable_grad() if self.records_own_graph else contextlib.nullcontext()
        with grad_mode:
            return scale * (output - target).pow(2).sum()


@dataclass
class ScheduleReplay:
    """The schedule checks' oracle: the whole model on one rank, each microbatch in turn.

    The inputs and ``shift`` are split into ``n_microbatches`` along ``batch_dim`` (what the
    schedule's chunk specs say), the target along dim 0 (the schedules always split it so); each
    microbatch runs forward through every layer and backward from its loss. ``run`` sets each
    layer's gradients to the sum over the microbatches, divided by their number with
    ``scale_grads``, and returns the per-microbatch losses and outputs.
    """

    layers: list[nn.Module]
    n_microbatches: int
    loss_fn: Callable[..., torch.Tensor]
    loss_kwargs: dict[str, float]
    batch_dim: int = 0
    scale_grads: bool = False

    def run(
        self, inputs: torch.Tensor, shift: torch.Tensor, target: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for layer in self.layers:
            layer.zero_grad(set_to_none=True)
        losses, outputs = [], []
        for x, x_shift, y in zip(
            inputs.tensor_split(self.n_microbatches, self.batch_dim),
            shift.tensor_split(self.n_microbatches, self.batch_dim),
            target.tensor_split(self.n_microbatches, 0),
            strict=True,
        ):
            out = self.layers[0](x, shift=x_shift)
            for layer in self.layers[1:]:
                out = layer(out)
            loss = self.loss_fn(out, y, **self.loss_kwargs)
            loss.backward()
            losses.append(loss.detach())
            outputs.append(out.detach())
        if self.scale_grads:
            for layer in self.layers:
                for param in layer.parameters():
                    param.grad /= self.n_microbatches
        return losses, outputs


@dataclass
class ActionLog:
    """What a rank's stages did, in order: each receive posted (``get_fwd_recv_ops`` /
    ``get_bwd_recv_ops`` returning operations) and each compute call (``forward_one_chunk``,
    ``backward_one_chunk``, ``backward_weight_one_chunk``), as ``(kind, stage, microbatch)``
    with kind ``recv_forward``, ``recv_backward``, ``forward``, ``backward`` or ``weight``.

    Wraps the stage's methods on the instance, like ``ExecutedOrder``: the record is what
    executed, not a schedule's table.
    """

    entries: list[tuple[str, int, int]] = field(default_factory=list)

    def install(self, stage: PipelineStage) -> None:
        for method, kind in (
            ("get_fwd_recv_ops", "recv_forward"),
            ("get_bwd_recv_ops", "recv_backward"),
            ("forward_one_chunk", "forward"),
            ("backward_one_chunk", "backward"),
            ("backward_weight_one_chunk", "weight"),
        ):
            setattr(stage, method, self._recorded(stage.stage_index, kind, getattr(stage, method)))

    def _recorded(self, stage_index: int, kind: str, method: Callable) -> Callable:
        def recorded(microbatch: int, *args, **kwargs):
            result = method(microbatch, *args, **kwargs)
            if not kind.startswith("recv") or result:
                self.entries.append((kind, stage_index, microbatch))
            return result

        return recorded

    def receive_gaps(self) -> dict[tuple[str, int, int], list[tuple[str, int, int]]]:
        """For each receive, the compute calls that ran between posting it and the call that
        consumes it (the same stage's forward of that microbatch for an activation, its
        backward for a gradient)."""
        consumer_kind = {"recv_forward": "forward", "recv_backward": "backward"}
        gaps = {}
        for position, (kind, stage, microbatch) in enumerate(self.entries):
            if kind not in consumer_kind:
                continue
            between = []
            for later in self.entries[position + 1 :]:
                if later == (consumer_kind[kind], stage, microbatch):
                    break
                if not later[0].startswith("recv"):
                    between.append(later)
            gaps[(kind, stage, microbatch)] = between
        return gaps

    def receive_leads(self) -> dict[tuple[str, int, int], int]:
        """For each receive, how many compute calls ran between posting it and its consumer."""
        return {receive: len(between) for receive, between in self.receive_gaps().items()}


@dataclass
class WeightRunners:
    """A ``dw_builder`` per stage whose runners count their calls: a stage built with one
    calls ``dw_builder()()`` once per microbatch's backward (at its weight pass under the
    zero-bubble schedules)."""

    calls: dict[int, int] = field(default_factory=dict)

    def builder(self, stage_index: int) -> Callable[[], Callable[[], None]]:
        self.calls.setdefault(stage_index, 0)

        def build() -> Callable[[], None]:
            def run() -> None:
                self.calls[stage_index] += 1

            return run

        return build
