"""Which conformance cases exercise each public name of the APIs the suites claim, and of c10d.

One table per family of torch's public API (:data:`FAMILIES`), in ``suites/coverage/``: FSDP2
(``fsdp.toml``: ``torch.distributed.fsdp`` and FSDP2's ``replicate``), the distributed
state-dict API (``state_dict.toml``), tensor parallelism (``tensor_parallel.toml``) and
pipelining (``pipelining.toml``); ``suites/backend/api_coverage.toml`` does the same for
``torch.distributed.distributed_c10d`` against the backend cases. Every argument, field and
method of each family is a name, and so is every value class of an argument that offers a
choice (``fully_shard(reshard_after_forward=int)``); each row gives the cases whose oracle
would differ if those names were ignored, or why they are out of scope, or the gap no case
fills yet, stated. A vendor reads them (rendered into ``docs/cases.md`` and
``docs/backend-cases.md``) to know what "conformant" covers; :func:`coverage_problems` holds
each to the installed torch's surface (:mod:`distconform.suites.api_surface`), so a name a new
release adds fails the tests until a row lists it. Nothing here imports torch: the catalogue renders
the tables on any machine.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from distconform.extension import SUPPORTED_TORCH
from distconform.extension import TorchVersion as Version
from distconform.suites.cases import Case

COVERAGE_DIR = Path(__file__).resolve().parent / "coverage"
BACKEND_COVERAGE_FILE = Path(__file__).resolve().parent / "backend" / "api_coverage.toml"
FIRST_RELEASE = "2.11"
_KEYS = {"names", "cases", "out_of_scope", "uncovered", "since", "build"}
_VERDICTS = ("cases", "out_of_scope", "uncovered")


@dataclass(frozen=True)
class Family:
    """One public API the suites claim, with its coverage table."""

    name: str  #: the table's file name, and :data:`distconform.suites.api_surface.SURFACES`' key
    title: str  #: a heading: what the family is
    scope: str  #: one sentence: which names of torch the table lists

    @property
    def table(self) -> Path:
        return COVERAGE_DIR / f"{self.name}.toml"


FAMILIES = (
    Family(
        "fsdp",
        "FSDP2: `fully_shard`, `FSDPModule`, the policies, `replicate`",
        "Every public name of `torch.distributed.fsdp` (for FSDP2's own objects each "
        "function's arguments, each policy's fields, each method of `FSDPModule` and "
        "`UnshardHandle` with its arguments) and FSDP2's `replicate` with its arguments.",
    ),
    Family(
        "state_dict",
        "Distributed state dicts: `torch.distributed.checkpoint.state_dict`",
        "Every public name of `torch.distributed.checkpoint.state_dict`: each function's "
        "arguments and every `StateDictOptions` field.",
    ),
    Family(
        "tensor_parallel",
        "Tensor parallelism: `torch.distributed.tensor.parallel`",
        "Every public name of `torch.distributed.tensor.parallel`: `parallelize_module`'s "
        "arguments, each style's constructor arguments (its layouts), `loss_parallel`.",
    ),
    Family(
        "pipelining",
        "Pipelining: `torch.distributed.pipelining`",
        "Every public name of `torch.distributed.pipelining` and its `schedules` module: "
        "every schedule class with its constructor and `step` arguments, `PipelineStage`'s "
        "constructor arguments, the tracer front end.",
    ),
)
FAMILY = {family.name: family for family in FAMILIES}
#: FSDP2's table, the first and largest.
COVERAGE_FILE = FAMILY["fsdp"].table


@dataclass(frozen=True)
class ApiRow:
    """One row of the table: names, and what covers them."""

    names: tuple[str, ...]
    cases: tuple[str, ...] = ()
    out_of_scope: str = ""
    uncovered: str = ""
    since: str = FIRST_RELEASE
    #: Set for names only some builds of a release have (NCCL's classes in CUDA builds): the
    #: builds, and their absence from the installed torch is no error.
    build: str = ""

    @property
    def status(self) -> str:
        if self.cases:
            return "covered"
        return "out of scope" if self.out_of_scope else "uncovered"


def release(text: str) -> Version:
    """``"2.13"`` as ``(2, 13)``."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise ValueError(f"{text!r} is not a torch release like 2.13") from None
    return major, minor


def parse_coverage(text: str, cases: Mapping[str, Case]) -> list[ApiRow]:
    """The rows of a coverage table, validated against the case table ``cases``."""
    rows = []
    seen: set[str] = set()
    for index, raw in enumerate(tomllib.loads(text).get("api") or (), start=1):
        where = f"[[api]] row {index}"
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        names = tuple(raw.get("names") or ())
        if not names or not all(isinstance(name, str) and name for name in names):
            raise ValueError(f"{where}: names must be a non-empty list of names")
        where = f"[[api]] row {index} ({names[0]})"
        given = [key for key in _VERDICTS if raw.get(key)]
        if len(given) != 1:
            raise ValueError(
                f"{where}: give exactly one of cases, out_of_scope or uncovered, got {given}"
            )
        for case_id in raw.get("cases") or ():
            case = cases.get(case_id)
            if case is None:
                raise ValueError(f"{where}: no case {case_id!r} in the case table")
            if not case.suite:
                raise ValueError(f"{where}: case {case_id!r} is recorded only, not implemented")
        twice = seen.intersection(names)
        if twice:
            raise ValueError(f"{where}: {sorted(twice)} listed in an earlier row too")
        seen.update(names)
        since = str(raw.get("since") or FIRST_RELEASE)
        if release(since) not in SUPPORTED_TORCH:
            raise ValueError(f"{where}: since {since!r} is not a release of the window")
        rows.append(
            ApiRow(
                names=names,
                cases=tuple(raw.get("cases") or ()),
                out_of_scope=str(raw.get("out_of_scope") or ""),
                uncovered=str(raw.get("uncovered") or ""),
                since=since,
                build=str(raw.get("build") or ""),
            )
        )
    return rows


def read_coverage(cases: Mapping[str, Case], path: Path = COVERAGE_FILE) -> list[ApiRow]:
    return parse_coverage(path.read_text(), cases)


def read_families(cases: Mapping[str, Case]) -> dict[str, list[ApiRow]]:
    """Every family's rows, by family name."""
    return {family.name: read_coverage(cases, family.table) for family in FAMILIES}


def row_group(name: str) -> str:
    """The function, class, method or field a name belongs to, with its arguments and value
    classes: ``fully_shard(mesh)`` -> ``fully_shard``, ``StateDictOptions.strict=True`` ->
    ``StateDictOptions.strict``, ``FSDPModule.unshard(async_op)`` -> ``FSDPModule.unshard``."""
    return name.split("(", 1)[0].split("=", 1)[0]


def display_path(path: Path) -> str:
    """``path`` as the repository names it (``suites/...``)."""
    parts = path.resolve().parts
    return "/".join(parts[parts.index("suites") :]) if "suites" in parts else str(path)


def uncovered_problems(rows: Iterable[ApiRow], surface: Iterable[str], table: Path) -> list[str]:
    """Names of the installed torch that ``table`` leaves uncovered: each must be covered by a
    case or stated out of scope (``uncovered`` rows are for releases the tests cannot run)."""
    present = set(surface)
    return [
        f"{name}: uncovered in {display_path(table)} ({row.uncovered}); give it a case that "
        f"checks its effect, or why it is out of scope"
        for row in rows
        if row.status == "uncovered"
        for name in row.names
        if name in present
    ]


def coverage_problems(
    rows: Iterable[ApiRow],
    surface: Iterable[str],
    torch: Version,
    table: Path = COVERAGE_FILE,
) -> list[str]:
    """What ``table`` gets wrong about a torch whose surface is ``surface``: names it does
    not list, and names it claims for this release that the release lacks."""
    rows = list(rows)
    listed = {name: row for row in rows for name in row.names}
    present = set(surface)
    problems = [
        f"{name}: public in torch {torch[0]}.{torch[1]} but in no row of {display_path(table)} "
        f"(add it with the cases that exercise it, or why it is out of scope or uncovered)"
        for name in sorted(present - set(listed))
    ]
    for name, row in sorted(listed.items()):
        if name not in present and release(row.since) <= torch and not row.build:
            problems.append(
                f"{name}: listed for torch {row.since} and later, but torch "
                f"{torch[0]}.{torch[1]} does not have it (fix its row's since)"
            )
    return problems
