"""``--dist-adopt`` without what torch's test package needs says which extra brings it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from distconform.harness.adopt.options import ADOPT_EXTRA, ADOPT_NEEDS

ROOT = Path(__file__).resolve().parents[2]

#: Stands in for an environment without expecttest (pip install distconform, no extra).
MISSING_EXPECTTEST = (
    "raise ModuleNotFoundError(\"No module named 'expecttest'\", name='expecttest')\n"
)


def test_the_adopt_extra_declares_what_adoption_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    declared = {requirement.split(">")[0].split("=")[0] for requirement in extras[ADOPT_EXTRA]}
    assert declared == set(ADOPT_NEEDS)


def test_a_missing_module_is_refused_in_one_line_naming_the_extra(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "expecttest.py").write_text(MISSING_EXPECTTEST)
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--dist-adopt", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("ERROR:")]
    assert "expecttest" in line and "distconform[adopt]" in line, line
