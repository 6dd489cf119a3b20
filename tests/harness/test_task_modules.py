"""Which modules a rank imports for a task, and in which order."""

from __future__ import annotations

import sys
import types

from distconform.harness.adopt.rank import run_adopted_method
from distconform.harness.shared.task import pack_call


def test_the_harnesss_modules_come_before_the_tests(monkeypatch, tmp_path):
    # A test module whose name sorts before "harness": the rank must still import the
    # harness's rank-side module first, which prepares what the test module binds on import
    # (distconform.harness.adopt.rank serves init_process_group).
    module = types.ModuleType("aaa_test_module")
    module.__file__ = str(tmp_path / "aaa_test_module.py")

    class Case:
        pass

    Case.__module__ = module.__name__
    Case.__qualname__ = "Case"
    module.Case = Case
    monkeypatch.setitem(sys.modules, module.__name__, module)
    _, refs = pack_call(run_adopted_method, (Case, "test_x", "/tmp/store"), {})
    names = [ref.name for ref in refs]
    assert "aaa_test_module" in names and "distconform.harness.adopt.rank" in names
    assert names.index("distconform.harness.adopt.rank") < names.index("aaa_test_module"), names
    first_other = next(i for i, name in enumerate(names) if name.split(".")[0] != "harness")
    assert all(name.split(".")[0] != "harness" for name in names[first_other:]), names
