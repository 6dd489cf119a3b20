"""The mutation benchmark's results file and the tables rendered from it.

One JSON file per run (``benchmarks/results/mutation-<date>.json``), rewritten after every
mutant, so a run that stops (budget, Ctrl-C, a machine taken away) is continued by running
the same command again. Each sampled mutant ends as one of:

- ``killed``: a test of the stage named in ``stage`` failed (``killed_by``);
- ``timeout``: the stage ran past its limit, or a test hung until the harness's deadline
  (``hung``): the mutant made the suites hang, which a user would notice too;
- ``survived``: the quick and the full run both passed;
- ``equivalent``: argued equivalent in ``benchmarks/mutation_equivalents.toml`` (``reason``),
  so not run.

The scores count killed and timed-out mutants as caught, out of the sampled mutants that
are not equivalent: ``quick`` those the quick stage caught, ``full`` those either caught.
``benchmarks/tables.py`` renders ``format_table`` into ``docs/results/mutation.md``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUSES = ("killed", "timeout", "survived", "equivalent")
CAUGHT = ("killed", "timeout")


@dataclass(frozen=True)
class Tally:
    """Outcome counts of one group of sampled mutants."""

    sampled: int
    equivalent: int
    quick: int  # caught by the quick stage
    full_only: int  # caught by the full stage only
    timeout: int  # of the caught, how many by a timeout or hang
    survived: int
    pending: int

    @property
    def scored(self) -> int:
        """The mutants a score is out of: done and not equivalent."""
        return self.quick + self.full_only + self.survived

    @property
    def quick_score(self) -> float | None:
        return self.quick / self.scored if self.scored else None

    @property
    def full_score(self) -> float | None:
        return (self.quick + self.full_only) / self.scored if self.scored else None


def tally(records: list[dict[str, Any]], sampled: int | None = None) -> Tally:
    """Count ``records``; ``sampled`` (default: as many as there are records) makes the
    ones not yet run ``pending``."""
    status = Counter(r["status"] for r in records)
    caught_quick = sum(r["status"] in CAUGHT and r.get("stage") == "quick" for r in records)
    caught_full = sum(r["status"] in CAUGHT and r.get("stage") == "full" for r in records)
    total = len(records) if sampled is None else sampled
    return Tally(
        sampled=total,
        equivalent=status["equivalent"],
        quick=caught_quick,
        full_only=caught_full,
        timeout=status["timeout"],
        survived=status["survived"],
        pending=total - len(records),
    )


def new_results(config: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    return {
        "benchmark": "mutation",
        "config": config,
        "environment": environment,
        "catalogue": {},
        "baseline": {},
        "sampled": [],
        "mutants": [],
        "elapsed_s": 0.0,
        "complete": False,
    }


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def save(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` whole or not at all: a run stopped mid-write keeps the last file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(partial, path)


# --- rendering -----------------------------------------------------------------------------


def format_table(results: dict[str, Any]) -> str:
    """The summary by operator, then the survivors and the equivalent mutants of the sample."""
    records: list[dict[str, Any]] = results["mutants"]
    sampled_ids: list[str] = results.get("sampled") or [r["id"] for r in records]
    by_operator: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_operator.setdefault(record["operator"], []).append(record)
    sampled_by_operator = Counter(_operator_of(i) for i in sampled_ids)
    lines = [
        "| operator | sampled | equivalent | caught by quick | by full only | of which timed "
        "out | survived | pending | quick score | full score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for operator in sorted(sampled_by_operator):
        row = tally(by_operator.get(operator, []), sampled_by_operator[operator])
        lines.append(_row(f"`{operator}`", row))
    lines.append(_row("**all**", tally(records, len(sampled_ids))))
    survivors = [r for r in records if r["status"] == "survived"]
    equivalents = [r for r in records if r["status"] == "equivalent"]
    if survivors:
        lines += ["", "Survivors (a new check each, or an argued equivalence):", ""]
        lines += ["| mutant | line | change |", "|---|---:|---|"]
        lines += [
            f"| `{r['id']}` | {r['line']} | {_cell(r['description'])} |"
            for r in sorted(survivors, key=lambda r: r["id"])
        ]
    if equivalents:
        lines += ["", "Equivalent mutants in the sample:", ""]
        lines += ["| mutant | change | why it is equivalent |", "|---|---|---|"]
        lines += [
            f"| `{r['id']}` | {_cell(r['description'])} | {_cell(r['reason'])} |"
            for r in sorted(equivalents, key=lambda r: r["id"])
        ]
    return "\n".join(lines)


def format_costs(results: dict[str, Any]) -> str:
    """Wall time per mutant by how it ended, for planning a run: a few lines of text."""
    groups: dict[str, list[float]] = {}
    for record in results["mutants"]:
        if record["status"] == "equivalent":
            continue
        key = f"{record['status']} ({record.get('stage', '')})"
        groups.setdefault(key, []).append(record.get("quick_s", 0.0) + record.get("full_s", 0.0))
    lines = []
    for key, times in sorted(groups.items()):
        mean = sum(times) / len(times)
        lines.append(
            f"  {key:<22} {len(times):>4} mutants, mean {mean:6.1f} s, max {max(times):6.1f} s"
        )
    return "\n".join(lines)


def _row(label: str, row: Tally) -> str:
    return (
        f"| {label} | {row.sampled} | {row.equivalent} | {row.quick} | {row.full_only} | "
        f"{row.timeout} | {row.survived} | {row.pending} | {_percent(row.quick_score)} | "
        f"{_percent(row.full_score)} |"
    )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _operator_of(mutant_id: str) -> str:
    return mutant_id.split("::")[2]
