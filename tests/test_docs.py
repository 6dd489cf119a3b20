"""The documentation: a short README, a site that builds without warnings, an option
reference generated from the options' definitions and measurement tables rendered from the
benchmarks' JSON files."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distconform.conformance import options_reference

ROOT = Path(__file__).resolve().parents[1]
#: The README is for a newcomer; depth goes to docs/.
README_MAX_LINES = 250


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it at most {README_MAX_LINES} and move depth to docs/"
    )


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="docs/options.md is generated on Python 3.11, whose argparse help it holds",
)
def test_the_option_reference_is_generated_from_the_definitions():
    assert options_reference.main(["--check"]) == 0, (
        "docs/options.md is out of date: run python -m distconform.conformance.options_reference"
    )


def _tables():
    """benchmarks/tables.py, a script beside the benchmarks it imports."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measurement_tables_are_rendered_from_the_benchmark_json():
    assert _tables().main(["--check"]) == 0, (
        "a table in docs/ differs from its JSON file: run python benchmarks/tables.py"
    )


def test_a_hand_edited_table_is_found():
    tables = _tables()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    marked = re.search(r"<!-- table: \S+harness_overhead\.json -->\n\n\| variant", page)
    assert marked is not None, "docs/benchmarks.md lost its harness_overhead table marker"
    edited = re.sub(
        r"(\| distconform warm pool \(--launcher process\) \| 301 \| )[\d.]+", r"\g<1>0.1", page
    )
    assert edited != page
    assert tables.render_page(edited) == page


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "options" / "index.html").exists()
