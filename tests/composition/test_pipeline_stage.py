"""Which pipeline stages ``build_pipeline`` drives itself (``DataParallelStage``) and which it
leaves to ``torch.distributed.pipelining``: torch's own ``FSDPModule`` is driven by the engine,
so driving it again would flip its flags behind the engine's back; the reference (any other
implementation) is driven through the outermost managed modules of the stage.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from distconform.impl.api import load_implementation
from distconform.suites.composition.pipeline import (
    DataParallelStage,
    LayerChunk,
    MLPModule,
    PipelineLayout,
    build_pipeline,
    data_parallel_modules,
    layer_stack,
)


def chunk_of_two(device: torch.device) -> LayerChunk:
    return LayerChunk(layer_stack(lambda: MLPModule(4), 2), range(2)).to(device)


@pytest.mark.world_size(2)
def test_outermost_managed_modules_are_driven(rank_ctx):
    reference = load_implementation("reference")
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("dp",))

    layers_only = chunk_of_two(rank_ctx.device)
    for layer in layers_only.layers.values():
        reference.fully_shard(layer, mesh=mesh)
    assert data_parallel_modules(layers_only, reference) == list(layers_only.layers.values())

    with_root = chunk_of_two(rank_ctx.device)
    for module in [*with_root.layers.values(), with_root]:
        reference.fully_shard(module, mesh=mesh)
    assert data_parallel_modules(with_root, reference) == [with_root]

    assert data_parallel_modules(chunk_of_two(rank_ctx.device), reference) == []


@pytest.mark.world_size(2)
def test_torch_fsdp_module_is_left_to_the_engine(rank_ctx):
    torch_impl = load_implementation("torch")
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("dp",))
    chunk = chunk_of_two(rank_ctx.device)
    for module in [*chunk.layers.values(), chunk]:
        torch_impl.fully_shard(module, mesh=mesh)
    assert data_parallel_modules(chunk, torch_impl) == []


@pytest.mark.world_size(2)
@pytest.mark.parametrize("impl_name", ["reference", "torch"])
def test_build_pipeline_picks_the_stage_class(rank_ctx, impl_name):
    implementation = load_implementation(impl_name)
    # Pipeline of 2 ranks, each its own data-parallel group of one.
    mesh = rank_ctx.mesh((1, rank_ctx.world_size), ("dp", "pp"))
    layout = PipelineLayout("1F1B", mesh["pp"].get_local_rank(), rank_ctx.world_size, 4)

    def distribute(chunk: LayerChunk) -> None:
        for module in [*chunk.layers.values(), chunk]:
            implementation.fully_shard(module, mesh=mesh["dp"])

    pipeline = build_pipeline(
        layer_stack(lambda: MLPModule(4), 4),
        layout,
        distribute=distribute,
        pp_group=mesh["pp"].get_group(),
        device=rank_ctx.device,
        n_microbatches=2,
        impl=implementation,
    )
    (stage,) = pipeline.stages
    if impl_name == "torch":
        assert type(stage) is PipelineStage
    else:
        assert isinstance(stage, DataParallelStage)
        assert stage.data_parallel_modules == pipeline.chunks
