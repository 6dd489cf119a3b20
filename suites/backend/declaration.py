"""What a communication backend declares it supports: the backend suite's capabilities.

The backend suite checks a c10d backend, not an FSDP implementation, so its capabilities are
operations, reduce ops, dtypes and semantics. A backend declares its own in a TOML file::

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

DECLARATIONS_DIR = Path(__file__).with_name("declarations")

REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "int32",
    "int64",
    "bool",
    "complex64",
)

OPERATIONS = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast from every source rank",
    "reduce": "reduce to every destination rank",
    "all_gather": "all_gather (list) and all_gather_single with equal sizes",
    "all_gather_uneven": "all_gather (list) with a different size per rank",
    "reduce_scatter": "reduce_scatter (list) and reduce_scatter_single",
    "all_to_all": "all_to_all (list, equal sizes) and all_to_all_single with even and uneven "
    "splits",
    "all_to_all_uneven": "all_to_all (list) with a different size per pair of ranks",
    "gather": "gather to every destination rank",
    "scatter": "scatter from every source rank",
    "barrier": "barrier",
    "send_recv": "send / recv and isend / irecv",
    "batch_isend_irecv": "batch_isend_irecv",
    "object_collectives": "all_gather_object, gather_object, broadcast_object_list, "
    "scatter_object_list, send/recv_object_list",
    "coalesced": "the ProcessGroup's coalesced calls (allreduce_coalesced, "
    "allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced)",
    "new_group": "sub-groups from new_group used concurrently with the default group",
    "split_group": "sub-groups from split_group",
    "device_mesh": "DeviceMesh sub-meshes",
    "functional": "the functional collectives DTensor, FSDP2 and torch.compile issue "
    "(all_reduce, all_gather_single, reduce_scatter_single, all_to_all_single, wait_tensor)",
    "dtensor": "DTensor redistributions (Shard <-> Replicate <-> Partial)",
    "async_work": "async_op=True: wait, is_completed, get_future, several outstanding works",
    "timeout": "a rank that never joins makes the others fail within the group's timeout",
    "abort": "an aborted group refuses every later collective",
    "mismatch_detection": "ranks disagreeing on a collective's shape or dtype get an error",
}

KNOWN_BACKEND_CAPABILITIES = frozenset(
    {
        *OPERATIONS,
        *(f"reduce_op.{op}" for op in REDUCE_OPS),
        *(f"dtype.{dtype}" for dtype in DTYPES),
    }
)


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
            f"known ones are listed in suites/backend/declaration.py"
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
