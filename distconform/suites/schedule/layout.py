"""How many elements one rank puts on the wire for a parameter group (FSDP2's padding rule).

FSDP2 shards each parameter on one dim (``Shard(0)`` unless ``shard_placement_fn`` says
otherwise) into ``S`` equal chunks, the dim padded up to a multiple of ``S``
(``torch.chunk``'s ceil rows per rank). A group all-gathers every parameter's padded chunk
in one collective and reduce-scatters the padded full gradients in one, so per rank:

* all-gather input   = sum over parameters of ``padded_numel / S``
* reduce-scatter input = sum of ``padded_numel`` (its output is the all-gather input's size)
* HSDP all-reduce      = the reduce-scatter output, ``sum of padded_numel / S``
* ``reshard_after_forward=k``: the backward all-gather runs over ``k`` ranks, each giving
  ``sum of padded_numel / k``
* ``replicate`` (``S = 1``): the all-reduce carries every element once, no padding.

A frozen parameter (``requires_grad=False``) is gathered like the others but has no gradient:
the reductions carry the trainable parameters only (:meth:`GroupLayout.only`).

Nothing here looks at an implementation: the inputs are the plain parameters' shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamShape:
    """One parameter as the plan saw it before sharding."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int = 0
    #: Which module of its group the name is relative to (a ``fully_shard([a, b])`` group).
    module_index: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded_numel(self, shard_size: int) -> int:
        """Elements of the parameter with its shard dim padded to a multiple of ``shard_size``."""
        if not self.shape:
            return shard_size  # a 0-d parameter is one element per rank
        rows = self.shape[self.shard_dim]
        padded_rows = math.ceil(rows / shard_size) * shard_size
        return self.numel // rows * padded_rows if rows else 0


@dataclass(frozen=True)
class GroupLayout:
    """The wire sizes of one group's collectives, from its parameters' shapes."""

    params: tuple[ParamShape, ...]

    @classmethod
    def of(cls, params: Iterable[ParamShape]) -> GroupLayout:
        return cls(tuple(params))

    @property
    def empty(self) -> bool:
        return not self.params

    def padded_numel(self, shard_size: int) -> int:
        return sum(p.padded_numel(shard_size) for p in self.params)

    def only(self, keep: Iterable[ParamShape]) -> GroupLayout:
        """The layout of the parameters in ``keep``, in this layout's order."""
        kept = set(keep)
        return GroupLayout(tuple(p for p in self.params if p in kept))

    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def dtype(self) -> torch.dtype:
        """The group's original dtype (every parameter of a group shares it, as in FSDP2's
        one-buffer-per-group all-gather)."""
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"a schedule needs one parameter dtype per group, got {sorted(map(str, dtypes))}"
            )
        return dtypes.pop()
