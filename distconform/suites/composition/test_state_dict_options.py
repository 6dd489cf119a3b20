"""The distributed state-dict API (``torch.distributed.checkpoint.state_dict``) on a sharded
model and its optimizers: every ``StateDictOptions`` field, on every rank.

The model is two ``Linear(8, 8)`` layers, each sharded by the implementation under test over
a 1-D mesh of all ranks, then the root. The oracle is a plain copy of the same model (and of
its optimizers) built from the same seed on every rank and, for the optimizer, stepped on the
whole batch while each sharded rank steps on its slice of it (equal slices, so the mean of
the ranks' gradients is the plain gradient). What each option must do is the option's
documentation (``help(StateDictOptions)``):

* ``full_state_dict``: plain tensors equal to the plain model's on every rank; without it,
  ``Shard(0)`` DTensors whose local tensor is this rank's ``torch.chunk`` of the plain one.
  On a load, a full state dict given on every rank lands in every rank's shards.
* ``cpu_offload``: with ``full_state_dict``, only rank 0 gets the state dict, the other ranks
  an empty one; every tensor it returns lies on the CPU (checked where the device is not).
* ``ignore_frozen_params``: a parameter with ``requires_grad=False`` is left out, or kept.
* ``keep_submodule_prefixes`` with ``submodules`` (deprecated, still honoured): only the
  submodule's entries, under their full names or with the submodule's prefix removed.
* ``strict`` (the ``strict`` of ``load_state_dict``): a missing or an unexpected key raises
  and names the key; without it both are reported and every other value is loaded, the
  missing one keeping its value.
* ``broadcast_from_rank0``: a full state dict given on rank 0 only (an empty one elsewhere)
  lands in every rank's shards; it is refused without ``full_state_dict``.
* ``flatten_optimizer_state_dict``: the documented flat layout
  (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``) instead of the nested one;
  a flat state dict loads back.
* ``dsd_fqn_modifiers``: the name of the module method that tells the API which child a
  state-dict hook hides from the keys. A module that saves its child's parameters under its
  own names gives a full state dict that loads only when the option names its method.

Optimizer round trips: Adam's per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``) and
every ``param_groups`` hyperparameter, over two optimizers and three groups with their own
learning rates and betas, equal the plain optimizers' (full, sharded and flattened); loaded
into a freshly built model and optimizers with other values, they restore those of the plain
ones, and one more step trains exactly as the plain model does.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distconform.api import assert_tensors_close
from distconform.suites.cases import conformance

DIM = 8
ROWS_PER_RANK = 2
STEPS_BEFORE_SAVE = 2
#: The learning rates (first, second.weight, second.bias) and betas of the second optimizer's
#: second group: distinct, so that a group loaded in the wrong place or not at all shows.
TRAINED_LRS = (1e-2, 2e-2, 3e-2)
TRAINED_BETAS = (0.8, 0.95)
#: What a freshly built optimizer starts with, before a load must replace it.
FRESH_LRS = (0.5, 0.5, 0.5)
FRESH_BETAS = (0.9, 0.999)
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.second = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _save_inner_as_own(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for name in ("weight", "bias"):
        state_dict[prefix + name] = state_dict.pop(f"{prefix}inner.{name}")


def _load_own_into_inner(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for name in ("weight", "bias"):
        if prefix + name in state_dict:
            state_dict[f"{prefix}inner.{name}"] = state_dict.pop(prefix + name)


class RenamingWrapper(nn.Module):
    """A wrapper whose state dict keeps its wrapped layer's names (``weight``, not
    ``inner.weight``), as a model does that wraps a layer and keeps reading its checkpoints;
    ``hidden_children`` says so to the state-dict API under a name of its own."""

    FQN_MODIFIERS = "hidden_children"

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM, DIM)
        self.register_state_dict_post_hook(_save_inner_as_own)
        self.register_load_state_dict_pre_hook(_load_own_into_inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def hidden_children(self) -> dict[str, str]:
        """Each state-dict key this module shows, mapped to the child that holds it."""
        return {"weight": "inner", "bias": "inner"}


# --- building and the oracle -------------------------------------------------------------------


def data_parallel_mesh(rank_ctx) -> DeviceMesh:
    return rank_ctx.mesh(rank_ctx.world_size, ("dp",))


def sharded_copy(rank_ctx, impl, plain: nn.Module) -> nn.Module:
    """A copy of ``plain`` with each child and then the root sharded by the implementation."""
    model = copy.deepcopy(plain)
    mesh = data_parallel_mesh(rank_ctx)
    for child in model.children():
        impl.fully_shard(child, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    return model


def plain_model(rank_ctx, seed: int) -> TwoLayers:
    torch.manual_seed(seed)
    with torch.device(rank_ctx.device):
        return TwoLayers()


def expected_shard(full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` under ``Shard(0)`` over the world: its torch.chunk."""
    rank = dist.get_rank()
    chunks = torch.chunk(full.detach(), dist.get_world_size(), dim=0)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def as_shards(mesh: DeviceMesh, state: dict[str, torch.Tensor]) -> dict[str, DTensor]:
    """``state`` laid out as ``Shard(0)`` DTensors, each rank slicing its own copy."""
    return {
        name: distribute_tensor(value.detach(), mesh, [Shard(0)], src_data_rank=None)
        for name, value in state.items()
    }


def assert_sharded(what: str, value: Any, full: torch.Tensor, *, exact: bool = True) -> None:
    """``value`` is a ``Shard(0)`` DTensor holding this rank's chunk of ``full``."""
    assert isinstance(value, DTensor), (
        f"{what} on rank {dist.get_rank()}: a {type(value).__name__}, expected a sharded DTensor"
    )
    assert tuple(value.placements) == (Shard(0),), (
        f"{what}: placements {value.placements}, expected (Shard(0),)"
    )
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {}
    assert_tensors_close(what, value.to_local(), expected_shard(full), **tolerance)


def assert_full(what: str, value: Any, full: torch.Tensor, *, exact: bool = True) -> None:
    """``value`` is a plain tensor equal to ``full``."""
    assert isinstance(value, torch.Tensor) and not isinstance(value, DTensor), (
        f"{what} on rank {dist.get_rank()}: a {type(value).__name__}, expected a full plain tensor"
    )
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {}
    assert_tensors_close(what, value, full.detach(), **tolerance)


def assert_keys(what: str, state: dict, expected: Iterable[str]) -> None:
    assert sorted(state) == sorted(expected), (
        f"{what} on rank {dist.get_rank()}: keys {sorted(state)}, expected {sorted(expected)}"
    )


def assert_on_cpu(what: str, state: dict) -> None:
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert local.device.type == "cpu", f"{what}: {name!r} lies on {local.device}, not the CPU"


def assert_on_device(what: str, state: dict, device: torch.device) -> None:
    for name, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        assert local.device.type == device.type, (
            f"{what}: {name!r} lies on {local.device}, expected the rank's {device}"
        )


def assert_model_shards(what: str, model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        assert_sharded(f"{what}: parameter {name!r}", param, expected[name])


# --- model state dicts --------------------------------------------------------------------------


@conformance("dcp.state_dict.model_options")
def test_model_state_dict_options(rank_ctx, impl):
    device = rank_ctx.device
    plain = plain_model(rank_ctx, 0)
    model = sharded_copy(rank_ctx, impl, plain)
    # Frozen on the sharded parameters, the ones the model registers: the state-dict API reads
    # requires_grad when it is called.
    model.first.requires_grad_(False)
    saved = plain.state_dict()
    trained = ("second.weight", "second.bias")

    sharded = dsd.get_model_state_dict(
        model,
        options=dsd.StateDictOptions(
            full_state_dict=False,
            cpu_offload=False,
            ignore_frozen_params=False,
            broadcast_from_rank0=False,
        ),
    )
    assert_keys("sharded model state dict", sharded, saved)
    for name, value in sharded.items():
        assert_sharded(f"sharded model state dict: {name!r}", value, saved[name])
    assert_on_device("sharded model state dict", sharded, device)

    full = dsd.get_model_state_dict(model, options=dsd.StateDictOptions(full_state_dict=True))
    assert_keys("full model state dict", full, saved)
    for name, value in full.items():
        assert_full(f"full model state dict: {name!r}", value, saved[name])
    assert_on_device("full model state dict", full, device)

    offloaded = dsd.get_model_state_dict(
        model, options=dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank_ctx.rank == 0:
        assert_keys("full, CPU-offloaded model state dict on rank 0", offloaded, saved)
        for name, value in offloaded.items():
            assert_full(f"full, CPU-offloaded state dict: {name!r}", value, saved[name])
        assert_on_cpu("full, CPU-offloaded model state dict", offloaded)
    else:
        assert offloaded == {}, (
            f"full, CPU-offloaded model state dict on rank {rank_ctx.rank}: keys "
            f"{sorted(offloaded)}, expected an empty one (only rank 0 gets it)"
        )

    offloaded_shards = dsd.get_model_state_dict(
        model, options=dsd.StateDictOptions(cpu_offload=True)
    )
    assert_keys("sharded, CPU-offloaded model state dict", offloaded_shards, saved)
    for name, value in offloaded_shards.items():
        assert_sharded(f"sharded, CPU-offloaded state dict: {name!r}", value, saved[name])
    assert_on_cpu("sharded, CPU-offloaded model state dict", offloaded_shards)

    without_frozen = dsd.get_model_state_dict(
        model, options=dsd.StateDictOptions(ignore_frozen_params=True)
    )
    assert_keys("model state dict ignoring frozen parameters", without_frozen, trained)

    # submodules is deprecated (torch warns) and still honoured.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        prefixed = dsd.get_model_state_dict(
            model,
            submodules={model.second},
            options=dsd.StateDictOptions(keep_submodule_prefixes=True),
        )
        unprefixed = dsd.get_model_state_dict(
            model,
            submodules={model.second},
            options=dsd.StateDictOptions(keep_submodule_prefixes=False),
        )
    assert_keys("state dict of submodule 'second', prefixes kept", prefixed, trained)
    assert_keys(
        "state dict of submodule 'second', prefixes removed", unprefixed, ("weight", "bias")
    )
    for name in ("weight", "bias"):
        assert_sharded(f"submodule state dict: {name!r}", unprefixed[name], saved[f"second.{name}"])

    with pytest.raises(ValueError, match="full_state_dict"):
        dsd.get_model_state_dict(model, options=dsd.StateDictOptions(broadcast_from_rank0=True))


@conformance("dcp.state_dict.model_loading")
def test_model_state_dict_loading(rank_ctx, impl):
    mesh = data_parallel_mesh(rank_ctx)
    old = plain_model(rank_ctx, 0)
    loaded = plain_model(rank_ctx, 1).state_dict()
    old_values = old.state_dict()

    def fresh() -> nn.Module:
        return sharded_copy(rank_ctx, impl, old)

    model = fresh()
    result = dsd.set_model_state_dict(model, as_shards(mesh, loaded))
    assert (result.missing_keys, result.unexpected_keys) == ([], []), result
    assert_model_shards("after loading a sharded state dict", model, loaded)

    model = fresh()
    # The API replaces the values of the dict it is given: each load gets its own.
    dsd.set_model_state_dict(
        model, dict(loaded), options=dsd.StateDictOptions(full_state_dict=True)
    )
    assert_model_shards("after loading a full state dict on every rank", model, loaded)

    model = fresh()
    dsd.set_model_state_dict(
        model,
        dict(loaded) if rank_ctx.rank == 0 else {},
        options=dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    assert_model_shards("after broadcasting rank 0's full state dict", model, loaded)

    with pytest.raises(ValueError, match="full_state_dict"):
        dsd.set_model_state_dict(
            fresh(),
            as_shards(mesh, loaded),
            options=dsd.StateDictOptions(broadcast_from_rank0=True),
        )

    # strict: a missing key, then an unexpected one, raises and names the key.
    missing = as_shards(mesh, {k: v for k, v in loaded.items() if k != "second.bias"})
    with pytest.raises(RuntimeError, match=re.escape("second.bias")):
        dsd.set_model_state_dict(fresh(), missing, options=dsd.StateDictOptions(strict=True))
    unexpected = {**as_shards(mesh, loaded), "third.weight": loaded["first.weight"]}
    with pytest.raises(RuntimeError, match=re.escape("third.weight")):
        dsd.set_model_state_dict(fresh(), unexpected, options=dsd.StateDictOptions(strict=True))

    # Not strict: both reported, everything else loaded, the missing one left as it was.
    model = fresh()
    partial = {**missing, "third.weight": loaded["first.weight"]}
    result = dsd.set_model_state_dict(model, partial, options=dsd.StateDictOptions(strict=False))
    assert (sorted(result.missing_keys), sorted(result.unexpected_keys)) == (
        ["second.bias"],
        ["third.weight"],
    ), f"a non-strict load reported {result}"
    assert_model_shards(
        "after a non-strict load without 'second.bias'",
        model,
        {**loaded, "second.bias": old_values["second.bias"]},
    )

    # A module whose state dict hides a child: the load must be told the hook's method.
    torch.manual_seed(0)
    with torch.device(rank_ctx.device):
        wrapper = RenamingWrapper()
    sharded_wrapper = sharded_copy(rank_ctx, impl, wrapper)
    torch.manual_seed(1)
    with torch.device(rank_ctx.device):
        source = RenamingWrapper()
    saved = source.state_dict()
    assert_keys("the plain wrapper's state dict", saved, ("weight", "bias"))
    dsd.set_model_state_dict(
        sharded_wrapper,
        dict(saved),
        options=dsd.StateDictOptions(
            full_state_dict=True, dsd_fqn_modifiers=RenamingWrapper.FQN_MODIFIERS
        ),
    )
    assert_model_shards(
        "the renaming wrapper after a full load",
        sharded_wrapper,
        {f"inner.{name}": value for name, value in saved.items()},
    )


# --- optimizer state dicts ----------------------------------------------------------------------


def adam_optimizers(
    model: nn.Module, lrs: tuple[float, float, float], betas: tuple[float, float]
) -> list[torch.optim.Optimizer]:
    """Two optimizers: one over ``first``, one with a group per parameter of ``second``."""
    return [
        torch.optim.Adam(model.first.parameters(), lr=lrs[0]),
        torch.optim.Adam(
            [
                {"params": [model.second.weight], "lr": lrs[1]},
                {"params": [model.second.bias], "lr": lrs[2], "betas": betas},
            ]
        ),
    ]


def train_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    step: int,
    rows: slice,
    device: torch.device,
) -> None:
    """One step on ``rows`` of the step's batch, the same batch on every rank."""
    torch.manual_seed(100 + step)
    inputs = torch.randn(ROWS_PER_RANK * dist.get_world_size(), DIM, device=device)
    model(inputs[rows]).pow(2).mean().backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def hyperparameters(group: dict) -> dict:
    """A group's values other than its parameters; a sequence (betas) as a tuple, since a
    full or flattened state dict may carry it as a list."""
    return {
        key: tuple(value) if isinstance(value, list) else value
        for key, value in group.items()
        if key != "params"
    }


def plain_optimizer_state(
    model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> tuple[dict[str, dict], list[dict]]:
    """The plain optimizers' state by parameter name, and their groups with names for params."""
    names = {param: name for name, param in model.named_parameters()}
    state: dict[str, dict] = {}
    groups: list[dict] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            groups.append({**hyperparameters(group), "params": [names[p] for p in group["params"]]})
            for param in group["params"]:
                state[names[param]] = optimizer.state[param]
    return state, groups


def assert_adam_state(
    what: str, state: dict, expected: dict[str, dict], *, full: bool, exact: bool = False
) -> None:
    assert_keys(f"{what}: parameters with state", state, expected)
    for name, per_param in state.items():
        assert_keys(f"{what}: state of {name!r}", per_param, ADAM_STATE)
        assert float(per_param["step"]) == float(expected[name]["step"]), (
            f"{what}: step of {name!r} is {float(per_param['step'])}, expected "
            f"{float(expected[name]['step'])}"
        )
        for key in ("exp_avg", "exp_avg_sq"):
            check = assert_full if full else assert_sharded
            check(f"{what}: {key} of {name!r}", per_param[key], expected[name][key], exact=exact)


def assert_groups(what: str, groups: list[dict], expected: list[dict]) -> None:
    assert len(groups) == len(expected), (
        f"{what}: {len(groups)} param groups, expected {len(expected)}"
    )
    for index, (group, wanted) in enumerate(zip(groups, expected, strict=True)):
        group = {**hyperparameters(group), "params": list(group["params"])}
        wanted = {**hyperparameters(wanted), "params": list(wanted["params"])}
        assert group == wanted, f"{what}: param group {index} is {group}, expected {wanted}"


def assert_loaded_optimizers(
    what: str,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    expected_state: dict[str, dict],
    expected_groups: list[dict],
) -> None:
    state, groups = plain_optimizer_state(model, optimizers)
    assert_adam_state(what, state, expected_state, full=False)
    assert_groups(what, groups, expected_groups)


@conformance("dcp.state_dict.optimizer_round_trip")
def test_optimizer_state_dict_round_trips(rank_ctx, impl):
    rank, world = rank_ctx.rank, rank_ctx.world_size
    my_rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    all_rows = slice(0, ROWS_PER_RANK * world)
    plain = plain_model(rank_ctx, 0)
    model = sharded_copy(rank_ctx, impl, plain)
    plain_optimizers = adam_optimizers(plain, TRAINED_LRS, TRAINED_BETAS)
    optimizers = adam_optimizers(model, TRAINED_LRS, TRAINED_BETAS)
    for step in range(STEPS_BEFORE_SAVE):
        train_step(plain, plain_optimizers, step, all_rows, rank_ctx.device)
        train_step(model, optimizers, step, my_rows, rank_ctx.device)
    expected_state, expected_groups = plain_optimizer_state(plain, plain_optimizers)
    expected_params = {name: param.detach() for name, param in plain.named_parameters()}

    full_options = dsd.StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=False)
    full_optim = dsd.get_optimizer_state_dict(model, optimizers, options=full_options)
    assert_keys("full optimizer state dict", full_optim, ("state", "param_groups"))
    assert_adam_state("full optimizer state dict", full_optim["state"], expected_state, full=True)
    assert_groups("full optimizer state dict", full_optim["param_groups"], expected_groups)

    # One optimizer of the two: its own parameters and groups only.
    second_only = dsd.get_optimizer_state_dict(model, optimizers[1], options=full_options)
    assert_adam_state(
        "full state dict of the second optimizer",
        second_only["state"],
        {name: expected_state[name] for name in ("second.weight", "second.bias")},
        full=True,
    )
    assert_groups(
        "state dict of the second optimizer", second_only["param_groups"], expected_groups[1:]
    )

    sharded_model, sharded_optim = dsd.get_state_dict(model, optimizers)
    assert_adam_state(
        "sharded optimizer state dict", sharded_optim["state"], expected_state, full=False
    )
    assert_groups("sharded optimizer state dict", sharded_optim["param_groups"], expected_groups)
    for name, value in sharded_model.items():
        assert_sharded(
            f"sharded model state dict: {name!r}", value, expected_params[name], exact=False
        )

    full_model, full_optim_too = dsd.get_state_dict(model, optimizers, options=full_options)
    for name, value in full_model.items():
        assert_full(f"full model state dict: {name!r}", value, expected_params[name], exact=False)
    assert_adam_state(
        "full state dict's optimizer", full_optim_too["state"], expected_state, full=True
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        submodule_model, _ = dsd.get_state_dict(model, optimizers, submodules={model.second})
    assert_keys(
        "get_state_dict of submodule 'second'", submodule_model, ("second.weight", "second.bias")
    )

    flat = dsd.get_optimizer_state_dict(
        model, optimizers, options=dsd.StateDictOptions(flatten_optimizer_state_dict=True)
    )
    flat_keys = [f"state.{name}.{key}" for name in expected_state for key in ADAM_STATE]
    for group in expected_groups:
        flat_keys += [
            f"param_groups.{name}.{key}"
            for name in group["params"]
            for key in hyperparameters(group)
        ]
    assert_keys("flattened optimizer state dict", flat, flat_keys)
    for group in expected_groups:
        for name in group["params"]:
            for key, value in hyperparameters(group).items():
                found = hyperparameters({key: flat[f"param_groups.{name}.{key}"]})[key]
                assert found == value, (
                    f"flattened optimizer state dict: {key} of {name!r} is {found!r}, "
                    f"expected {value!r}"
                )
    for name in expected_state:
        for key in ("exp_avg", "exp_avg_sq"):
            assert_sharded(
                f"flattened state dict: {key} of {name!r}",
                flat[f"state.{name}.{key}"],
                expected_state[name][key],
                exact=False,
            )

    def fresh(seed: int) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
        fresh_model = sharded_copy(rank_ctx, impl, plain_model(rank_ctx, seed))
        return fresh_model, adam_optimizers(fresh_model, FRESH_LRS, FRESH_BETAS)

    # A full state dict, loaded by the model and optimizer functions, then by set_state_dict.
    loads = {
        "set_model/optimizer_state_dict": lambda m, o: (
            dsd.set_model_state_dict(m, copy.deepcopy(full_model), options=full_options),
            dsd.set_optimizer_state_dict(m, o, copy.deepcopy(full_optim), options=full_options),
        ),
        "set_state_dict": lambda m, o: dsd.set_state_dict(
            m,
            o,
            model_state_dict=copy.deepcopy(full_model),
            optim_state_dict=copy.deepcopy(full_optim),
            options=full_options,
        ),
    }
    restored = []
    for seed, (how, load) in enumerate(loads.items(), start=7):
        fresh_model, fresh_optimizers = fresh(seed)
        load(fresh_model, fresh_optimizers)
        what = f"after {how} of a full state dict"
        for name, param in fresh_model.named_parameters():
            assert_sharded(f"{what}: parameter {name!r}", param, expected_params[name], exact=False)
        assert_loaded_optimizers(
            what, fresh_model, fresh_optimizers, expected_state, expected_groups
        )
        restored.append((how, fresh_model, fresh_optimizers))

    fresh_model, fresh_optimizers = fresh(9)
    dsd.set_state_dict(
        fresh_model,
        fresh_optimizers,
        model_state_dict=dsd.get_model_state_dict(model),
        optim_state_dict=flat,
    )
    assert_loaded_optimizers(
        "after loading the flattened state dict",
        fresh_model,
        fresh_optimizers,
        expected_state,
        expected_groups,
    )

    # Training continues as the plain model's does.
    train_step(plain, plain_optimizers, STEPS_BEFORE_SAVE, all_rows, rank_ctx.device)
    for how, fresh_model, fresh_optimizers in restored:
        train_step(fresh_model, fresh_optimizers, STEPS_BEFORE_SAVE, my_rows, rank_ctx.device)
        for name, param in fresh_model.named_parameters():
            assert_sharded(
                f"one step after {how}: parameter {name!r}",
                param,
                dict(plain.named_parameters())[name],
                exact=False,
            )
