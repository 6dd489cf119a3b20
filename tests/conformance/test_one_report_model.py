"""One report model: the report a run builds and the one read back from its
``conformance.json`` are the same type, and render to the same text in every format.

The report here is built from hand-made TestReports (no ranks) and holds every part a format
shows: each status, the profiles of both subjects, per-rank outcomes, a reproduce command, an
expected failure inherited from the implementation it is built on, a stale entry and a run cut
short. Reports of older schema versions read back with what they lack left empty. A real run's
files are checked the same way in ``test_vendor_run.py`` and ``test_built_on.py``.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from distconform.conformance.compare import Change, Comparison
from distconform.conformance.expectations import Entry
from distconform.conformance.pages.run import case_row, render_run
from distconform.conformance.recorder import Recorder
from distconform.conformance.renderers import FILE_FORMATS, json_document, terminal
from distconform.conformance.report import (
    ConformanceReport,
    RunState,
    UnreadableReportError,
)
from distconform.conformance.report import TestResult as ResultRow  # not a test class
from tests.conformance.report_checks import check_json
from tests.conformance.test_profiles import (
    ALL_CAPABILITIES,
    BACKEND_AVG,
    BACKEND_CORE,
    CORE,
    EXTENSIONS,
    UNSUPPORTED_HSDP,
    backend_report,
    case_report,
)
from tests.conformance.test_report_units import report

EVERY_FORMAT = (*FILE_FORMATS, terminal.FORMAT)
INHERITED = "a::known_to_torch"


def environment() -> dict:
    return {
        "torch_version": "2.13.0", "python": "3.11.7", "platform": "Linux",
        "implementation": {
            "name": "acme", "spec": "acme:impl", "capabilities": ALL_CAPABILITIES,
            "built_on": "torch",
        },
        "backend_declaration": {
            "name": "vendorlink", "spec": None, "declaration": "vendorlink.toml",
            "capabilities": ["all_reduce", "reduce_op.avg"],
            "not_declared": {"dtype.float32": "no float32 reductions"},
        },
        "launcher": "process", "backend": "gloo", "device": "cpu", "world_sizes": [2],
        "seed": 0, "date": "2026-11-26T00:00:00Z", "backend_plugins": [],
        "expectations": "acme.toml, torch-2.13.toml", "command": ["pytest"],
        "stream_check": "unavailable", "junit_xml": None,
    }  # fmt: skip


def live_report() -> ConformanceReport:
    """A report as the plugin builds it at the end of a run that was interrupted."""
    recorder = Recorder()
    torch_entry = Entry(
        "xfail", INHERITED, "torch fixes its dtypes at lazy init", Path("torch-2.13.toml"), 12,
        "NOT_SUPPORTED", "https://example.invalid/torch", inherited_from="torch",
    )  # fmt: skip
    own_entry = Entry("xfail", "a::own_difference", "ours", Path("acme.toml"), 3, "NUMERICS")
    recorder.expect(INHERITED, torch_entry)
    recorder.expect("a::own_difference", own_entry)
    failed = case_report("a::core_failed", "failed", "gradient_accumulation", "boom")
    failed.user_properties += [
        ("rank_outcomes", "0:passed 1:failed"),
        ("reproduce", "python -m pytest a::core_failed"),
    ]
    for made in (
        case_report("a::core", "passed", ""),
        failed,
        case_report("a::cpu_skip", "skipped", "", ("x.py", 3, "CPU: needs events")),
        case_report("a::hsdp", "skipped", "hsdp", UNSUPPORTED_HSDP),
        case_report("a::hsdp_ok", "passed", "gradient_accumulation,hsdp"),
        report(INHERITED, "call", "skipped", "RuntimeError: dtype", wasxfail="x"),
        report("a::own_difference", "call", "passed", wasxfail="x"),
        report("a::setup_error", "setup", "failed", "boom in setup"),
        backend_report("b::core", "passed", "all_reduce,dtype.float32"),
        backend_report("b::core_failed", "failed", "all_reduce", "wrong sum"),
        backend_report("b::avg", "passed", "all_reduce,reduce_op.avg"),
    ):
        recorder.add(made)
    stale = [Entry("xfail", "a::renamed", "gone", Path("acme.toml"), 9)]
    run = RunState(
        exit_status="INTERRUPTED", stopped_because="interrupted", tests_expected=14,
        tests_cut_short=1,
    )  # fmt: skip
    profiles = [CORE, *EXTENSIONS, BACKEND_CORE, BACKEND_AVG]
    return recorder.build(environment(), stale, profiles, run)


def saved(built: ConformanceReport) -> dict:
    """``built`` as its ``conformance.json`` holds it, checked against the schema."""
    data = json.loads(json_document.FORMAT.render(built))
    check_json(data)
    return data


def test_a_report_read_back_from_json_renders_like_the_live_one_in_every_format(tmp_path):
    live = live_report()
    statuses = {result.status for result in live.tests}
    assert statuses == {"PASS", "FAIL", "XFAIL", "XPASS", "UNSUPPORTED", "SKIP"}
    path = tmp_path / "conformance.json"
    path.write_text(json_document.FORMAT.render(live))
    loaded = ConformanceReport.load(path)
    assert type(loaded) is ConformanceReport and loaded.source == path
    for fmt in EVERY_FORMAT:
        assert fmt.render(loaded) == fmt.render(live), fmt.name
    # What each format shows of the parts that only a faithful reading keeps.
    assert loaded.by_nodeid()[INHERITED].inherited_from == "torch"
    assert [result.profile.subject for result in loaded.profile_results()] == [
        "implementation", "implementation", "backend", "backend",
    ]  # fmt: skip
    markdown = next(fmt for fmt in FILE_FORMATS if fmt.name == "markdown").render(loaded)
    assert "XFAIL (inherited from torch: torch fixes its dtypes at lazy init)" in markdown
    assert "stale expectation: acme.toml:9: xfail entry 'a::renamed'" in markdown
    assert markdown.startswith("# Conformance report: acme and backend vendorlink\n\n**INCOMPLETE")


def test_what_was_recorded_survives_the_round_trip_field_by_field():
    live = live_report()
    loaded = ConformanceReport.from_json(saved(live))
    assert loaded.tests == live.tests
    assert (loaded.environment, loaded.stale, loaded.run) == (
        live.environment,
        live.stale,
        live.run,
    )
    assert loaded.to_json() == live.to_json()


def downgraded(data: dict, version: int) -> dict:
    """``data`` as schema ``version`` wrote it: without the fields added since."""
    old = json.loads(json.dumps(data))
    old["schema_version"] = version
    for profile in old["profiles"]:
        del profile["subject"]  # 7
    for test in old["tests"]:
        del test["inherited_from"]  # 7
    if version < 6:
        del old["verdict"]
        for profile in old["profiles"]:
            del profile["verdict"]
    if version < 5:
        for test in old["tests"]:
            del test["ranks"], test["reproduce"]
    return old


@pytest.mark.parametrize("version", [4, 5, 6])
def test_a_report_of_an_older_schema_version_renders_what_it_recorded(version):
    """Older reports lack some fields: read back, they render as a live report without
    those; the verdicts and each profile's subject are derived again."""
    live = live_report()
    old = downgraded(saved(live), version)
    for result in live.tests:
        result.inherited_from = None
        if version < 5:
            result.ranks, result.reproduce = [], ""
    loaded = ConformanceReport.from_json(old, Path(f"v{version}.json"))
    for fmt in EVERY_FORMAT:
        assert fmt.render(loaded) == fmt.render(live), (version, fmt.name)


def test_what_is_not_a_readable_report_is_refused_naming_the_file():
    data = saved(live_report())
    for broken, message in (
        ({**data, "schema_version": 99}, "v.json: schema version 99; this distconform reads"),
        ({**data, "schema": "other"}, "v.json: not a conformance report"),
        ({**data, "tests": [{"nodeid": "a", "status": "MAYBE"}]}, "a test entry is malformed"),
        ([], "v.json: not a conformance report (schema 'list'"),
    ):
        with pytest.raises(UnreadableReportError, match=message.replace("(", r"\(")):
            ConformanceReport.from_json(broken, Path("v.json"))


def parameters(function) -> list:
    hints = typing.get_type_hints(function)
    return [hint for name, hint in hints.items() if name != "return"]


def test_every_renderer_takes_the_one_report_type():
    for fmt in EVERY_FORMAT:
        assert parameters(fmt.render) == [ConformanceReport], fmt.name
        assert typing.get_type_hints(fmt.render)["return"] is str, fmt.name
    assert parameters(render_run) == [ConformanceReport]
    assert parameters(case_row) == [ResultRow, ConformanceReport | None]
    # compare and history pages hold reports and their tests, nothing else.
    comparison = typing.get_type_hints(Comparison)
    assert (comparison["baseline"], comparison["other"]) == (ConformanceReport, ConformanceReport)
    assert typing.get_type_hints(Change)["after"] == ResultRow | None
