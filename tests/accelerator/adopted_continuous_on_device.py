"""torch's continuous family on the device, for the GPU check's ``adopt-continuous`` steps:
run once under torch's own harness and once with ``--dist-adopt``; each test's outcome must
be the one its name says under both (``CONTINUOUS_EXPECTED`` in
``distconform/harness/gpu_check/steps.py``), and the adopted failure must be reported per rank.

Not collected by the default run (no ``test_`` prefix), and its classes need an accelerator:
the world is the device count, as torch's harness chooses it for a class that sets none.
Expected values come from the launch's arithmetic (a sum of ranks, an arange's sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorContinuousTestBase


def _rank_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None, "these classes need an accelerator"
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class ContinuousOnTheDevice(MultiProcContinuousTest):
    @classmethod
    def backend_str(cls) -> str:
        return dist.get_default_backend_for_device(torch.accelerator.current_accelerator())

    def test_a_sum_of_ranks_on_the_device(self):
        value = torch.full((4,), float(self.rank + 1), device=_rank_device())
        dist.all_reduce(value)
        expected = self.world_size * (self.world_size + 1) / 2
        self.assertEqual(value.cpu(), torch.full((4,), expected))
        self.assertEqual(dist.get_backend(), self.backend_str())

    def test_b_rank_and_world_size_are_the_classs(self):
        self.assertEqual((self.rank, self.world_size), (dist.get_rank(), dist.get_world_size()))
        self.assertEqual(self.world_size, torch.accelerator.device_count())


class DTensorContinuousOnTheDevice(DTensorContinuousTestBase):
    world_size = 1

    def test_a_sharded_arange_on_the_device(self):
        device = _rank_device()
        mesh = init_device_mesh(device.type, (self.world_size,))
        sharded = distribute_tensor(torch.arange(8.0, device=device), mesh, [Shard(0)])
        self.assertEqual(sharded.to_local().device, device)
        self.assertEqual(sharded.full_tensor().sum().item(), 28.0)


class FailsOnTheLastRank(MultiProcContinuousTest):
    def test_1_fails_on_the_last_rank(self):
        if self.rank == self.world_size - 1:
            self.assertEqual(self.rank, -1, "cannot be right")

    def test_2_skipped_after_the_failure(self):
        pass
