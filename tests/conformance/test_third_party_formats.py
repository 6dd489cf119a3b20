"""Report formats an installed package adds (entry points of ``distconform.report_formats``):
written beside the bundled ones, and refused in one line when unusable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from distconform.conformance.renderers import FILE_FORMATS, third_party
from distconform.extension import REPORT_FORMATS_GROUP, Format, installed_formats

ROOT = Path(__file__).resolve().parents[2]

#: A vendor's format: one line per test, its id and status.
STATUS_LINES = """
from distconform.extension import Format


def render(report):
    return "".join(f"{test.nodeid} {test.status}\\n" for test in report.tests)


STATUS_LINES = Format("status-lines", "status.txt", render)
NOT_A_FORMAT = "status.txt"
CLASHING = Format("clash", "conformance.json", render)
"""


def vendor_site(tmp_path: Path, entry: str) -> Path:
    """A site directory with ``acme_formats`` and a distribution registering ``entry``."""
    site = tmp_path / "site"
    info = site / "acme_formats-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "acme_formats.py").write_text(STATUS_LINES)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-formats\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{REPORT_FORMATS_GROUP}]\n{entry}\n")
    return site


def test_a_run_writes_an_installed_format_beside_the_bundled_ones(tmp_path):
    site = vendor_site(tmp_path, "status = acme_formats:STATUS_LINES")
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "distconform", "conformance", "--impl", "reference",
         "--out", str(out), "suites/test_world_size_1.py", "-q"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((out / "conformance.json").read_text())
    expected = "".join(f"{t['nodeid']} {t['status']}\n" for t in report["tests"])
    assert report["tests"] and (out / "status.txt").read_text() == expected


@pytest.mark.parametrize(
    ("entry", "complaint"),
    [
        ("status = acme_formats:NOT_A_FORMAT", "is a str, not a distconform.extension.Format"),
        ("clash = acme_formats:CLASHING", "writes conformance.json, which the 'json' format"),
        ("gone = acme_formats:MISSING", "cannot be loaded"),
    ],
)
def test_an_unusable_format_is_named_with_why(tmp_path, monkeypatch, entry, complaint):
    site = vendor_site(tmp_path, entry)
    monkeypatch.syspath_prepend(str(site))
    name, value = (part.strip() for part in entry.split("="))
    monkeypatch.setattr(
        third_party,
        "entry_points",
        lambda group: [EntryPoint(name, value, group)] if group == REPORT_FORMATS_GROUP else [],
    )
    with pytest.raises(third_party.ReportFormatError, match=complaint):
        installed_formats(FILE_FORMATS)


def test_the_extension_format_is_the_one_the_bundled_formats_use():
    assert all(isinstance(fmt, Format) for fmt in FILE_FORMATS)
