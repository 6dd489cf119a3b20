"""A vendor's own ``impl/`` folder or ``suites.py`` earlier on ``sys.path`` is named in one
line before any work, by the command and by pytest, instead of failing later with an
import error that names neither."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from harness.shadowing import shadowed_message


def run(vendor: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(vendor)}
    return subprocess.run(
        [sys.executable, *args], cwd=vendor, env=env, capture_output=True, text=True, timeout=120
    )


def test_nothing_is_shadowed_here():
    assert shadowed_message() is None


def test_a_vendor_package_named_impl_is_refused_by_the_command_and_by_pytest(tmp_path):
    (tmp_path / "impl").mkdir()
    (tmp_path / "impl" / "__init__.py").write_text("VENDOR = True\n")
    # distconform's own copy is wherever the child imports it from: this tree, or an
    # installed one (tox installs the package and runs the tests from the tree).
    expected = re.compile(
        rf"distconform: 'impl' resolves to {re.escape(str((tmp_path / 'impl').resolve()))}, "
        rf"not distconform's /\S+/impl: a folder or module named 'impl' earlier on sys.path"
    )
    command = run(tmp_path, "-m", "harness", "conformance", "--impl", "reference", "--quick")
    assert command.returncode == 2, command.stdout + command.stderr
    (line,) = command.stderr.strip().splitlines()
    assert expected.match(line), line
    session = run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    assert session.returncode == 4, session.stdout + session.stderr  # pytest's usage error
    assert re.search(f"ERROR: {expected.pattern}", session.stdout + session.stderr)


def test_a_vendor_module_file_is_named_too(tmp_path):
    (tmp_path / "suites.py").write_text("VENDOR = True\n")
    command = run(tmp_path, "-m", "harness", "--help")
    assert command.returncode == 2
    assert f"'suites' resolves to {(tmp_path / 'suites.py').resolve()}" in command.stderr
