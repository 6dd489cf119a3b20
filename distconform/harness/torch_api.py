"""Public torch names that changed inside the supported window (torch 2.11 to 2.15).

torch 2.13 renamed the single-tensor collectives: ``all_gather_single`` and
``reduce_scatter_single`` are the 2.13 spellings of 2.11's ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (same parameters, same semantics; the old names forward to the
new ones from 2.13 on). Code here, in ``impl/`` and in ``suites/`` calls the 2.13 names
through this module, which resolves them on the installed torch.

Each call looks ``torch.distributed``'s attribute up when it is made, not at import: the
comm tools (``harness/comm``) wrap those attributes while they watch, and a function bound
at import would slip past them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _first_present(*names: str) -> str:
    for name in names:
        if hasattr(dist, name):
            return name
    raise AttributeError(f"torch.distributed has none of {', '.join(names)}")


#: The name ``torch.distributed`` gives each collective in the installed torch.
ALL_GATHER_SINGLE = _first_present("all_gather_single", "all_gather_into_tensor")
REDUCE_SCATTER_SINGLE = _first_present("reduce_scatter_single", "reduce_scatter_tensor")


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``dist.all_gather_single`` (2.13+) or ``dist.all_gather_into_tensor`` (2.11, 2.12)."""
    gather = getattr(dist, ALL_GATHER_SINGLE)
    return gather(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``dist.reduce_scatter_single`` (2.13+) or ``dist.reduce_scatter_tensor`` (2.11, 2.12)."""
    scatter = getattr(dist, REDUCE_SCATTER_SINGLE)
    return scatter(output, input, op=op, group=group, async_op=async_op)
