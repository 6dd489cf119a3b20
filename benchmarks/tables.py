"""The measurement tables of the documentation, rendered from the benchmarks' JSON files.

Each such table in ``docs/`` stands between a marker that names its JSON file and an end
marker::

    <!-- table: benchmarks/results/harness_overhead.json -->

    | ... the table ... |

    <!-- end table -->

``python benchmarks/tables.py`` rewrites every marked table from its file, with the
formatter of the benchmark that wrote it (``harness_overhead.format_table``,
``impl_step.format_tables``, ``adopt_torch_files.format_summary``,
``mutation_report.format_table``, ``stream_check_cost.format_table``, the GPU check's own
Markdown); ``--check`` exits 1 while a page differs from what its files give
(``tests/test_docs.py`` runs it), so no table can drift from its measurements by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import adopt_torch_files  # noqa: E402  (scripts beside this one, not a package)
import harness_overhead  # noqa: E402
import impl_step  # noqa: E402
import mutation_report  # noqa: E402
import stream_check_cost  # noqa: E402

from distconform.harness.gpu_check.report import as_markdown  # noqa: E402

#: The pages holding rendered tables: the results section of the site, where dated measurements
#: live (tests/test_docs.py checks that no other page has a marked table).
PAGES = (
    "docs/results/adopt.md",
    "docs/results/benchmarks.md",
    "docs/results/gpu.md",
    "docs/results/mutation.md",
)
_TABLE = re.compile(r"<!-- table: (?P<source>\S+) -->\n.*?<!-- end table -->", re.DOTALL)


def harness_overhead_table(data: dict[str, Any]) -> str:
    fields = {field.name for field in dataclasses.fields(harness_overhead.Measurement)}
    measurements = [
        harness_overhead.Measurement(**{k: v for k, v in variant.items() if k in fields})
        for variant in data["variants"]
    ]
    return harness_overhead.format_table(measurements)


def impl_step_tables(data: dict[str, Any]) -> str:
    return impl_step.format_tables(data["rows"])


def gpu_check_table(data: dict[str, Any]) -> str:
    """The GPU check's step table, as its own report renders it."""
    return "\n".join(line for line in as_markdown(data).splitlines() if line.startswith("|"))


def adopt_summary_table(data: list[dict[str, Any]]) -> str:
    return adopt_torch_files.format_summary(data)


def mutation_table(data: dict[str, Any]) -> str:
    return mutation_report.format_table(data)


#: Which formatter renders a JSON file, by the start of its name.
FORMATTERS: dict[str, Callable[[Any], str]] = {
    "adopt_torch_files": adopt_summary_table,
    "harness_overhead": harness_overhead_table,
    "impl_step": impl_step_tables,
    "gpu-check": gpu_check_table,
    "mutation": mutation_table,
    "stream_check_cost": stream_check_cost.format_table,
}


def render_table(source: str) -> str:
    path = ROOT / source
    formatter = next((f for prefix, f in FORMATTERS.items() if path.name.startswith(prefix)), None)
    if formatter is None:
        raise SystemExit(f"{source}: no formatter for this file (known: {', '.join(FORMATTERS)})")
    return formatter(json.loads(path.read_text()))


def render_page(text: str) -> str:
    def table(match: re.Match[str]) -> str:
        # Blank lines around the table: Markdown would read it as part of the comment's
        # HTML block otherwise.
        body = render_table(match["source"])
        return f"<!-- table: {match['source']} -->\n\n{body}\n\n<!-- end table -->"

    return _TABLE.sub(table, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a page differs; write nothing"
    )
    options = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        path = ROOT / page
        text = path.read_text()
        rendered = render_page(text)
        if rendered == text:
            continue
        if options.check:
            stale.append(page)
        else:
            path.write_text(rendered)
            print(f"rewrote the tables of {page}")
    if stale:
        print(
            f"{', '.join(stale)}: a table differs from its JSON file; run "
            f"python benchmarks/tables.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
