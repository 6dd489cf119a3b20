"""An implementation built on another inherits that one's recorded deviations.

A vendor whose implementation wraps torch's FSDP2 meets torch's own bugs. With
``built_on = "torch"`` a conformance run applies torch's expectations file for the installed
release as well as the vendor's own: a case that file records is XFAIL, marked inherited from
torch in every format, not a FAIL that makes the vendor NOT CONFORMANT. The vendor's own entry
wins where both list a test. Without ``built_on`` the same wrapper FAILs that case.

Each run is one ``python -m distconform conformance`` subprocess on two cheap cases that torch
2.13's expectations file records (an inner session in-process would close the outer
session's shared fork server).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest

from distconform.conformance.expectations import Entry, Expectations, inherit
from distconform.conformance.plugin import base_implementation
from distconform.harness.torch_window import installed_torch_version
from tests.conformance.report_checks import check_report_dir, check_saved_renders_as_the_run

REPO = Path(__file__).resolve().parents[2]

# Recorded in suites/expectations/torch-2.13.toml; both run at world size 2 only.
CAST = "suites/test_cast_after_init.py::test_to_dtype_with_gradients_and_while_unsharded"
RESET = (
    "suites/test_partial_forward.py::test_reset_iter_state_after_exception[ws2-fails_in=backward]"
)
TORCH_CAST_REASON = "module.to(dtype) after the first forward: torch 2.13 fixes"

pytestmark = pytest.mark.skipif(
    installed_torch_version() != (2, 13),
    reason="the cases are those torch 2.13's expectations file records",
)

VENDOR = """
from distconform.impl.torch_adapter import TorchImplementation


class AcmeOnTorch(TorchImplementation):
    name = "acme-on-torch"
    built_on = "torch"


class AcmeAlone(TorchImplementation):
    name = "acme-alone"


def on_torch():
    return AcmeOnTorch()


def alone():
    return AcmeAlone()
"""

# The vendor records the reset_iter_state difference itself, in its own words.
OWN_EXPECTATIONS = f"""
[[xfail]]
id = "{RESET}"
reason = "acme keeps the unreduced gradient after a failed backward (acme issue 7)"
category = "OTHER"
"""


def run_vendor(root: Path, spec: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """A conformance run of ``acme_wrap:<spec>`` from ``root``: its output and its report."""
    (root / "acme_wrap.py").write_text(textwrap.dedent(VENDOR))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO), env.get("PYTHONPATH", "")])
    env.pop("DISTCONFORM_IMPL", None)
    command = [
        sys.executable, "-m", "distconform", "conformance", "--impl", f"acme_wrap:{spec}",
        "--out", "report", *args, "-p", "no:cacheprovider",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert (root / "report" / "conformance.json").exists(), done.stdout[-3000:] + done.stderr
    return done, check_report_dir(root / "report")


@pytest.fixture(scope="module")
def on_torch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    root = tmp_path_factory.mktemp("on_torch")
    (root / "acme.toml").write_text(OWN_EXPECTATIONS)
    done, report = run_vendor(root, "on_torch", "--expectations", "acme.toml", CAST, RESET)
    return done, report, root


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    return run_vendor(tmp_path_factory.mktemp("alone"), "alone", CAST)


def by_test(report: dict) -> dict[str, dict]:
    return {test["nodeid"].split("[")[0]: test for test in report["tests"]}


def test_a_deviation_of_the_base_is_an_inherited_xfail_not_a_fail(on_torch):
    done, report, _ = on_torch
    cast = by_test(report)[CAST]
    assert (cast["status"], cast["inherited_from"]) == ("XFAIL", "torch"), done.stdout[-3000:]
    assert cast["reason"].startswith(TORCH_CAST_REASON)
    assert cast["category"] == "NOT_SUPPORTED"
    assert report["environment"]["implementation"]["built_on"] == "torch"
    assert (done.returncode, report["verdict"]["status"]) == (0, "CONFORMANT"), done.stdout[-3000:]


def test_the_vendors_own_entry_wins_and_the_overridden_one_is_not_stale(on_torch):
    done, report, _ = on_torch
    reset = by_test(report)[RESET.split("[")[0]]
    assert (reset["status"], reset["inherited_from"]) == ("XFAIL", None), done.stdout[-3000:]
    assert reset["reason"].startswith("acme keeps the unreduced gradient")
    # torch's entry for the same test is overridden, not stale: it still selects the test.
    assert report["stale_expectations"] == []
    assert "StaleExpectationWarning" not in done.stdout, done.stdout[-3000:]


def test_every_format_says_the_xfail_is_inherited_from_torch(on_torch):
    done, _, root = on_torch
    note = f"XFAIL (inherited from torch: {TORCH_CAST_REASON}"
    out = root / "report"
    assert note in (out / "conformance.md").read_text()
    assert note in done.stdout.split("= conformance =", 1)[1]
    page = (out / "conformance.html").read_text()
    assert 'id="built-on"' in page and note in page
    testcases = ElementTree.fromstring((out / "conformance.junit.xml").read_text()).iter("testcase")
    inherited = {
        case.get("name").split("[")[0]: prop.get("value")
        for case in testcases
        for prop in case.iter("property")
        if prop.get("name") == "inherited_from"
    }
    assert inherited == {CAST.split("::")[1]: "torch"}
    assert "built on torch, whose recorded deviations it inherits" in done.stdout


def test_the_runs_report_reads_back_as_it_was_written(on_torch):
    done, _, root = on_torch
    loaded = check_saved_renders_as_the_run(root / "report", done.stdout)
    assert loaded.by_nodeid()[f"{CAST}[ws2]"].inherited_from == "torch"


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_without_built_on_the_same_wrapper_fails_the_case(alone):
    done, report = alone
    cast = by_test(report)[CAST]
    assert (cast["status"], cast["inherited_from"]) == ("FAIL", None), done.stdout[-3000:]
    assert "built_on" not in report["environment"]["implementation"]
    assert (done.returncode, report["verdict"]["status"]) == (1, "NOT CONFORMANT")


# --- the pieces, without a run ----------------------------------------------------------------


def entry(kind: str, reason: str, **limits) -> Entry:
    return Entry(kind, "s.py::t", reason, Path(f"{reason}.toml"), 1, **limits)


def test_inherited_entries_are_marked_and_the_own_ones_win():
    own = Expectations([entry("xfail", "own")], [entry("tolerance", "own", rtol=0.1)])
    base = Expectations([entry("xfail", "base")], [entry("tolerance", "base", rtol=0.5)])
    combined = inherit(own, base, "torch")
    assert [(e.reason, e.inherited_from) for e in combined.entries] == [
        ("own", None),
        ("base", "torch"),
        ("base", "torch"),
        ("own", None),
    ]
    assert combined.xfail_for("s.py::t").reason == "own"
    assert combined.tolerance_for("s.py::t").rtol == 0.1
    only_base = inherit(Expectations(), base, "torch")
    assert only_base.xfail_for("s.py::t").xfail_reason() == "[OTHER] inherited from torch: base"


def test_a_base_that_is_not_a_registered_implementation_is_a_usage_error():
    def built_on(base):
        return SimpleNamespace(name="acme", spec="acme_wrap:on_torch", built_on=base)

    assert base_implementation(None) is None  # the run names no implementation
    assert base_implementation(built_on(None)) is None
    assert base_implementation(built_on("torch")) == "torch"
    with pytest.raises(pytest.UsageError, match=r"built on 'troch', which is not a registered"):
        base_implementation(built_on("troch"))
