"""Rank bodies that disagree about their collectives, for the diagnosis tests.

The line numbers of the calls below are asserted by test_diagnosis.py (``line_of``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distconform.harness import torch_api


def skip_an_all_reduce(skipping_rank: int) -> None:
    dist.all_reduce(torch.ones(4))  # agreed
    if dist.get_rank() != skipping_rank:
        dist.all_reduce(torch.ones(4))  # the one skipped
    time.sleep(0.2)


def all_reduce_another_shape(odd_rank: int) -> None:
    dist.all_reduce(torch.ones(2))  # agreed
    numel = 8 if dist.get_rank() == odd_rank else 4
    dist.all_reduce(torch.ones(numel))  # the mismatch


def never_arrive(stuck_rank: int) -> None:
    if dist.get_rank() == stuck_rank:
        while True:
            time.sleep(0.01)
    torch_api.all_gather_single(torch.empty(2 * dist.get_world_size()), torch.ones(2))  # waits


def functional_all_reduce_another_shape_in_backward(odd_rank: int) -> None:
    weight = torch.ones(2, requires_grad=True)
    numel = 6 if dist.get_rank() == odd_rank else 4
    group_name = dist.group.WORLD.group_name

    def reduce_in_backward(grad):
        reduced = torch.ops._c10d_functional.all_reduce(torch.ones(numel), "sum", group_name)  # bw
        torch.ops._c10d_functional.wait_tensor(reduced)
        return grad

    weight.register_hook(reduce_in_backward)
    (weight * 2).sum().backward()
