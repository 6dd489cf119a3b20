"""The one audited place where ``suites/`` touches private PyTorch names.

The backend suite must reach two things torch 2.13 offers no public spelling of: the
``PREMUL_SUM`` reduce op, which only exists with its factor attached
(``dist._make_nccl_premul_sum``), and the functional collectives that DTensor and FSDP2 call
(``torch.distributed._functional_collectives``), which a backend must serve like the eager
ones. Each accessor first runs the harness's version check (``suites`` may import
``harness``), which refuses an unaudited torch and names this file.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from harness import _torch_private as _harness_private

MODULE = "suites/_torch_private.py"


def require_audited_torch(accessor: str) -> None:
    _harness_private.require_audited_torch(accessor, module=MODULE)


def premul_sum(factor: float) -> Any:
    """``ReduceOp.PREMUL_SUM`` with its factor: each input is multiplied by it, then summed."""
    require_audited_torch("premul_sum")
    import torch.distributed as dist

    return dist._make_nccl_premul_sum(factor)


def functional_collectives() -> ModuleType:
    """``torch.distributed._functional_collectives``: the traceable collectives DTensor uses."""
    require_audited_torch("functional_collectives")
    import torch.distributed._functional_collectives as funcol

    return funcol
