"""Distributed checkpoints of sharded models and optimizers, pipeline stages included.

Saved and loaded with ``torch.distributed.checkpoint`` and the public helpers of
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``).

* Same layout: train, save, train on; then a freshly initialised model and optimizer (another
  seed) load the checkpoint and train the same steps: the continued losses are bitwise equal.
* Another world size or mesh, with the global batch fixed (each data-parallel rank takes its
  slice of the same rows, the loss is the mean over the data-parallel group): the continued
  losses equal at fp32 default tolerance.
* A pipeline stage: every stage saves its own layers under their original FQNs; the whole,
  unpipelined model then loads that checkpoint, and each parameter and Adam state equals the
  stage's bitwise.

Another world size without a second pool: the test runs at world size W and builds the
smaller world out of meshes of the W ranks. ``fsdp-half`` is a ``(2, W/2)`` mesh whose two
rows each shard the model over W/2 ranks on their own (``fully_shard`` on the row's sub-mesh),
so each row is an independent world of W/2 ranks. Saving from it writes each shard twice (the
planner keeps one); loading into it has both rows read the same checkpoint. This keeps the
save and the load in one test on one warm pool (no ordering between tests, no checkpoint
left in a shared directory between sessions), and both directions, W -> W/2 and W/2 -> W,
are covered. The checkpoint directory is made by rank 0 and shared with
``broadcast_object_list``; rank 0 removes it at the end.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import assert_tensors_close
from distconform.suites.cases import conformance
from distconform.suites.composition.pipeline import (
    LayerChunk,
    MLPModule,
    PipelineLayout,
    build_pipeline,
    layer_stack,
    replica_batches,
    whole_model,
)
from distconform.suites.models import MLPStack

DIM = 16
GLOBAL_ROWS = 8
STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 3


@contextlib.contextmanager
def shared_checkpoint_dir() -> Iterator[str]:
    """A temporary directory made by rank 0 and known to every rank; removed afterwards."""
    holder = [tempfile.mkdtemp(prefix="distconform-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    try:
        yield holder[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_state, optim_state = dsd.get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_state, optim_state = dsd.get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    dsd.set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


# --- layouts -------------------------------------------------------------------------------------


@dataclass
class DataParallel:
    """A model laid out over some of the ranks; the slice of the global batch this rank takes."""

    model: nn.Module
    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device

    def train_step(self, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
        """One step on this rank's slice of the global batch; returns the global mean loss."""
        ((inputs, labels),) = replica_batches(step, 1, GLOBAL_ROWS, DIM, torch.float32, self.device)
        rows = GLOBAL_ROWS // self.size
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        loss = (self.model(inputs[mine]) - labels[mine]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=self.group)
        return global_loss / self.size


# The layout names make the parameter ids (``fsdp-to-hsdp``): the case table gives the items
# whose ids hold the token ``hsdp`` or ``replicate`` that capability.
LAYOUTS = ("fsdp", "fsdp-half", "hsdp", "replicate")


def lay_out(impl, rank_ctx, layout: str, model: nn.Module) -> DataParallel:
    world = rank_ctx.world_size
    if layout in ("fsdp", "replicate"):
        mesh = rank_ctx.mesh(world, ("dp",))
        apply = impl.fully_shard if layout == "fsdp" else impl.replicate
        group, rank, size = mesh.get_group(), mesh.get_local_rank(), world
    elif layout == "fsdp-half":
        rows = rank_ctx.mesh((2, world // 2), ("row", "dp"))
        mesh = rows["dp"]
        apply = impl.fully_shard
        group, rank, size = mesh.get_group(), mesh.get_local_rank(), world // 2
    elif layout == "hsdp":
        mesh = rank_ctx.mesh((2, world // 2), ("dp_replicate", "dp_shard"))
        apply = impl.fully_shard
        group, rank, size = dist.group.WORLD, rank_ctx.rank, world
    else:
        raise ValueError(layout)
    for child in model:
        apply(child, mesh=mesh)
    apply(model, mesh=mesh)
    return DataParallel(model, group, rank, size, rank_ctx.device)


def checkpoint_grid() -> list:
    pairs = [
        ("fsdp", "fsdp"),
        ("replicate", "replicate"),
        ("fsdp", "fsdp-half"),
        ("fsdp-half", "fsdp"),
        ("fsdp", "hsdp"),
        ("hsdp", "fsdp-half"),
        ("fsdp", "replicate"),
    ]
    return [pytest.param(saved, loaded, id=f"{saved}-to-{loaded}") for saved, loaded in pairs]


@conformance("dcp.continue_training")
@pytest.mark.parametrize(("saved_layout", "loaded_layout"), checkpoint_grid())
def test_checkpoint_continues_training(rank_ctx, impl, saved_layout, loaded_layout):
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        saved_model = MLPStack(DIM)
    saved = lay_out(impl, rank_ctx, saved_layout, saved_model)
    saved_optimizer = adam(saved.model.parameters())
    for step in range(STEPS_BEFORE_SAVE):
        saved.train_step(saved_optimizer, step)

    with shared_checkpoint_dir() as path:
        save(path, saved.model, saved_optimizer)
        continued = [
            saved.train_step(saved_optimizer, step)
            for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
        ]

        torch.manual_seed(7)  # a different initialisation, so that only the load can match
        with torch.device(rank_ctx.device):
            loaded_model = MLPStack(DIM)
        loaded = lay_out(impl, rank_ctx, loaded_layout, loaded_model)
        loaded_optimizer = adam(loaded.model.parameters())
        load(path, loaded.model, loaded_optimizer)

    reloaded = [
        loaded.train_step(loaded_optimizer, step)
        for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_SAVE)
    ]
    for offset, (expected, actual) in enumerate(zip(continued, reloaded, strict=True)):
        what = f"loss {offset} steps after loading ({saved_layout} -> {loaded_layout})"
        if saved_layout == loaded_layout:
            assert torch.equal(actual, expected), (
                f"{what}: {actual.item()!r} != {expected.item()!r}"
            )
        else:
            assert_tensors_close(what, actual, expected)


# --- a pipeline stage --------------------------------------------------------------------------

N_LAYERS = 8
PP_SIZE = 2
N_MICROBATCHES = 4


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@conformance("pp.dcp.stage_fqns")
def test_pipeline_stage_checkpoint_keeps_fqns(rank_ctx, impl):
    dp_size = rank_ctx.world_size // PP_SIZE
    mesh = rank_ctx.mesh((dp_size, PP_SIZE), ("dp", "pp"))
    layout = PipelineLayout("1F1B", mesh["pp"].get_local_rank(), PP_SIZE, N_LAYERS)

    def distribute(chunk: LayerChunk) -> None:
        for module in [*chunk.layers.values(), chunk]:
            impl.fully_shard(module, mesh=mesh["dp"])

    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        layers = layer_stack(lambda: MLPModule(10), N_LAYERS)
    pipeline = build_pipeline(
        layers,
        layout,
        distribute=distribute,
        pp_group=mesh["pp"].get_group(),
        device=rank_ctx.device,
        n_microbatches=N_MICROBATCHES,
        impl=impl,
    )
    (chunk,) = pipeline.chunks
    optimizer = adam(chunk.parameters())
    inputs, labels = replica_batches(0, dp_size, 8, 10, torch.float32, rank_ctx.device)[
        mesh["dp"].get_local_rank()
    ]
    pipeline.step(inputs, labels)
    optimizer.step()

    torch.manual_seed(7)
    with torch.device(rank_ctx.device):
        whole = whole_model(layer_stack(lambda: MLPModule(10), N_LAYERS))
    flat = rank_ctx.mesh(rank_ctx.world_size, ("dp",))
    for layer in whole.layers.values():
        impl.fully_shard(layer, mesh=flat)
    impl.fully_shard(whole, mesh=flat)
    whole_optimizer = adam(whole.parameters())

    with shared_checkpoint_dir() as path:
        save(path, chunk, optimizer)
        saved_keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        expected_keys = {f"model.{name}" for name, _ in whole.named_parameters()}
        missing = sorted(expected_keys - saved_keys)
        assert not missing, f"the stage checkpoints lack the original FQNs {missing}"
        load(path, whole, whole_optimizer)

    # Every rank gathers the whole model's values in the same order (world collectives), then
    # those of its own stage (collectives over its data-parallel group).
    whole_params = {name: full_value(p.detach()) for name, p in whole.named_parameters()}
    whole_state = {
        name: {key: full_value(value) for key, value in whole_optimizer.state[p].items()}
        for name, p in whole.named_parameters()
    }
    for name, param in chunk.named_parameters():
        assert torch.equal(whole_params[name], full_value(param.detach())), name
        stage_state = optimizer.state[param]
        assert stage_state, f"{name} has no optimizer state after a step"
        for key, value in stage_state.items():
            assert torch.equal(whole_state[name][key], full_value(value)), f"{name} {key}"
