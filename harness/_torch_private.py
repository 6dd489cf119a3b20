"""The one audited place where the harness touches private PyTorch names.

Every accessor here exists because torch 2.13 has no public API for what the harness
needs. Each one checks the installed torch version first and refuses to run on a
version it was not audited for, with a message that says what to re-audit; a test in
``tests/harness/test_torch_private.py`` exercises every accessor and the refusal.

Nothing else in ``harness/`` may import a private torch module or touch an
underscore attribute of torch. ``torch.testing._internal`` is never imported.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

AUDITED_TORCH = ((2, 13),)


class PrivateTorchAccessError(RuntimeError):
    """A private torch name is used on a torch version nobody audited it on."""


def installed_torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_audited_torch(accessor: str) -> None:
    """Refuse a private access on a torch version it was not audited for."""
    version = installed_torch_version()
    if version not in AUDITED_TORCH:
        audited = ", ".join(f"{a}.{b}" for a, b in AUDITED_TORCH)
        raise PrivateTorchAccessError(
            f"harness/_torch_private.py:{accessor} reaches a private torch name audited for "
            f"torch {audited}, but torch {torch.__version__} is installed. Check that the name "
            f"still means the same thing in this version, then add it to AUDITED_TORCH."
        )


# --- process-group bookkeeping (no public API lists the live groups) -----------------


def live_process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process's c10d world knows, the default group included."""
    require_audited_torch("live_process_groups")
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map.keys())


def iter_non_default_groups() -> Iterator[torch.distributed.ProcessGroup]:
    """Groups created after init_process_group (subgroups, DeviceMesh dims)."""
    default = torch.distributed.group.WORLD
    for group in live_process_groups():
        if group is not default:
            yield group
