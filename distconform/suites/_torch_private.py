"""The one audited place where ``suites/`` touches private PyTorch names.

The backend suite must reach two things that have no public spelling in every release of the
window: the ``PREMUL_SUM`` reduce op, which only exists with its factor attached
(``dist._make_nccl_premul_sum``; ``dist.ReduceOp.PREMUL_SUM(factor)`` is callable only from
torch 2.13 on), and the functional collectives that DTensor and FSDP2 call
(``torch.distributed._functional_collectives``), which a backend must serve like the eager
ones. Each accessor has an :class:`~distconform.harness.torch_window.Audit` in ``AUDITS`` and first
runs :func:`require_audited_torch` (``suites`` may import ``harness``), which refuses a torch
outside the window, or a release its audit does not cover, naming the window and this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distconform.extension import TorchVersion as Version
from distconform.harness import torch_window
from distconform.harness.torch_window import V2_11, V2_12, V2_13, V2_14, V2_15, Audit
from distconform.harness.torch_window import PrivateTorchAccessError as PrivateTorchAccessError

MODULE = "suites/_torch_private.py"

#: One audit per accessor (``file:line`` are in that release's ``torch/`` directory).
AUDITS: dict[str, Audit] = {}


def require_audited_torch(accessor: str) -> None:
    """Refuse ``accessor`` unless the installed torch is in the window and in its audit."""
    torch_window.require_audited(AUDITS, accessor, MODULE)


AUDITS["premul_sum"] = Audit(
    reads="torch.distributed._make_nccl_premul_sum(factor), a C++ function re-exported by "
    "torch.distributed: a ReduceOp whose op is PREMUL_SUM with the factor attached.",
    versions={
        V2_11: "same: import distributed/__init__.py:47, stub _distributed_c10d.pyi:749; "
        "ReduceOp.PREMUL_SUM is not callable here",
        V2_12: "same: import :47; FSDP uses it at _fsdp_collectives.py:822",
        V2_13: "same: import :54 (baseline)",
        V2_14: "same: import :76",
        V2_15: "same: import :76",
    },
)


def premul_sum(factor: float) -> Any:
    """``ReduceOp.PREMUL_SUM`` with its factor: each input is multiplied by it, then summed."""
    require_audited_torch("premul_sum")
    import torch.distributed as dist

    return dist._make_nccl_premul_sum(factor)


@dataclass(frozen=True)
class FunctionalCollectives:
    """The functional collectives the backend suite calls, under torch 2.13's names.

    Each returns an async tensor; ``wait_tensor`` waits for it.
    """

    all_reduce: Callable[..., Any]
    all_gather_single: Callable[..., Any]
    reduce_scatter_single: Callable[..., Any]
    all_to_all_single: Callable[..., Any]
    wait_tensor: Callable[..., Any]


# The funcol name of (all_gather_single, reduce_scatter_single) in each audited release. From
# 2.13 on the old names still exist but warn (FutureWarning), so the new ones are taken there.
_FUNCOL_SINGLE_NAMES: dict[Version, tuple[str, str]] = {
    V2_11: ("all_gather_tensor", "reduce_scatter_tensor"),
    V2_12: ("all_gather_tensor", "reduce_scatter_tensor"),
    V2_13: ("all_gather_single", "reduce_scatter_single"),
    V2_14: ("all_gather_single", "reduce_scatter_single"),
    V2_15: ("all_gather_single", "reduce_scatter_single"),
}

AUDITS["functional_collectives"] = Audit(
    reads="torch.distributed._functional_collectives: all_reduce(t, op, group), "
    "all_gather_single(t, dim, group), reduce_scatter_single(t, op, dim, group), "
    "all_to_all_single(t, out_splits, in_splits, group) and wait_tensor(t).",
    versions={
        V2_11: "differs: no *_single names; all_gather_tensor :177 and reduce_scatter_tensor "
        ":251 take the same parameters and are returned under the 2.13 names",
        V2_12: "differs as 2.11: all_gather_tensor :185, reduce_scatter_tensor :264, "
        "returned under the 2.13 names",
        V2_13: "same: all_gather_single :185, reduce_scatter_single :247 (baseline)",
        V2_14: "same: :185/:247",
        V2_15: "same: :201/:267; all_reduce also accepts a ReduceOp",
    },
)


def functional_collectives() -> FunctionalCollectives:
    """The traceable collectives DTensor uses (``torch.distributed._functional_collectives``),
    under the names torch 2.13 gives them, on every release of the window."""
    require_audited_torch("functional_collectives")
    import torch.distributed._functional_collectives as funcol

    all_gather_name, reduce_scatter_name = _FUNCOL_SINGLE_NAMES[
        torch_window.installed_torch_version()
    ]
    return FunctionalCollectives(
        all_reduce=funcol.all_reduce,
        all_gather_single=getattr(funcol, all_gather_name),
        reduce_scatter_single=getattr(funcol, reduce_scatter_name),
        all_to_all_single=funcol.all_to_all_single,
        wait_tensor=funcol.wait_tensor,
    )
