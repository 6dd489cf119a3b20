"""A vendor's run, out of tree: its own implementation, backend and expectations file.

One ``python -m distconform conformance`` subprocess runs a small test module against a package
built in a temp dir (``acme_fsdp:implementation``, a ``--backend-plugin`` that registers the
c10d backend ``acmegloo``, an expectations file); every test below checks one aspect of
that run's report, so the run is paid for once.

The vendor also ties a few tests of its own to rows of the project's case table (the
conformance plugin applies the table to every test tied to a case) while leaving the core
capability ``prefetch`` undeclared: the report must call it not conformant to
``fsdp2-core`` instead of letting the UNSUPPORTED prefetch cases vanish from its percentage.
Those tests never start a rank beyond the ws-2 pool the others use (the UNSUPPORTED ones are
skipped at collection).
"""

from __future__ import annotations

import html
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conformance.browser import ENV_VAR as BROWSER_ENV_VAR
from tests.conformance.browser import chromium, find_chromium
from tests.conformance.report_checks import check_report_dir, check_saved_renders_as_the_run

REPO = Path(__file__).resolve().parents[2]

ACME_FSDP = """
from distconform.impl.reference import ReferenceImplementation


class AcmeFSDP(ReferenceImplementation):
    name = "acme-fsdp"
    # Every core capability but prefetch.
    capabilities = frozenset(
        {"gradient_accumulation", "reshard_after_forward_int", "mixed_precision", "forward_method"}
    )


def implementation():
    return AcmeFSDP()
"""

ACME_BACKEND = """
import torch.distributed as dist


def _create(store, rank, world_size, timeout):
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


dist.Backend.register_backend("acmegloo", _create, devices=["cpu"])
"""

ACME_TESTS = """
import sys

import pytest
import torch
import torch.distributed as dist


@pytest.mark.world_size(2)
def test_ranks_run_the_vendor_implementation_on_its_backend(rank_ctx, impl):
    assert type(impl).__module__ == "acme_fsdp" and impl.name == "acme-fsdp"
    assert dist.get_backend() == "acmegloo" and "acme_backend" in sys.modules
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2


@pytest.mark.world_size(2)
def test_known_difference(rank_ctx):
    assert rank_ctx.rank == 0, "rank 1 disagrees"


@pytest.mark.world_size(2)
def test_fixed_difference(rank_ctx):
    pass


def test_unlisted_failure():
    assert 1 == 2, "a real failure"


def test_needs_hsdp(impl):
    if not impl.supports("hsdp"):
        pytest.skip("UNSUPPORTED: needs capability hsdp")


def test_cuda_graphs():
    pytest.skip("CPU: CUDA graphs need an accelerator")


def test_tolerance_in_parent(conformance_tolerance):
    assert conformance_tolerance.resolve(1e-6, 1e-5) == {"rtol": 0.5, "atol": 1e-5}


@pytest.mark.world_size(2)
def test_tolerance_on_ranks(rank_ctx, conformance_tolerance):
    assert conformance_tolerance.rtol == 0.5 and conformance_tolerance.reason == "loose"
"""


ACME_CASE_TESTS = """
from distconform.suites.cases import conformance


@conformance("fsdp.forward_inputs.no_inputs")  # ws 2, needs nothing: fsdp2-core
def test_core_case(rank_ctx):
    assert rank_ctx.world_size == 2


@conformance("fsdp.prefetch.explicit")  # ws 2 and 4, needs prefetch: fsdp2-core
def test_core_case_needing_prefetch(rank_ctx):
    raise AssertionError("an UNSUPPORTED case must not run")


@conformance("fsdp.hsdp.parity")  # ws 4, needs hsdp: the hsdp extension
def test_hsdp_case(rank_ctx):
    raise AssertionError("an UNSUPPORTED case must not run")


@conformance("fsdp.grad_accum.grid_hsdp")  # ws 4, needs gradient_accumulation and hsdp
def test_hsdp_accumulation_case(rank_ctx):
    raise AssertionError("an UNSUPPORTED case must not run")
"""

EXPECTATIONS = """
[[xfail]]
id = "acme_tests/test_acme.py::test_known_difference"
reason = "rank 1 disagrees on purpose"
category = "COMM"
link = "https://example.invalid/acme/1"

[[xfail]]
id = "acme_tests/test_acme.py::test_fixed_difference[ws2]"
reason = "fixed since"
category = "NUMERICS"

[[xfail]]
id = "acme_tests/test_acme.py::test_renamed_long_ago"
reason = "stale"

[[tolerance]]
id = "acme_tests/test_acme.py::test_tolerance_*"
rtol = 0.5
reason = "loose"
"""


@pytest.fixture(scope="module")
def vendor_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    root = tmp_path_factory.mktemp("vendor")
    (root / "acme_fsdp").mkdir()
    (root / "acme_fsdp" / "__init__.py").write_text(textwrap.dedent(ACME_FSDP))
    (root / "acme_backend.py").write_text(textwrap.dedent(ACME_BACKEND))
    (root / "acme_tests").mkdir()
    (root / "acme_tests" / "test_acme.py").write_text(textwrap.dedent(ACME_TESTS))
    (root / "acme_tests" / "test_acme_cases.py").write_text(textwrap.dedent(ACME_CASE_TESTS))
    (root / "acme.toml").write_text(EXPECTATIONS)
    (root / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO), env.get("PYTHONPATH", "")])
    env.pop("DISTCONFORM_IMPL", None)
    command = [
        sys.executable, "-m", "distconform", "conformance",
        "--impl", "acme_fsdp:implementation",
        "--backend", "acmegloo",
        "--backend-plugin", "acme_backend",
        "--expectations", "acme.toml",
        "--out", "report",
        "acme_tests/test_acme.py", "acme_tests/test_acme_cases.py",
        "-p", "no:cacheprovider", "--dist-peer-grace", "0.5",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    report_file = root / "report" / "conformance.json"
    assert report_file.exists(), done.stdout + done.stderr
    return done, check_report_dir(root / "report"), root


def statuses(report: dict) -> dict[str, str]:
    return {test["nodeid"].split("::")[1]: test["status"] for test in report["tests"]}


def test_every_test_gets_its_status(vendor_run):
    done, report, _ = vendor_run
    assert statuses(report) == {
        "test_ranks_run_the_vendor_implementation_on_its_backend[ws2]": "PASS",
        "test_known_difference[ws2]": "XFAIL",
        "test_fixed_difference[ws2]": "XPASS",
        "test_unlisted_failure": "FAIL",
        "test_needs_hsdp": "UNSUPPORTED",
        "test_cuda_graphs": "SKIP",
        "test_tolerance_in_parent": "PASS",
        "test_tolerance_on_ranks[ws2]": "PASS",
        "test_core_case[ws2]": "PASS",
        "test_core_case_needing_prefetch[ws2]": "UNSUPPORTED",
        "test_core_case_needing_prefetch[ws4]": "UNSUPPORTED",
        "test_hsdp_case[ws4]": "UNSUPPORTED",
        "test_hsdp_accumulation_case[ws4]": "UNSUPPORTED",
    }, done.stdout
    assert done.returncode == 1  # the unlisted failure fails the run; XFAIL and XPASS do not
    summary = report["summary"]
    assert summary["counts"] == {
        "PASS": 4, "FAIL": 1, "XFAIL": 1, "XPASS": 1, "UNSUPPORTED": 5, "SKIP": 1,
    }  # fmt: skip
    assert summary["conformance_percent"] == pytest.approx(100 * 5 / 7)


def test_the_report_names_the_vendor_implementation_and_backend(vendor_run):
    done, report, root = vendor_run
    env = report["environment"]
    assert (report["schema"], report["schema_version"]) == ("distconform-conformance", 7)
    assert env["implementation"]["name"] == "acme-fsdp"
    assert env["implementation"]["spec"] == "acme_fsdp:implementation"
    assert env["implementation"]["capabilities"] == [
        "forward_method", "gradient_accumulation", "mixed_precision", "reshard_after_forward_int",
    ]  # fmt: skip
    assert (env["backend"], env["device"], env["launcher"]) == ("acmegloo", "cpu", "process")
    assert env["backend_plugins"] == ["acme_backend"]
    assert env["torch_version"] and env["date"] and env["seed"] == 0
    markdown = (root / "report" / "conformance.md").read_text()
    assert "# Conformance report: acme-fsdp" in markdown
    assert "implementation: acme-fsdp (spec acme_fsdp:implementation)" in done.stdout
    junit = (root / "report" / "conformance.junit.xml").read_text()
    assert "test_ranks_run_the_vendor_implementation_on_its_backend" in junit


def test_the_saved_report_renders_as_the_run_wrote_and_printed_it(vendor_run):
    """One report model: read back from conformance.json, the report gives the same text in
    every format as the one the run built."""
    done, report, root = vendor_run
    loaded = check_saved_renders_as_the_run(root / "report", done.stdout)
    assert loaded.to_json() == report


def test_xfail_entries_carry_category_link_and_evidence(vendor_run):
    _, report, _ = vendor_run
    by_name = {test["nodeid"].split("::")[1]: test for test in report["tests"]}
    known = by_name["test_known_difference[ws2]"]
    assert (known["category"], known["link"]) == ("COMM", "https://example.invalid/acme/1")
    assert "rank 1 disagrees" in known["message"] + known["detail"]
    # The reproducer repeats what the run needs beyond the defaults.
    assert "--impl acme_fsdp:implementation --backend-plugin acme_backend" in known["detail"]
    assert by_name["test_fixed_difference[ws2]"]["category"] == "NUMERICS"
    assert by_name["test_needs_hsdp"]["reason"] == "UNSUPPORTED: needs capability hsdp"


def test_stale_entries_are_warned_about_with_file_and_line(vendor_run):
    done, report, _ = vendor_run
    assert "acme.toml:14: StaleExpectationWarning" in done.stdout, done.stdout
    assert "test_renamed_long_ago" in done.stdout
    assert [e["id"] for e in report["stale_expectations"]] == [
        "acme_tests/test_acme.py::test_renamed_long_ago"
    ]


def test_the_terminal_shows_the_table_per_feature_and_world_size(vendor_run):
    done, _, _ = vendor_run
    # The feature is the module path without its top directory and "test_".
    rows = {
        cells[2]: cells[3:10]
        for line in done.stdout.splitlines()
        if line.startswith("| acme ")
        for cells in [[cell.strip() for cell in line.split("|")]]
    }
    #                PASS FAIL XFAIL XPASS UNSUPPORTED SKIP conformance
    assert rows == {
        "-": ["1", "1", "0", "0", "1", "1", "50.0 %"],
        "2": ["2", "0", "1", "1", "0", "0", "75.0 %"],
    }, done.stdout
    total = next(line for line in done.stdout.splitlines() if line.startswith("| **total**"))
    assert "71.4 %" in total  # the case-tied tests of acme_cases included


def test_a_missing_core_capability_makes_the_run_not_conformant_to_fsdp2_core(vendor_run):
    done, report, root = vendor_run
    verdicts = [
        "verdict: NOT CONFORMANT (to fsdp2-core)",
        "  fsdp2-core: NOT CONFORMANT (does not declare prefetch)",
        "  hsdp: NOT CLAIMED (2 cases UNSUPPORTED)",
    ]
    core = (
        "fsdp2-core (required): 1 of 3 cases applied, no pass rate (does not declare "
        "prefetch); UNSUPPORTED: 2 cases need prefetch"
    )
    hsdp = "hsdp (extension): 0 of 2 cases applied; UNSUPPORTED: 2 cases need hsdp"
    # The headline opens the terminal summary, before the environment and the table.
    summary = done.stdout.split("= conformance =", 1)[1].splitlines()[1:]
    assert summary[:3] == verdicts, done.stdout
    assert summary[5:7] == [f"  {core}", f"  {hsdp}"], done.stdout
    last = next(line for line in reversed(summary) if line.startswith("verdict: "))
    assert last.startswith("verdict: NOT CONFORMANT (to fsdp2-core); conformance "), done.stdout
    assert report["verdict"]["status"] == "NOT CONFORMANT"
    markdown = (root / "report" / "conformance.md").read_text().splitlines()
    assert markdown[2] == "verdict: **NOT CONFORMANT** (to fsdp2-core)", markdown[:8]
    assert f"- {core.replace('fsdp2-core', '**fsdp2-core**', 1)}" in markdown
    profiles = {profile["name"]: profile for profile in report["profiles"]}
    assert list(profiles) == ["fsdp2-core", "hsdp"]  # tests outside the case table: in none
    assert profiles["fsdp2-core"]["missing_capabilities"] == ["prefetch"]
    assert profiles["fsdp2-core"]["pass_percent"] is None
    assert (profiles["fsdp2-core"]["cases"], profiles["fsdp2-core"]["applied"]) == (3, 1)
    assert profiles["hsdp"]["unsupported"] == [
        {
            "needs": ["hsdp"],
            "cases": 2,
            "tests": [
                "acme_tests/test_acme_cases.py::test_hsdp_case[ws4]",
                "acme_tests/test_acme_cases.py::test_hsdp_accumulation_case[ws4]",
            ],
        }
    ]
    by_name = {test["nodeid"].split("::")[1]: test for test in report["tests"]}
    assert by_name["test_hsdp_accumulation_case[ws4]"]["case"] == "fsdp.grad_accum.grid_hsdp"
    assert by_name["test_hsdp_accumulation_case[ws4]"]["capabilities"] == [
        "gradient_accumulation",
        "hsdp",
    ]
    assert by_name["test_needs_hsdp"]["case"] is None


def page_rows(root: Path) -> dict[str, str]:
    """Each test's expandable row of ``conformance.html``, by node id (its HTML up to the
    next row)."""
    text = (root / "report" / "conformance.html").read_text()
    rows = {}
    for chunk in text.split('<details class="case"')[1:]:
        nodeid = chunk.split('data-nodeid="', 1)[1].split('"', 1)[0]
        rows[html.unescape(nodeid).split("::")[1]] = chunk
    return rows


def test_a_distributed_failure_carries_its_ranks_and_reproducer_into_json_and_page(vendor_run):
    _, report, root = vendor_run
    by_name = {test["nodeid"].split("::")[1]: test for test in report["tests"]}
    known = by_name["test_known_difference[ws2]"]
    assert known["ranks"] == [{"rank": 0, "outcome": "passed"}, {"rank": 1, "outcome": "failed"}]
    assert shlex.split(known["reproduce"])[2:4] == [
        "pytest",
        "acme_tests/test_acme.py::test_known_difference[ws2]",
    ]
    assert "--impl acme_fsdp:implementation --backend-plugin acme_backend" in known["reproduce"]
    passed = by_name["test_ranks_run_the_vendor_implementation_on_its_backend[ws2]"]
    assert passed["ranks"] == [{"rank": 0, "outcome": "passed"}, {"rank": 1, "outcome": "passed"}]
    assert passed["reproduce"] == ""  # only a run that did not pass needs one
    assert by_name["test_unlisted_failure"]["ranks"] == []  # not distributed

    rows = page_rows(root)
    row = rows["test_known_difference[ws2]"]
    assert 'data-status="XFAIL"' in row
    assert "rank 1 disagrees" in row
    assert '<span class="badge s-FAIL">failed</span>' in row  # rank 1 in the rank table
    assert html.escape(known["reproduce"]) in row
    assert 'href="https://example.invalid/acme/1"' in row  # the expectation's evidence
    # A failure outside the ranks still gets a command, built from the run's options.
    unlisted = rows["test_unlisted_failure"]
    assert "a real failure" in unlisted
    assert (
        "python -m pytest acme_tests/test_acme.py::test_unlisted_failure --impl "
        "acme_fsdp:implementation --launcher process --backend acmegloo --device cpu"
    ) in unlisted


def test_the_page_loads_in_a_real_browser_and_a_failing_row_expands(vendor_run):
    executable = find_chromium()
    if executable is None:
        pytest.skip(
            f"no Chromium to render the page: install Debian's chromium package (apt-get "
            f"install chromium; .ci/run does) or point ${BROWSER_ENV_VAR} at one"
        )
    _, report, root = vendor_run
    with chromium(executable) as browser:
        page = browser.new_page()
        page.load(root / "report" / "conformance.html")
        cells = page.evaluate(
            "Array.from(document.querySelectorAll('table.matrix td.cell')).map(cell => "
            "[cell.dataset.feature, cell.dataset.ws, cell.getBoundingClientRect().width > 0])"
        )
        features = {test["feature"] for test in report["tests"]}
        sizes = {"" if t["world_size"] is None else str(t["world_size"]) for t in report["tests"]}
        assert sorted(map(tuple, cells)) == sorted(
            (feature, size, True) for feature in features for size in sizes
        )

        row = 'details.case[data-status="FAIL"]'
        # What a reader sees: closed, the row's body is laid out but not rendered.
        visible_body = f"document.querySelector('{row} > .body').checkVisibility()"
        assert page.evaluate(f"document.querySelector('{row}').open") is False
        assert page.evaluate(visible_body) is False
        page.click(f"{row} > summary")
        assert page.evaluate(f"document.querySelector('{row}').open") is True
        assert page.evaluate(visible_body) is True
        shown = page.evaluate(f"document.querySelector('{row} > .body').innerText")
        assert "a real failure" in shown and "reproduce with:" in shown
        assert page.console_errors == []
