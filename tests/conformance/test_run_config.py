"""A conformance run of the bundled suites uses distconform's pytest settings and test ids,
whatever directory it starts from: a vendor repository's ``addopts`` and ``conftest.py``
must not change the verdict (``--own-config`` opts into them).

The packages are copied under a vendor-style repository, next to a ``pyproject.toml`` that
keeps the entry points and drops the pytest settings, as an installed wheel has none: pytest
then finds the vendor's configuration above them, which is how an installed distconform in
the vendor's virtual environment met it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_PYPROJECT = '[tool.pytest.ini_options]\naddopts = ["-x", "-k", "nothing_matches_this"]\n'


def installed_like(vendor: Path) -> Path:
    """distconform's packages under ``vendor/site``, without pytest settings beside them."""
    site = vendor / "site"
    shutil.copytree(
        ROOT / "distconform", site / "distconform", ignore=shutil.ignore_patterns("__pycache__")
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = project["entry-points"]
    lines = ["[project]", 'name = "distconform"', 'version = "0"']
    for group, entries in points.items():
        lines.append(f'[project.entry-points."{group}"]')
        lines += [f'{name} = "{value}"' for name, value in entries.items()]
    (site / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return site


def collected(cwd: Path, out: Path, site: Path | None, *extra: str) -> tuple[str, str]:
    """The ``--co`` count line of a quick reference run started in ``cwd`` (its report in
    ``out``), and the output."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-m", "distconform", "conformance", "--impl", "reference", "--quick",
         "--out", str(out), "--co", "-q", *extra],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = done.stdout + done.stderr
    match = re.search(r"(\d+/\d+ tests collected|no tests collected)[^\n]*", output)
    assert match, output[-3000:]
    return match.group(0).split(" in ")[0], output


# Slow: tests/packaging/test_wheel.py runs the README's job from a vendor repository with
# its own addopts and a conftest that would fail every test, in the default run.
@pytest.mark.slow
def test_a_vendor_repository_does_not_configure_our_suites(tmp_path):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "pyproject.toml").write_text(HOSTILE_PYPROJECT)
    (vendor / "conftest.py").write_text(
        "def pytest_collection_modifyitems(items):\n    raise RuntimeError('vendor conftest')\n"
    )
    site = installed_like(vendor)
    checkout, _ = collected(ROOT, tmp_path / "checkout", None)
    assert re.fullmatch(r"\d+/\d+ tests collected \(\d+ deselected\)", checkout), checkout
    count, output = collected(vendor, tmp_path / "vendor-run", site)
    assert count == checkout, output[-3000:]
    assert "vendor conftest" not in output, output[-3000:]
    # The test ids are distconform's (suites/...), which its expectation files name.
    assert "\nsuites/test_training_parity.py::" in output, output[-3000:]
    # Opting in, the vendor's configuration applies to our suites: its conftest runs.
    _, own = collected(vendor, tmp_path / "own-run", site, "--own-config")
    assert "RuntimeError: vendor conftest" in own, own[-3000:]
