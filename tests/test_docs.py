"""The documentation: a short README, a site that builds without warnings, and an option
reference generated from the options' definitions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance import options_reference

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
        "docs/options.md is out of date: run python -m conformance.options_reference"
    )


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
