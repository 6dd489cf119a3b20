"""The public FSDP2 and c10d surfaces of the installed torch, spelled as the coverage tables
(``suites/api_coverage.toml``, ``suites/backend/api_coverage.toml``) spell them.

FSDP2: each name of ``torch.distributed.fsdp.__all__``; for FSDP2's own objects (those whose
``__module__`` is the public ``torch.distributed.fsdp``: FSDP1's name its submodules) each
argument of a function, each field of a dataclass and each public method a class defines;
and FSDP2's ``replicate`` with its arguments (no public import path in the window: it comes
through the audited :func:`impl._torch_private.torch_replicate`). c10d: each name of
``torch.distributed.distributed_c10d.__all__``, what ``torch.distributed`` exports of it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator

import torch.distributed.distributed_c10d as c10d
import torch.distributed.fsdp as fsdp

from impl import _torch_private

#: The public module every FSDP2 object names as its own.
PUBLIC_MODULE = "torch.distributed.fsdp"


def members(name: str, obj: object) -> Iterator[str]:
    """The arguments, fields or public methods of one FSDP2 object, as table names."""
    if inspect.isfunction(obj):
        yield from (f"{name}({arg})" for arg in inspect.signature(obj).parameters)
    elif dataclasses.is_dataclass(obj):
        yield from (f"{name}.{field.name}" for field in dataclasses.fields(obj))
    elif inspect.isclass(obj):
        yield from (f"{name}.{attr}" for attr in vars(obj) if not attr.startswith("_"))


def public_surface() -> list[str]:
    """Every public FSDP2-related name of the installed torch."""
    names: list[str] = []
    for name in fsdp.__all__:
        obj = getattr(fsdp, name)
        names.append(name)
        if getattr(obj, "__module__", None) == PUBLIC_MODULE:
            names += members(name, obj)
    names.append("replicate")
    names += members("replicate", _torch_private.torch_replicate())
    return names


def c10d_surface() -> list[str]:
    """Every public name of the installed torch's c10d Python API."""
    return list(c10d.__all__)
