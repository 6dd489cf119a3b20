"""The harness on an accelerator: placement, binding, collectives, memory and events.

Run with the device under test, e.g. ``python -m pytest tests/accelerator --device cuda
--backend nccl`` (``python -m distconform gpu-check`` does, at world size 1), or with ranks
sharing one device: ``--backend staged_gloo --dist-share-devices``. On the CPU every test
skips before any rank starts (``requires_accelerator``). Expected values come from the
launch's arithmetic (which device a rank must own, what a sum of ranks is), never from
what the device reports about itself.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distconform.extension import device_type as registered_device
from distconform.harness import torch_api
from distconform.harness.controller.config import binds_device_id
from distconform.harness.devices import current_stream_set

pytestmark = pytest.mark.requires_accelerator


def expected_device_index(rank: int, world_size: int) -> int:
    # One leased device per rank (the ranks see only theirs), or, sharing, round-robin on
    # the devices there are.
    return rank % min(world_size, torch.accelerator.device_count())


@pytest.mark.world_size(1, 2)
def test_each_rank_owns_the_device_the_launch_gave_it(rank_ctx):
    index = expected_device_index(rank_ctx.rank, rank_ctx.world_size)
    expected = torch.device(rank_ctx.device_type, index)
    assert rank_ctx.device == expected
    assert torch.accelerator.current_device_index() == expected.index
    assert rank_ctx.device_type != "cpu"


@pytest.mark.world_size(1, 2)
def test_ranks_see_only_their_leased_devices(rank_ctx):
    registered = registered_device(rank_ctx.device_type)
    variable = registered.visibility_variable if registered else None
    if variable is None:
        pytest.skip(f"no visibility variable is known for {rank_ctx.device_type}")
    if variable not in os.environ:
        pytest.skip(f"{variable} is not set: the ranks share devices and lease none")
    visible = os.environ[variable].split(",")
    assert len(visible) == torch.accelerator.device_count()
    assert len(visible) <= rank_ctx.world_size


@pytest.mark.world_size(1, 2)
def test_default_group_is_bound_to_the_device_when_the_backend_allows(rank_ctx):
    bound = dist.group.WORLD.bound_device_id
    if binds_device_id(rank_ctx.backend):
        assert bound == rank_ctx.device
    else:
        assert bound is None


@pytest.mark.world_size(1, 2)
def test_factories_under_the_rank_device_allocate_there(rank_ctx):
    with torch.device(rank_ctx.device):
        made = torch.ones(4)
        layer = torch.nn.Linear(3, 2)
    assert made.device == rank_ctx.device
    assert layer.weight.device == rank_ctx.device


@pytest.mark.world_size(1, 2)
def test_collectives_on_device_tensors_give_the_sums_and_pieces_of_the_ranks(rank_ctx):
    device, rank, world = rank_ctx.device, rank_ctx.rank, rank_ctx.world_size
    summed = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(summed)
    assert summed.device == device
    assert summed.tolist() == [world * (world + 1) / 2] * 3

    gathered = torch.empty(2 * world, device=device)
    torch_api.all_gather_single(gathered, torch.tensor([rank, -rank], device=device) * 1.0)
    assert gathered.tolist() == [v for r in range(world) for v in (float(r), float(-r))]

    scattered = torch.empty(2, device=device)
    contribution = torch.arange(2 * world, device=device, dtype=torch.float32) * (rank + 1)
    torch_api.reduce_scatter_single(scattered, contribution)
    factor = world * (world + 1) / 2
    assert scattered.tolist() == [factor * (2 * rank), factor * (2 * rank + 1)]

    broadcast = torch.full((2,), float(rank), device=device)
    dist.broadcast(broadcast, src=world - 1)
    assert broadcast.tolist() == [float(world - 1)] * 2


@pytest.mark.world_size(1)
def test_allocator_statistics_follow_allocations(rank_ctx):
    device = rank_ctx.device
    torch.accelerator.synchronize(device)
    torch.accelerator.reset_peak_memory_stats(device)
    before = torch.accelerator.memory_allocated(device)
    block = torch.empty(4 * 2**20, dtype=torch.uint8, device=device)
    during = torch.accelerator.memory_allocated(device)
    del block
    after = torch.accelerator.memory_allocated(device)
    assert during - before >= 4 * 2**20
    assert after < during
    assert torch.accelerator.max_memory_allocated(device) >= during


@pytest.mark.world_size(1)
def test_a_stream_waits_for_the_event_it_was_given(rank_ctx):
    device = rank_ctx.device
    producer = torch.Stream(device=device)
    consumer = torch.Stream(device=device)
    source = torch.zeros(1 << 20, device=device)
    producer.wait_stream(torch.accelerator.current_stream(device))  # the zeros come first
    with current_stream_set(producer):
        source.fill_(3.0)
        ready = torch.Event(device=device)
        ready.record(producer)
    consumer.wait_event(ready)
    with current_stream_set(consumer):
        total = source.sum()
    consumer.synchronize()
    assert ready.query()
    assert total.item() == 3.0 * (1 << 20)


@pytest.mark.world_size(2)
def test_reference_fully_shard_trains_on_the_device(rank_ctx):
    from distconform.impl.api import load_implementation

    impl = load_implementation("reference")
    mesh = rank_ctx.mesh((rank_ctx.world_size,))
    with torch.device(rank_ctx.device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        baseline = [p.detach().clone() for p in model.parameters()]
    impl.fully_shard(model, mesh=mesh)
    for param in model.parameters():
        assert param.to_local().device == rank_ctx.device
    inputs = torch.ones(4, 8, device=rank_ctx.device) * (rank_ctx.rank + 1)
    model(inputs).sum().backward()
    for param, before in zip(model.parameters(), baseline, strict=True):
        assert param.grad is not None
        assert param.grad.to_local().device == rank_ctx.device
        assert param.full_tensor().shape == before.shape
