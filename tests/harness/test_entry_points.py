"""distconform's entry points, installed or read from a plain copy of the tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from distconform.harness import entry_points

ROOT = Path(__file__).resolve().parents[2]


def test_installed_plugins_are_not_named_again():
    # This environment installed distconform (pip install -e .): pytest loads the plugins.
    assert entry_points.is_installed()
    assert entry_points.pytest_plugin_args() == []


def test_a_plain_tree_names_its_plugins_and_reads_its_commands(monkeypatch):
    monkeypatch.setattr(entry_points, "_installed", lambda group: {})
    assert entry_points.pytest_plugin_args() == [
        *("-p", "distconform.harness.plugin"),
        *("-p", "distconform.conformance.plugin"),
        *("-p", "distconform.harness.adopt.options"),
    ]
    commands = entry_points.commands()
    assert {"conformance", "bench-collectives", "gpu-check"} <= set(commands)
    assert commands["gpu-check"].value == "distconform.harness.gpu_check.cli:main"


def test_python_m_harness_lists_the_commands_without_an_install():
    # -S: no site-packages, so no installed distribution and no entry point at all.
    completed = subprocess.run(
        [sys.executable, "-S", "-m", "distconform", "--help"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    for name in ("bench-collectives", "conformance", "gpu-check"):
        assert name in completed.stdout
