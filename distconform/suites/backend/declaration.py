"""What a communication backend declares it supports, read from its declaration file.

The capability names (operations, reduce ops, dtypes, semantics) are those of
``suites/backend_capabilities.py``. A backend declares its own in a TOML file::

    backend = "gloo"
    capabilities = ["all_reduce", "reduce_op.sum", "dtype.float32", ...]

    [not_declared]   # optional: why each capability is left out, shown in the report
    "reduce_op.premul_sum" = "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"

``--backend-declaration FILE`` names it; without one, the bundled
``suites/backend/declarations/<backend>.toml`` is used when it exists. A backend with no
declaration is held to every capability, so nothing it lacks is hidden as UNSUPPORTED: its
report shows each missing feature as a FAIL and says that no declaration was found.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distconform.suites.backend_capabilities import KNOWN_BACKEND_CAPABILITIES

DECLARATIONS_DIR = Path(__file__).with_name("declarations")


class DeclarationError(ValueError):
    """A backend declaration file is missing, malformed or names unknown capabilities."""


@dataclass(frozen=True)
class BackendDeclaration:
    """One backend's declared capabilities, and where they came from."""

    backend: str
    capabilities: frozenset[str]
    #: The file read; None when no declaration exists (every capability is then assumed).
    source: Path | None = None
    #: capability -> why the backend leaves it out (evidence for the report).
    not_declared: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The report's record of the backend under test."""
        return {
            "name": self.backend,
            "spec": self.backend,
            "declaration": str(self.source) if self.source else None,
            "capabilities": sorted(self.capabilities),
            "not_declared": dict(sorted(self.not_declared.items())),
        }


def parse_declaration(text: str, *, source: Path | None = None) -> BackendDeclaration:
    """A declaration's TOML text, validated: known keys and capabilities only."""
    where = str(source) if source else "backend declaration"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DeclarationError(f"{where}: not valid TOML ({exc})") from None
    unknown_keys = set(data) - {"backend", "capabilities", "not_declared"}
    if unknown_keys:
        raise DeclarationError(f"{where}: unknown keys {sorted(unknown_keys)}")
    backend = data.get("backend")
    capabilities = data.get("capabilities")
    if not isinstance(backend, str) or not backend:
        raise DeclarationError(f'{where}: needs backend = "<name>"')
    if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
        raise DeclarationError(f"{where}: capabilities must be a list of strings")
    not_declared = data.get("not_declared", {})
    if not isinstance(not_declared, dict):
        raise DeclarationError(f"{where}: [not_declared] must map capabilities to reasons")
    named = set(capabilities) | set(not_declared)
    if named - KNOWN_BACKEND_CAPABILITIES:
        raise DeclarationError(
            f"{where}: unknown capabilities {sorted(named - KNOWN_BACKEND_CAPABILITIES)}; the "
            f"known ones are listed in suites/backend_capabilities.py"
        )
    both = set(capabilities) & set(not_declared)
    if both:
        raise DeclarationError(f"{where}: {sorted(both)} both declared and not declared")
    return BackendDeclaration(
        backend, frozenset(capabilities), source, {k: str(v) for k, v in not_declared.items()}
    )


def load_declaration(backend: str, path: str | Path | None = None) -> BackendDeclaration:
    """The declaration at ``path``, else the bundled one for ``backend``, else everything."""
    if path is None:
        bundled = DECLARATIONS_DIR / f"{backend}.toml"
        if not bundled.is_file():
            return BackendDeclaration(backend, KNOWN_BACKEND_CAPABILITIES)
        path = bundled
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DeclarationError(f"--backend-declaration {path}: cannot read it ({exc})") from None
    declaration = parse_declaration(text, source=path)
    if declaration.backend != backend:
        raise DeclarationError(
            f"{path} declares backend {declaration.backend!r}, but this run uses {backend!r}; "
            f"pass --backend {declaration.backend} or the declaration of {backend}"
        )
    return declaration
