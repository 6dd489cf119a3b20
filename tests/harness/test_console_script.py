"""``distconform``, the console script ``pip install`` puts next to the interpreter, runs the
same commands as ``python -m distconform`` and names itself in their usage lines."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from distconform.harness import entry_points as distconform_entry_points

pytestmark = pytest.mark.skipif(
    not distconform_entry_points.is_installed(),
    reason="distconform is not installed here (a plain copy of the tree has no console script)",
)


def script() -> Path:
    return Path(sys.executable).parent / distconform_entry_points.SCRIPT


def test_the_script_is_declared_and_installed():
    declared = [e.value for e in entry_points(group="console_scripts") if e.name == "distconform"]
    assert declared == ["distconform.__main__:console"], (
        f"console script distconform: {declared}; an install from before pyproject.toml declared "
        f"it has none: reinstall with pip install -c constraints.txt -e ."
    )
    assert script().is_file(), f"{script()} is missing: reinstall with pip install -e ."


def test_the_script_lists_the_commands_and_names_itself():
    listed = subprocess.run([script(), "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(
        "usage: distconform {bench-collectives | conformance | gpu-check}"
    ), listed.stdout
    help_text = subprocess.run(
        [script(), "conformance", "--help"], capture_output=True, text=True, timeout=60
    )
    assert help_text.returncode == 0, help_text.stderr
    assert help_text.stdout.startswith("usage: distconform conformance"), help_text.stdout
    unknown = subprocess.run([script(), "conform"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    assert "unknown command 'conform'" in unknown.stderr


def test_python_dash_m_distconform_does_what_the_script_does():
    listed = subprocess.run(
        [sys.executable, "-m", "distconform", "--help"], capture_output=True, text=True, timeout=60
    )
    by_script = subprocess.run([script(), "--help"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == by_script.returncode == 0, listed.stderr
    assert listed.stdout.replace("python -m distconform", "distconform") == by_script.stdout
    done = subprocess.run(
        [sys.executable, "-m", "distconform", "conformance", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m distconform conformance"), done.stdout
