"""Which mutants exist, what each is called, which are sampled, which are equivalent.

A mutant's id survives unrelated edits: it names the file, the enclosing function, the
operator, a hash of the mutated lines' text (whitespace collapsed, so re-indenting keeps it)
with the replacement, and an occurrence index among the mutants that share all of those
(the same line twice in one function). Line numbers are not part of it: adding code above a
mutant does not rename it, so the equivalents file and earlier results still find it. An edit
of the mutated lines themselves does rename it, which is right: it is another mutant then.

The sample is stable in the same way: each mutant's place in the draw is a hash of the seed
and its id, so a mutant added or removed elsewhere does not reshuffle the rest.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mutation_operators import OPERATORS, Mutation, mutations_of

#: The package the benchmark mutates, relative to the repository root.
TARGET = "distconform/impl/reference"
ID_PATTERN = re.compile(
    r"^(?P<path>[\w./-]+\.py)::(?P<qualname>[\w.]+)::(?P<operator>[a-z-]+)"
    r"::(?P<digest>[0-9a-f]{8})::(?P<occurrence>\d+)$"
)
#: A reason shorter than this says nothing a reader could check.
MIN_REASON = 20


@dataclass(frozen=True)
class Mutant:
    """One mutation of one file, with its stable id."""

    id: str
    path: str  # relative to the tree root
    mutation: Mutation

    @property
    def operator(self) -> str:
        return self.mutation.operator

    @property
    def qualname(self) -> str:
        return self.mutation.qualname

    @property
    def line(self) -> int:
        return self.mutation.first_line

    @property
    def description(self) -> str:
        return self.mutation.description

    def mutated_source(self, root: Path) -> bytes:
        return self.mutation.apply((root / self.path).read_bytes())

    def diff(self, root: Path) -> str:
        """The mutant as a unified diff against the file under ``root``."""
        before = (root / self.path).read_bytes()
        after = self.mutation.apply(before)
        return "".join(
            difflib.unified_diff(
                before.decode().splitlines(keepends=True),
                after.decode().splitlines(keepends=True),
                fromfile=f"a/{self.path}",
                tofile=f"b/{self.path}",
                n=2,
            )
        )


def identify(path: str, source: bytes, mutations: list[Mutation]) -> list[Mutant]:
    """``mutations`` of the file ``path`` (its ``source``), each with its id."""
    lines = source.split(b"\n")
    seen: Counter[str] = Counter()
    mutants = []
    for mutation in mutations:
        text = b"\n".join(lines[mutation.first_line - 1 : mutation.last_line]).decode()
        digest = hashlib.sha1(
            f"{_normalized(text)}\n=>\n{_normalized(mutation.replacement.decode())}".encode()
        ).hexdigest()[:8]
        stem = f"{path}::{mutation.qualname}::{mutation.operator}::{digest}"
        mutants.append(Mutant(f"{stem}::{seen[stem]}", path, mutation))
        seen[stem] += 1
    return mutants


def catalogue(root: Path, target: str = TARGET) -> list[Mutant]:
    """Every mutant of every module of ``target`` under ``root``, in file and source order."""
    mutants = []
    for file in sorted((root / target).rglob("*.py")):
        path = file.relative_to(root).as_posix()
        source = file.read_bytes()
        mutants += identify(path, source, mutations_of(source))
    return mutants


def sample(mutants: list[Mutant], size: int | None, seed: int) -> list[Mutant]:
    """``size`` mutants (all for ``None``), in the order the seed draws them."""
    drawn = sorted(mutants, key=lambda m: hashlib.sha256(f"{seed}:{m.id}".encode()).digest())
    return drawn if size is None else drawn[:size]


def select(
    mutants: list[Mutant], operators: list[str] | None, files: list[str] | None
) -> list[Mutant]:
    """The mutants of the named operators and of files whose path contains one of ``files``."""
    unknown = set(operators or ()) - OPERATORS.keys()
    if unknown:
        raise ValueError(f"unknown operators {sorted(unknown)}; known: {', '.join(OPERATORS)}")
    return [
        m
        for m in mutants
        if (not operators or m.operator in operators)
        and (not files or any(part in m.path for part in files))
    ]


# --- equivalent mutants ----------------------------------------------------------------------


class EquivalentsError(ValueError):
    """The equivalents file is malformed: the benchmark refuses to guess what it meant."""


def load_equivalents(path: Path) -> dict[str, str]:
    """``{mutant id: reason}`` from the TOML file of argued-equivalent mutants.

    Each entry is an ``[[equivalent]]`` table with exactly ``id`` and ``reason``; an id must
    be well formed and appear once, a reason must say something (``MIN_REASON`` characters).
    """
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise EquivalentsError(f"{path}: {error}") from error
    unknown = data.keys() - {"equivalent"}
    if unknown:
        raise EquivalentsError(f"{path}: unknown top-level keys {sorted(unknown)}")
    entries = data.get("equivalent", [])
    if not isinstance(entries, list):
        raise EquivalentsError(f"{path}: 'equivalent' must be an array of tables")
    equivalents: dict[str, str] = {}
    for number, entry in enumerate(entries, start=1):
        where = f"{path}: equivalent #{number}"
        if not isinstance(entry, dict) or set(entry) != {"id", "reason"}:
            raise EquivalentsError(f"{where}: needs exactly the keys 'id' and 'reason'")
        mutant_id, reason = entry["id"], entry["reason"]
        if not isinstance(mutant_id, str) or not ID_PATTERN.match(mutant_id):
            raise EquivalentsError(f"{where}: {mutant_id!r} is not a mutant id")
        if mutant_id in equivalents:
            raise EquivalentsError(f"{where}: {mutant_id} is listed twice")
        if not isinstance(reason, str) or len(reason.strip()) < MIN_REASON:
            raise EquivalentsError(f"{where}: the reason must argue the equivalence")
        equivalents[mutant_id] = " ".join(reason.split())
    return equivalents


def stale_equivalents(equivalents: dict[str, str], mutants: list[Mutant]) -> list[str]:
    """Ids in the equivalents file that no current mutant has (its lines were edited)."""
    known = {m.id for m in mutants}
    return sorted(set(equivalents) - known)


def _normalized(text: str) -> str:
    return " ".join(text.split())
