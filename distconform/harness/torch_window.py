"""The torch releases distconform supports, and the audit of each private access in them.

distconform supports torch 2.11 to 2.15 (``pyproject.toml`` says the same). Where no public
API does what it needs, each package reaches a private torch name through one audited
module (``harness/_torch_private.py``, ``impl/_torch_private.py``,
``suites/_torch_private.py``, ``harness/adopt/_torch_test_harness.py``). Every accessor there
has an :class:`Audit`: what it reads, and for each release of the window what reading that
release's source found (the same name meaning the same thing, with the file and line, or
the difference and what the accessor does about it). :func:`require_audited` runs first in
every accessor: a torch outside the window, or a release the accessor's audit does not
cover, is refused with the window named, never used blind.

Light on purpose: ``impl/`` uses it without the pytest side of the harness, and the
plugins import it before anything has imported torch (torch is imported on first use).
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Mapping
from dataclasses import dataclass

Version = tuple[int, int]

V2_11: Version = (2, 11)
V2_12: Version = (2, 12)
V2_13: Version = (2, 13)
V2_14: Version = (2, 14)
V2_15: Version = (2, 15)
#: Oldest first.
SUPPORTED_TORCH: tuple[Version, ...] = (V2_11, V2_12, V2_13, V2_14, V2_15)


def installed_torch_version() -> Version:
    """``(major, minor)`` of the installed torch, read without importing it where possible."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.__version__
    else:
        # Read from torch's installed metadata, not by importing it: the plugins ask at
        # configure, before the rank fork server starts importing torch beside pytest.
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
            import torch  # on first use: see the module docstring

            version = torch.__version__
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def describe_window() -> str:
    (first_major, first_minor), (last_major, last_minor) = SUPPORTED_TORCH[0], SUPPORTED_TORCH[-1]
    return f"torch {first_major}.{first_minor} to {last_major}.{last_minor}"


def _name(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


class PrivateTorchAccessError(RuntimeError):
    """A private torch name is used on a torch it was not audited on."""


@dataclass(frozen=True)
class Audit:
    """One accessor's audit.

    ``reads``: the private names it touches and what it relies on them meaning.
    ``versions``: for each release of the window, what reading that release found.
    A release missing here is not audited: the accessor refuses it.
    """

    reads: str
    versions: Mapping[Version, str]


def require_audited(audits: Mapping[str, Audit], accessor: str, module: str) -> None:
    """Refuse ``module:accessor`` unless the installed torch is in the window and audited.
    Only a refusal imports torch (for its full version): an accessor that reads nothing of
    torch's objects (source text, names) may run before anything imports it."""
    version = installed_torch_version()
    where = f"{module}:{accessor}"
    if version not in SUPPORTED_TORCH:
        import torch  # as in installed_torch_version

        raise PrivateTorchAccessError(
            f"{where} reaches a private torch name; distconform supports {describe_window()}, "
            f"but torch {torch.__version__} is installed. Install a torch in that window, or "
            f"audit the name on torch {_name(version)} (its Audit in {module}) and add the "
            f"release to SUPPORTED_TORCH."
        )
    audit = audits.get(accessor)
    if audit is None:
        raise PrivateTorchAccessError(f"{where} has no Audit entry in {module}")
    if version not in audit.versions:
        import torch

        audited = ", ".join(_name(v) for v in audit.versions)
        raise PrivateTorchAccessError(
            f"{where} is audited for torch {audited}, not for the installed "
            f"{torch.__version__}: read what it reads ({audit.reads}) in that release and add "
            f"the finding to its Audit in {module}."
        )
