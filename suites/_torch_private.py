"""The one audited place where ``suites/`` touches private PyTorch names.

The backend suite must reach two things torch 2.13 offers no public spelling of: the
``PREMUL_SUM`` reduce op, which only exists with its factor attached
(``dist._make_nccl_premul_sum``), and the functional collectives that DTensor and FSDP2 call
(``torch.distributed._functional_collectives``), which a backend must serve like the eager
ones. Each accessor checks the installed torch first and refuses an unaudited version,
naming this file. Mirrors ``impl/_torch_private.py`` (``suites`` may not depend on it being
the same list).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

AUDITED_TORCH = ((2, 13),)


class PrivateTorchAccessError(RuntimeError):
    """A private torch name is used on a torch version nobody audited it on."""


def installed_torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_audited_torch(accessor: str) -> None:
    version = installed_torch_version()
    if version not in AUDITED_TORCH:
        audited = ", ".join(f"{a}.{b}" for a, b in AUDITED_TORCH)
        raise PrivateTorchAccessError(
            f"suites/_torch_private.py:{accessor} reaches a private torch name audited for "
            f"torch {audited}, but torch {torch.__version__} is installed. Check that the name "
            f"still means the same thing in this version, then add it to AUDITED_TORCH."
        )


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
