"""Tensor parallel's styles, ``parallelize_module`` and ``loss_parallel`` against a plain model.

torch's ``torch.distributed.tensor.parallel`` runs alone here, on a 1-D ``tp`` mesh of two
ranks (the cases require the ``tp`` capability: an implementation that does not claim to
compose with TP skips them). Each check loops over many style arguments inside one world.
The tests take the ``impl`` fixture without calling it: building the implementation in the
ranks is what installs a broken adapter's patch of torch's TP there
(``tests/suites/parameter_mutants.py``).

The oracle is a plain copy of each module (same seed, same weights) run on the full inputs on
every rank, and the documented meaning of each layout: a tensor laid out ``Shard(d)`` is held
by a rank as ``torch.chunk(full, 2, d)[rank]``, a ``Replicate()`` one whole; an argument left
``None`` means its documented default (``ColwiseParallel``: replicated input, output sharded
on the last dim; ``RowwiseParallel``: input sharded on the last dim, replicated output;
``SequenceParallel``: ``sequence_dim=1``). Every rank checks:

* ``ColwiseParallel`` / ``RowwiseParallel`` on ``Linear`` and ``Embedding``, for each value of
  ``input_layouts``, ``output_layouts`` and ``use_local_output``: the parameters' placements
  and local shards, the output's type (a plain tensor or a ``DTensor``), placements and local
  values, the whole output, the input's gradient in the layout the input was given in, and
  the parameters' whole gradients;
* ``SequenceParallel``: a plain input taken as this rank's part along ``sequence_dim``, a
  replicated ``DTensor`` input redistributed onto it, the output sharded there (local or
  ``DTensor`` per ``use_local_output``), values and gradients;
* ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput``: what the
  module receives for each positional and keyword input (a ``None`` layout leaves it as it
  came; a layout makes it a ``DTensor`` redistributed to the desired layout, local or not per
  ``use_local_output`` / ``use_local_input``) and what the caller gets back for each output;
  a positional layout without a desired one is refused;
* ``parallelize_module``: a plan as one style or as a dict of FQN patterns, the parameters of
  ranks that start from different weights taken from rank ``src_data_rank`` (an int) or each
  rank's own shard (``None``);
* ``loss_parallel``: ``cross_entropy`` of vocabulary-parallel logits (a ``Shard(-1)``
  ``DTensor``) with a plain target gives the plain model's loss for each reduction, a
  replicated loss, the plain model's gradients, a logits gradient still sharded on the
  vocabulary, and never gathers the logits.

One item composes with the implementation (``fsdp.tp.loss_parallel``, 4 ranks, slow only): a
vocabulary-parallel MLP under ``fully_shard`` on ``dp`` of a (dp, tp) mesh trains with
``loss_parallel`` next to a plain copy whose gradients are averaged over the dp ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed.tensor.parallel as tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

from distconform.api import CommTracer, ReferenceModel, assert_losses_equal, assert_tensors_close
from distconform.suites.cases import conformance

TP_MESH_NAMES = ("tp",)


def tp_mesh(rank_ctx) -> DeviceMesh:
    return rank_ctx.mesh((rank_ctx.world_size,), TP_MESH_NAMES)


def normalized(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` as the ``Shard(ndim - 1)`` a DTensor reports."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def local_part(full: torch.Tensor, placement: Placement | None, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's tensor of ``full`` laid out as ``placement``: its chunk of a sharded dim,
    else the whole tensor."""
    if isinstance(placement, Shard):
        return torch.chunk(full, mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
    return full


def as_dtensor(full: torch.Tensor, placement: Placement, mesh: DeviceMesh) -> DTensor:
    """``full`` laid out as ``placement``, built from this rank's part (no communication)."""
    return DTensor.from_local(
        local_part(full, placement, mesh), mesh, (placement,), run_check=False
    )


def assert_plain_tensor(what: str, value: Any) -> None:
    assert isinstance(value, torch.Tensor) and not isinstance(value, DTensor), (
        f"{what}: expected a plain local torch.Tensor, got {type(value).__name__}"
    )


def assert_dtensor(what: str, value: Any, placement: Placement, mesh: DeviceMesh) -> None:
    assert isinstance(value, DTensor), f"{what}: expected a DTensor, got {type(value).__name__}"
    expected = (normalized(placement, value.ndim),)
    assert value.device_mesh == mesh, f"{what}: on mesh {value.device_mesh}, not the tp mesh"
    assert value.placements == expected, f"{what}: placements {value.placements}, not {expected}"


def assert_laid_out(
    what: str,
    value: Any,
    full: torch.Tensor,
    placement: Placement,
    mesh: DeviceMesh,
    *,
    local: bool,
) -> None:
    """``value`` is ``full`` laid out as ``placement``: this rank's part as a plain tensor when
    ``local``, else a DTensor of that placement whose local part and whole are right."""
    if local:
        assert_plain_tensor(what, value)
        assert_tensors_close(what, value.detach(), local_part(full, placement, mesh))
        return
    assert_dtensor(what, value, placement, mesh)
    assert_tensors_close(
        f"{what} (local part)", value.to_local().detach(), local_part(full, placement, mesh)
    )
    assert_tensors_close(f"{what} (whole)", value.full_tensor().detach(), full)


def assert_parameters(
    module: nn.Module, plain: nn.Module, placements: dict[str, Placement], mesh: DeviceMesh
) -> None:
    """Each parameter is a DTensor of its documented placement whose local shard is the plain
    copy's part, and its whole gradient equals the plain copy's."""
    plain_params = dict(plain.named_parameters())
    names = [name for name, _ in module.named_parameters()]
    assert sorted(names) == sorted(placements), f"parameters {names}, expected {sorted(placements)}"
    for name, param in module.named_parameters():
        expected = plain_params[name]
        assert_laid_out(
            f"parameter {name!r}", param, expected.detach(), placements[name], mesh, local=False
        )
        assert param.grad is not None, f"parameter {name!r} got no gradient"
        assert_tensors_close(f"gradient of {name!r}", param.grad.full_tensor(), expected.grad)


# --- ColwiseParallel / RowwiseParallel ------------------------------------------------------

#: What ``None`` means for each style's layouts (their docstrings).
DOCUMENTED_LAYOUTS = {
    ColwiseParallel: {"input_layouts": Replicate(), "output_layouts": Shard(-1)},
    RowwiseParallel: {"input_layouts": Shard(-1), "output_layouts": Replicate()},
}
#: The documented parameter placements: column-parallel splits a Linear's output features
#: (weight rows, bias) and an Embedding's embedding dim; row-parallel a Linear's input features
#: (weight columns; the bias is replicated) and an Embedding's rows.
PARAMETER_PLACEMENTS = {
    (ColwiseParallel, nn.Linear): {"weight": Shard(0), "bias": Shard(0)},
    (ColwiseParallel, nn.Embedding): {"weight": Shard(1)},
    (RowwiseParallel, nn.Linear): {"weight": Shard(1), "bias": Replicate()},
    (RowwiseParallel, nn.Embedding): {"weight": Shard(0)},
}


@dataclass(frozen=True)
class StyleCall:
    style: type[ParallelStyle]
    kwargs: dict[str, Any]
    make_module: Callable[[], nn.Module]
    make_input: Callable[[torch.device], torch.Tensor]

    def layout(self, argument: str) -> Placement:
        given = self.kwargs.get(argument)
        return given if given is not None else DOCUMENTED_LAYOUTS[self.style][argument]

    @property
    def use_local_output(self) -> bool:
        return self.kwargs.get("use_local_output", True)

    def __str__(self) -> str:
        module = self.make_module.__name__
        return f"{self.style.__name__}({self.kwargs}) on {module}"


def colwise_linear() -> nn.Module:
    return nn.Linear(8, 16)


def rowwise_linear() -> nn.Module:
    return nn.Linear(16, 8)


def embedding() -> nn.Module:
    return nn.Embedding(10, 8)


def style_calls() -> list[StyleCall]:
    """Each style with its defaults, with each layout argument explicitly None, and with
    every placement as input and as output layout, ``use_local_output`` both ways."""
    s0, r = Shard(0), Replicate()
    layouts = [
        ({}, {}),
        (
            {"input_layouts": None, "output_layouts": None, "use_local_output": False},
            {"input_layouts": None, "output_layouts": None, "use_local_output": False},
        ),
        (
            {"input_layouts": r, "output_layouts": s0, "use_local_output": False},
            {"input_layouts": r, "output_layouts": s0, "use_local_output": True},
        ),
        (
            {"input_layouts": s0, "output_layouts": r, "use_local_output": True},
            {"input_layouts": s0, "output_layouts": r, "use_local_output": False},
        ),
        (
            {"input_layouts": s0, "output_layouts": Shard(-1), "use_local_output": False},
            {"input_layouts": Shard(-1), "output_layouts": Shard(-1), "use_local_output": True},
        ),
    ]

    def colwise_input(device: torch.device) -> torch.Tensor:
        return torch.randn(4, 8, device=device)

    def rowwise_input(device: torch.device) -> torch.Tensor:
        return torch.randn(4, 16, device=device)

    calls = []
    for colwise, rowwise in layouts:
        calls.append(StyleCall(ColwiseParallel, colwise, colwise_linear, colwise_input))
        calls.append(StyleCall(RowwiseParallel, rowwise, rowwise_linear, rowwise_input))

    def indices(device: torch.device) -> torch.Tensor:
        return torch.randint(0, 10, (2, 4), device=device)

    for style, kwargs in (
        (ColwiseParallel, {}),
        (ColwiseParallel, {"output_layouts": Replicate(), "use_local_output": False}),
        # Row-parallel embeddings look up replicated indices; the default (last dim sharded)
        # is for a Linear's activations.
        (RowwiseParallel, {"input_layouts": Replicate()}),
        (
            RowwiseParallel,
            {"input_layouts": Replicate(), "output_layouts": Shard(1), "use_local_output": False},
        ),
    ):
        calls.append(StyleCall(style, kwargs, embedding, indices))
    return calls


def check_style_call(rank_ctx, mesh: DeviceMesh, call: StyleCall) -> None:
    device = rank_ctx.device
    torch.manual_seed(7)
    with torch.device(device):
        module = call.make_module()
    plain = copy.deepcopy(module)
    full_input = call.make_input(device)
    differentiable = full_input.is_floating_point()

    plain_input = full_input.clone().requires_grad_(differentiable)
    plain_output = plain(plain_input)
    grad_output = torch.randn_like(plain_output)
    plain_output.backward(grad_output)

    assert tp.parallelize_module(module, mesh, call.style(**call.kwargs)) is module
    input_layout, output_layout = call.layout("input_layouts"), call.layout("output_layouts")
    local_input = local_part(full_input, input_layout, mesh).clone().requires_grad_(differentiable)
    output = module(local_input)
    what = f"{call}: output"
    assert_laid_out(
        what, output, plain_output.detach(), output_layout, mesh, local=call.use_local_output
    )
    if call.use_local_output:
        output.backward(local_part(grad_output, output_layout, mesh))
    else:
        output.backward(as_dtensor(grad_output, output_layout, mesh))
    if differentiable:
        assert_laid_out(
            f"{call}: input gradient",
            local_input.grad,
            plain_input.grad,
            input_layout,
            mesh,
            local=True,
        )
    kind = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
    assert_parameters(module, plain, PARAMETER_PLACEMENTS[call.style, kind], mesh)


@conformance("tp.styles.colwise_rowwise")
def test_colwise_rowwise_layouts(rank_ctx, impl):
    mesh = tp_mesh(rank_ctx)
    for call in style_calls():
        check_style_call(rank_ctx, mesh, call)


# --- SequenceParallel ---------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceCall:
    kwargs: dict[str, Any]
    shape: tuple[int, ...]  #: the full input's; the sequence dim has 4
    replicated_input: bool  #: a replicated DTensor instead of this rank's part of the sequence

    @property
    def sequence_dim(self) -> int:
        return self.kwargs.get("sequence_dim", 1)


SEQUENCE_CALLS = (
    SequenceCall({}, (2, 4, 8), replicated_input=False),
    SequenceCall({"sequence_dim": 0, "use_local_output": True}, (4, 2, 8), replicated_input=False),
    SequenceCall({"sequence_dim": 0, "use_local_output": False}, (4, 2, 8), replicated_input=True),
    SequenceCall({"sequence_dim": 1, "use_local_output": True}, (2, 4, 8), replicated_input=True),
)


@conformance("tp.styles.sequence_parallel")
def test_sequence_parallel(rank_ctx, impl):
    mesh = tp_mesh(rank_ctx)
    for call in SEQUENCE_CALLS:
        torch.manual_seed(3)
        with torch.device(rank_ctx.device):
            module = nn.LayerNorm(8)
        plain = copy.deepcopy(module)
        full_input = torch.randn(call.shape, device=rank_ctx.device)
        plain_input = full_input.clone().requires_grad_()
        plain_output = plain(plain_input)
        grad_output = torch.randn_like(plain_output)
        plain_output.backward(grad_output)

        tp.parallelize_module(module, mesh, SequenceParallel(**call.kwargs))
        sequence = Shard(call.sequence_dim)
        if call.replicated_input:
            leaf = full_input.clone().requires_grad_()
            output = module(DTensor.from_local(leaf, mesh, (Replicate(),), run_check=False))
        else:
            leaf = local_part(full_input, sequence, mesh).clone().requires_grad_()
            output = module(leaf)
        use_local = call.kwargs.get("use_local_output", False)
        assert_laid_out(
            f"SequenceParallel({call.kwargs}): output",
            output,
            plain_output.detach(),
            sequence,
            mesh,
            local=use_local,
        )
        if use_local:
            output.backward(local_part(grad_output, sequence, mesh))
        else:
            output.backward(as_dtensor(grad_output, sequence, mesh))
        input_layout = Replicate() if call.replicated_input else sequence
        assert_laid_out(
            f"SequenceParallel({call.kwargs}): input gradient",
            leaf.grad,
            plain_input.grad,
            input_layout,
            mesh,
            local=True,
        )
        placements = {"weight": Replicate(), "bias": Replicate()}
        assert_parameters(module, plain, placements, mesh)


# --- PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput --------------------


class Probe(nn.Module):
    """Records what forward receives and returns what the test hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, Any] = {}
        self.to_return: tuple[Any, ...] = ()

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, z: torch.Tensor) -> Any:
        self.received = {"x": x, "y": y, "z": z}
        return self.to_return[0] if len(self.to_return) == 1 else self.to_return


@dataclass(frozen=True)
class Prepared:
    """One call: the layout each input arrives in and the one the module must receive it in
    (``None``: left as it came), the same for each output, and whether the module receives
    local tensors and the caller gets local tensors back."""

    style: ParallelStyle
    inputs: dict[str, tuple[Placement, Placement] | None]
    outputs: tuple[tuple[Placement, Placement] | None, ...] = ()
    local_inputs: bool = False
    local_outputs: bool = True
    label: str = ""
    #: The inputs passed positionally (a single placement stands for one); the others by keyword.
    positional: tuple[str, ...] = ("x", "y")


def prepared_calls() -> list[Prepared]:
    s0, r = Shard(0), Replicate()
    return [
        Prepared(
            PrepareModuleInput(
                input_layouts=(s0, None),
                desired_input_layouts=(r, None),
                input_kwarg_layouts={"z": r},
                desired_input_kwarg_layouts={"z": s0},
                use_local_output=False,
            ),
            {"x": (s0, r), "y": None, "z": (r, s0)},
            label="input tuple and kwargs, DTensors",
        ),
        Prepared(
            PrepareModuleInput(input_layouts=s0, desired_input_layouts=r, use_local_output=True),
            {"x": (s0, r), "y": None, "z": None},
            local_inputs=True,
            label="one input, local",
            positional=("x",),
        ),
        Prepared(
            PrepareModuleInput(input_layouts=r, desired_input_layouts=s0),
            {"x": (r, s0), "y": None, "z": None},
            label="one replicated input, default use_local_output",
            positional=("x",),
        ),
        Prepared(
            PrepareModuleInput(input_layouts=(r, s0), desired_input_layouts=(s0, s0)),
            {"x": (r, s0), "y": (s0, s0), "z": None},
            label="input tuple, default use_local_output",
        ),
        Prepared(
            PrepareModuleInput(
                input_layouts=None,
                desired_input_layouts=None,
                input_kwarg_layouts={"z": s0},
                desired_input_kwarg_layouts={"z": r},
                use_local_output=True,
            ),
            {"x": None, "y": None, "z": (s0, r)},
            local_inputs=True,
            label="kwargs only",
        ),
        Prepared(
            PrepareModuleOutput(
                output_layouts=(s0, None, r),
                desired_output_layouts=(r, None, s0),
                use_local_output=False,
            ),
            {"x": None, "y": None, "z": None},
            outputs=((s0, r), None, (r, s0)),
            local_outputs=False,
            label="output tuple, DTensors",
        ),
        Prepared(
            PrepareModuleOutput(output_layouts=s0, desired_output_layouts=r),
            {"x": None, "y": None, "z": None},
            outputs=((s0, r),),
            label="one output, default use_local_output",
        ),
        Prepared(
            PrepareModuleOutput(output_layouts=r, desired_output_layouts=s0, use_local_output=True),
            {"x": None, "y": None, "z": None},
            outputs=((r, s0),),
            label="one replicated output, local",
        ),
        Prepared(
            PrepareModuleInputOutput(
                input_layouts=s0,
                desired_input_layouts=r,
                use_local_input=True,
                output_layouts=r,
                desired_output_layouts=s0,
                use_local_output=False,
            ),
            {"x": (s0, r), "y": None, "z": None},
            outputs=((r, s0),),
            local_inputs=True,
            local_outputs=False,
            label="one input and output",
            positional=("x",),
        ),
        Prepared(
            PrepareModuleInputOutput(
                input_layouts=(r, None),
                desired_input_layouts=(s0, None),
                input_kwarg_layouts={"z": s0},
                desired_input_kwarg_layouts={"z": r},
                use_local_input=False,
                output_layouts=(s0, None),
                desired_output_layouts=(r, None),
                use_local_output=True,
            ),
            {"x": (r, s0), "y": None, "z": (s0, r)},
            outputs=((s0, r), None),
            label="tuples and kwargs",
        ),
        Prepared(
            PrepareModuleInputOutput(
                input_layouts=r,
                desired_input_layouts=s0,
                output_layouts=s0,
                desired_output_layouts=r,
            ),
            {"x": (r, s0), "y": None, "z": None},
            outputs=((s0, r),),
            label="one replicated input and one output, default use_local_*",
            positional=("x",),
        ),
        Prepared(
            PrepareModuleInputOutput(output_layouts=s0, desired_output_layouts=s0),
            {"x": None, "y": None, "z": None},
            outputs=((s0, s0),),
            label="outputs only",
        ),
    ]


def check_prepared(rank_ctx, mesh: DeviceMesh, call: Prepared) -> None:
    device = rank_ctx.device
    torch.manual_seed(5)
    full = {name: torch.randn(4, 6, device=device) for name in ("x", "y", "z")}
    full_outputs = [torch.randn(4, 6, device=device) for _ in call.outputs]
    probe = Probe()
    assert tp.parallelize_module(probe, mesh, call.style) is probe
    given = {}
    for name, layouts in call.inputs.items():
        given[name] = full[name] if layouts is None else local_part(full[name], layouts[0], mesh)
    probe.to_return = tuple(
        full_outputs[i] if layouts is None else local_part(full_outputs[i], layouts[0], mesh)
        for i, layouts in enumerate(call.outputs)
    ) or (full["x"],)
    returned = probe(
        *(given[name] for name in call.positional),
        **{name: tensor for name, tensor in given.items() if name not in call.positional},
    )

    for name, layouts in call.inputs.items():
        what = f"{call.label}: input {name!r} as the module receives it"
        if layouts is None:
            assert probe.received[name] is given[name], f"{what}: not the tensor passed"
        else:
            assert_laid_out(
                what, probe.received[name], full[name], layouts[1], mesh, local=call.local_inputs
            )
    returned = returned if isinstance(returned, tuple) else (returned,)
    if not call.outputs:
        assert returned[0] is probe.to_return[0], f"{call.label}: the output was changed"
    for i, layouts in enumerate(call.outputs):
        what = f"{call.label}: output {i} as the caller gets it"
        if layouts is None:
            assert returned[i] is probe.to_return[i], f"{what}: not the tensor returned"
        else:
            assert_laid_out(
                what, returned[i], full_outputs[i], layouts[1], mesh, local=call.local_outputs
            )


@conformance("tp.styles.prepare_module")
def test_prepare_module_input_output(rank_ctx, impl):
    mesh = tp_mesh(rank_ctx)
    for call in prepared_calls():
        check_prepared(rank_ctx, mesh, call)
    # A positional layout needs the layout to redistribute it to.
    outputs = {"output_layouts": Shard(0), "desired_output_layouts": Shard(0)}
    for style, extra in ((PrepareModuleInput, {}), (PrepareModuleInputOutput, outputs)):
        with pytest.raises(AssertionError, match="desired module inputs should not be None"):
            style(input_layouts=Shard(0), desired_input_layouts=None, **extra)


# --- parallelize_module ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


#: FQN patterns (fnmatch, one dotted part at a time) reaching every block's projections.
STACK_PLAN_PLACEMENTS = {
    f"layers.{index}.{name}.{param}": placement
    for index in range(2)
    for name, params in (
        ("up", PARAMETER_PLACEMENTS[ColwiseParallel, nn.Linear]),
        ("down", PARAMETER_PLACEMENTS[RowwiseParallel, nn.Linear]),
    )
    for param, placement in params.items()
}


def stack_plan() -> dict[str, ParallelStyle]:
    return {"layers.*.up": ColwiseParallel(), "lay*.*.down": RowwiseParallel()}


def built_on_rank(rank_ctx, rank: int, make: Callable[[], nn.Module]) -> nn.Module:
    """The module rank ``rank`` builds: every rank starts from weights of its own."""
    torch.manual_seed(100 + rank)
    with torch.device(rank_ctx.device):
        return make()


def assert_shards_from(
    module: nn.Module,
    sources: list[nn.Module],
    placements: dict[str, Placement],
    mesh: DeviceMesh,
    src: int | None,
    what: str,
) -> None:
    """Each parameter's local shard is rank ``src``'s part of its weights, or with ``None``
    this rank's part of its own."""
    rank = mesh.get_local_rank()
    source = dict(sources[rank if src is None else src].named_parameters())
    for name, param in module.named_parameters():
        assert_dtensor(f"{what}: parameter {name!r}", param, placements[name], mesh)
        expected = local_part(source[name].detach(), placements[name], mesh)
        assert_tensors_close(
            f"{what}: local shard of {name!r} (src_data_rank={src})",
            param.to_local().detach(),
            expected,
        )


@conformance("tp.parallelize_module.plan_and_src_data_rank")
def test_parallelize_module_plan_and_src_data_rank(rank_ctx, impl):
    mesh = tp_mesh(rank_ctx)
    ranks = range(mesh.size())
    torch.manual_seed(0)  # the same input on every rank, as a replicated input must be
    x = torch.randn(4, 8, device=rank_ctx.device)
    for src_data_rank in ("default", 0, 1, None):
        kwargs = {} if src_data_rank == "default" else {"src_data_rank": src_data_rank}
        src = 0 if src_data_rank == "default" else src_data_rank
        what = f"parallelize_module({kwargs})"

        sources = [built_on_rank(rank_ctx, r, Stack) for r in ranks]
        model = built_on_rank(rank_ctx, mesh.get_local_rank(), Stack)
        assert tp.parallelize_module(model, mesh, stack_plan(), **kwargs) is model
        assert_shards_from(model, sources, STACK_PLAN_PLACEMENTS, mesh, src, what)
        if src is not None:
            assert_tensors_close(f"{what}: output", model(x).detach(), sources[src](x).detach())

        # One style as the plan: applied to the module itself.
        sources = [built_on_rank(rank_ctx, r, colwise_linear) for r in ranks]
        linear = built_on_rank(rank_ctx, mesh.get_local_rank(), colwise_linear)
        tp.parallelize_module(linear, mesh, ColwiseParallel(output_layouts=Replicate()), **kwargs)
        placements = PARAMETER_PLACEMENTS[ColwiseParallel, nn.Linear]
        assert_shards_from(linear, sources, placements, mesh, src, f"{what} with one style")
        if src is not None:
            assert_tensors_close(
                f"{what} with one style: output", linear(x).detach(), sources[src](x).detach()
            )


# --- loss_parallel --------------------------------------------------------------------------


@conformance("tp.loss_parallel.vocab_parallel")
def test_loss_parallel(rank_ctx, impl):
    mesh = tp_mesh(rank_ctx)
    torch.manual_seed(11)
    with torch.device(rank_ctx.device):
        head = nn.Linear(8, 16)
    plain = copy.deepcopy(head)
    # The vocabulary-parallel output layer: logits stay a DTensor sharded on the vocabulary.
    tp.parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    x = torch.randn(6, 8, device=rank_ctx.device)
    target = torch.randint(0, 16, (6,), device=rank_ctx.device)
    target[2] = -100  # cross_entropy's default ignore_index

    for reduction in ("mean", "sum", "none"):
        head.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        plain_logits = plain(x)
        plain_logits.retain_grad()
        plain_loss = F.cross_entropy(plain_logits, target, reduction=reduction)
        plain_loss.sum().backward()

        what = f"loss_parallel, reduction={reduction!r}"
        logits_grads = []
        with CommTracer(mesh=mesh) as trace, tp.loss_parallel():
            logits = head(x)
            assert_dtensor(f"{what}: logits", logits, Shard(-1), mesh)
            logits.register_hook(logits_grads.append)
            loss = F.cross_entropy(logits, target, reduction=reduction)
            loss.sum().backward()
        assert_laid_out(f"{what}: loss", loss, plain_loss.detach(), Replicate(), mesh, local=False)
        (logits_grad,) = logits_grads
        assert_laid_out(
            f"{what}: logits gradient", logits_grad, plain_logits.grad, Shard(-1), mesh, local=False
        )
        assert_parameters(head, plain, PARAMETER_PLACEMENTS[ColwiseParallel, nn.Linear], mesh)
        gathered = [call.describe() for call in trace.select("all_gather")]
        assert not gathered, f"{what}: the sharded logits were gathered:\n" + "\n".join(gathered)


# --- loss_parallel under the implementation's data parallelism --------------------------------


def vocab_parallel_mlp() -> nn.Sequential:
    """An MLP whose last layer is a vocabulary head of 32 classes."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 32))


@conformance("fsdp.tp.loss_parallel")
def test_fully_shard_with_loss_parallel(rank_ctx, impl):
    mesh = rank_ctx.mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = vocab_parallel_mlp()
    reference = ReferenceModel(
        model, lambda params: torch.optim.SGD(params, lr=0.1), group=mesh["dp"].get_group()
    )
    plan = {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(),
        "3": ColwiseParallel(use_local_output=False),
    }
    tp.parallelize_module(model, mesh["tp"], plan)
    impl.fully_shard(model[3], mesh=mesh["dp"])
    impl.fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    # Each data-parallel replica trains on its own batch, the same on its TP ranks.
    torch.manual_seed(7 + mesh["dp"].get_local_rank())
    for step in range(2):
        x = torch.randn(4, 8, device=rank_ctx.device)
        target = torch.randint(0, 32, (4,), device=rank_ctx.device)
        with tp.loss_parallel():
            loss = F.cross_entropy(model(x), target)
            loss.backward()
        reference_loss = reference.forward_backward(
            lambda m, x=x, t=target: F.cross_entropy(m(x), t)
        )
        assert_dtensor(f"loss at step {step}", loss, Replicate(), mesh["tp"])
        assert_losses_equal(step, loss.to_local().detach(), reference_loss)
        reference_params = dict(reference.module.named_parameters())
        for name, param in model.named_parameters():
            assert_tensors_close(
                f"gradient of {name!r} at step {step}",
                param.grad.full_tensor(),
                reference_params[name].grad,
            )
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
    for name, param in model.named_parameters():
        expected = reference.module.get_parameter(name)
        assert_tensors_close(f"parameter {name!r} after training", param.full_tensor(), expected)
