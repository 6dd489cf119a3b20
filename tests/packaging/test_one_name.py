"""distconform's modules have one name each, in the pytest process and in its ranks.

Two names for one file (``harness.x`` and ``distconform.harness.x``) would mean two module
objects: two registries, two sets of class identities. The old top-level names must not be
importable from the checkout either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OLD_NAMES = ("harness", "impl", "suites", "conformance")

MODULES_DUMP = """
import json, os, sys

import pytest


def names_by_file():
    found = {}
    for name, module in list(sys.modules.items()):
        if name in ("__main__", "__mp_main__"):  # the process's own script, not an import
            continue
        path = getattr(module, "__file__", None)
        if path and os.sep + "distconform" + os.sep in path:
            found.setdefault(os.path.realpath(path), []).append(name)
    return found


@pytest.mark.world_size(2)
def test_rank(rank_ctx):
    out = os.environ["MODULES_OUT"]
    with open(f"{out}/rank{rank_ctx.rank}.json", "w") as f:
        json.dump(names_by_file(), f)


def test_parent():
    with open(os.environ["MODULES_OUT"] + "/parent.json", "w") as f:
        json.dump(names_by_file(), f)
"""


def test_no_module_is_imported_under_two_names(tmp_path):
    (tmp_path / "test_modules.py").write_text(MODULES_DUMP)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "MODULES_OUT": str(out)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_modules.py",
         "--impl", "reference"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    dumps = sorted(out.glob("*.json"))
    assert [d.name for d in dumps] == ["parent.json", "rank0.json", "rank1.json"]
    for dump in dumps:
        by_file = json.loads(dump.read_text())
        assert len(by_file) > 20, dump.name  # the scan sees distconform's modules at all
        twice = {path: names for path, names in by_file.items() if len(names) > 1}
        assert not twice, f"{dump.stem}: {twice}"
        names = {name for names in by_file.values() for name in names}
        assert all(name.split(".")[0] == "distconform" for name in names), sorted(names)


def test_the_old_top_level_names_are_gone_from_the_checkout():
    code = (
        "import importlib.util, json; "
        f"print(json.dumps([n for n in {OLD_NAMES!r} if importlib.util.find_spec(n)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == []
