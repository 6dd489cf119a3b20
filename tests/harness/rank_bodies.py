"""Functions the outcome tests run on ranks: each one misbehaves on one rank in one way."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

from distconform.harness import get_rank_context


def all_reduce_rank_sum() -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def raise_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()


def raise_everywhere() -> None:
    raise KeyError("the same error on every rank")


def exit_on(bad_rank: int, code: int) -> None:
    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.barrier()


def signal_on(bad_rank: int, signum: int) -> None:
    if dist.get_rank() == bad_rank:
        if signum == signal.SIGSEGV:
            ctypes.string_at(0)  # a real segmentation fault, not a raised signal
        os.kill(os.getpid(), signum)
        time.sleep(10)
    dist.barrier()


def spin_forever() -> None:
    while True:
        pass


def loop_on(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        spin_forever()
    dist.barrier()


def skip_on(ranks: tuple[int, ...]) -> None:
    import pytest

    if dist.get_rank() in ranks:
        pytest.skip(f"skipped on ranks {ranks}")


def describe_rank() -> dict:
    ctx = get_rank_context()
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "device": str(ctx.device),
        "backend": dist.get_backend(),
        "random": torch.rand(1).item(),
    }


def process_id() -> int:
    return os.getpid()


def scheduling_policy() -> int:
    return os.sched_getscheduler(0)


def print_lines(count: int) -> None:
    for index in range(count):
        print(f"line {index} from rank {dist.get_rank()}")


def build_2d_mesh_and_reduce() -> float:
    ctx = get_rank_context()
    mesh = ctx.mesh((2, ctx.world_size // 2), ("replicate", "shard"))
    value = torch.ones(1)
    dist.all_reduce(value, group=mesh.get_group("shard"))
    return value.item()


def live_groups() -> int:
    """How many process groups this rank's c10d world holds, the default group included."""
    from distconform.harness import _torch_private

    return len(_torch_private.live_process_groups())


def destroy_the_default_group() -> None:
    dist.destroy_process_group()


def leak_a_thread() -> None:
    import threading

    threading.Thread(target=time.sleep, args=(30,), name="leaky", daemon=True).start()


def leak_an_env_var() -> None:
    os.environ["DISTCONFORM_LEAKED"] = "yes"


def rng_state_digest() -> tuple[float, str | None]:
    return torch.rand(1).item(), os.environ.get("DISTCONFORM_LEAKED")


def leave_an_unmatched_collective() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)


def allocate_on(bad_rank: int, megabytes: int) -> int:
    """Allocate (and touch) ``megabytes`` on one rank; the others allocate a little."""
    size = megabytes if dist.get_rank() == bad_rank else 1
    block = torch.ones(size * 2**20 // 4)
    return int(block.numel())


def leak_a_torch_global() -> None:
    torch.set_default_dtype(torch.float64)


def fsdp_resharded_to_two_then_gathered() -> tuple[list[str], float]:
    """torch's fully_shard resharding to groups of 2 after forward (a sub-mesh of new groups).

    Returns the group names of the mesh the weight ends up on and the gathered weight's sum:
    a warm rank that kept the previous test's DTensor caches returns that test's mesh, whose
    groups the harness has destroyed, and ``full_tensor`` cannot resolve them.
    """
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Linear(4, 8)
    expected = model.weight.detach().sum().item()
    fully_shard(model, reshard_after_forward=2)
    model(torch.ones(2, 4))
    mesh = model.weight.device_mesh
    full = model.weight.full_tensor()
    assert abs(full.sum().item() - expected) < 1e-5, (full.sum().item(), expected)
    return [mesh.get_group(dim).group_name for dim in range(mesh.ndim)], full.sum().item()


def leave_an_unmatched_send() -> None:
    if dist.get_rank() == 0:
        dist.isend(torch.ones(1), dst=1)


def send_and_receive() -> float:
    """A matched point-to-point exchange: the pool must stay warm after it."""
    value = torch.full((1,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        dist.send(value, dst=1)
    elif dist.get_rank() == 1:
        dist.recv(value, src=0)
    return value.item()


def refused_send() -> str:
    """A send the backend refuses on the spot (gloo: a strided tensor) never went out."""
    try:
        dist.isend(torch.ones(8)[::2], dst=(dist.get_rank() + 1) % dist.get_world_size())
    except RuntimeError as exc:
        return str(exc)
    return "accepted"
