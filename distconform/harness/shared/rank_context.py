"""What a test body running on a rank knows about its place in the world."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch only where a rank uses it: the pytest process imports this module with the plugin,
# while the fork server it may start at configure imports torch on the other core
# (distconform.harness.controller.item_runner.prestart_if_expected).
if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_current: contextvars.ContextVar[RankContext | None] = contextvars.ContextVar(
    "distconform_rank_context", default=None
)


@dataclass(frozen=True)
class RankContext:
    """The ``rank_ctx`` fixture: built inside the rank, never shipped from the parent."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    seed: int
    launcher: str

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def group(self) -> dist.ProcessGroup:
        """The default process group, initialised by the harness before the test starts."""
        import torch.distributed as dist

        group = dist.group.WORLD
        if group is None:
            raise RuntimeError("the default process group is not initialised in this rank")
        return group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(
        self, shape: int | tuple[int, ...], names: tuple[str, ...] | None = None
    ) -> dist.DeviceMesh:
        """A DeviceMesh over all ranks on this run's device type.

        Groups the mesh creates are destroyed by the harness after the test, so a test
        may build as many meshes as it needs.
        """
        if isinstance(shape, int):
            shape = (shape,)
        total = 1
        for size in shape:
            total *= size
        if total != self.world_size:
            raise ValueError(
                f"mesh shape {shape} covers {total} ranks but the world has {self.world_size}"
            )
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, tuple(shape), mesh_dim_names=names)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


class RankLocal:
    """A fixture value that stands in for an object built inside each rank.

    The parent resolves fixtures and pickles their values to the ranks; values that
    only make sense inside a rank (a process group, a device, a mesh) are instead
    returned as a ``RankLocal`` whose :meth:`build` runs in the rank.
    """

    def build(self, ctx: RankContext) -> object:
        raise NotImplementedError


class RankContextPlaceholder(RankLocal):
    """The parent-side value of the ``rank_ctx`` fixture."""

    def build(self, ctx: RankContext) -> RankContext:
        return ctx

    def __repr__(self) -> str:
        return "<rank_ctx: built in each rank>"


def get_rank_context() -> RankContext:
    """The context of the rank this code runs on (inside ``run_on_ranks`` or a test)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "get_rank_context() was called outside a rank; it only works inside a function "
            "run by the harness (a test marked world_size, or run_on_ranks)"
        )
    return ctx


@contextlib.contextmanager
def active_rank_context(ctx: RankContext) -> Iterator[RankContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
