"""Conformance profiles: the case table's ``[profile.*]`` rows, the user properties collection
gives each case-tied item, and the report's per-profile headline (from hand-made TestReports,
no ranks). A required profile whose capabilities are not all declared gets no percentage.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from distconform.conformance.recorder import Recorder, profiles_from_hook
from distconform.conformance.renderers import markdown, terminal, text
from distconform.conformance.report import ConformanceReport, profiles_of_test
from distconform.conformance.statuses import RunState
from distconform.harness.shared.outcomes import STREAM_SAFETY_HEADLINE
from distconform.impl.api import KNOWN_CAPABILITIES
from distconform.suites.cases import (
    CAPABILITIES_PROPERTY,
    CASE_PROPERTY,
    IMPLEMENTATION,
    SUBJECT_PROPERTY,
    Profile,
    load_profiles,
    parse_profiles,
)
from tests.conformance.report_checks import check_markdown
from tests.conformance.test_report_units import report
from tests.suites.test_cases import collect

CORE_CAPABILITIES = {
    "reshard_after_forward_int",
    "gradient_accumulation",
    "mixed_precision",
    "prefetch",
    "forward_method",
}
UNSUPPORTED_HSDP = ("x.py", 3, "Skipped: UNSUPPORTED: needs capability hsdp")

# --- the case table's profiles ---------------------------------------------------------------


def test_the_table_defines_the_required_core_and_one_extension_per_other_capability():
    profiles = [p for p in load_profiles() if p.subject == IMPLEMENTATION]
    core = profiles[0]
    assert (core.name, core.required, set(core.capabilities)) == (
        "fsdp2-core",
        True,
        CORE_CAPABILITIES,
    )
    extensions = profiles[1:]
    assert [p.name for p in extensions] == sorted(KNOWN_CAPABILITIES - CORE_CAPABILITIES)
    assert all(not p.required and p.capabilities == (p.name,) for p in extensions)


def test_the_backend_table_has_its_own_core_and_extensions():
    from distconform.suites.backend_capabilities import KNOWN_BACKEND_CAPABILITIES
    from distconform.suites.cases import BACKEND

    profiles = [p for p in load_profiles() if p.subject == BACKEND]
    assert (profiles[0].name, profiles[0].required) == ("c10d-core", True)
    listed = {cap for p in profiles for cap in p.capabilities}
    assert listed == KNOWN_BACKEND_CAPABILITIES
    assert not any(p.required for p in profiles[1:])


PROFILE_ROW = """
[profile."mini"]
description = "a test profile"
required = true
capabilities = ["prefetch"]
"""


def test_profile_rows_are_validated_like_cases():
    parsed = parse_profiles(PROFILE_ROW, known_capabilities=KNOWN_CAPABILITIES)
    assert parsed == {"mini": Profile("mini", "a test profile", True, ("prefetch",))}
    with pytest.raises(ValueError, match=r"unknown capabilities \['prefetching'\]"):
        parse_profiles(
            PROFILE_ROW.replace('"prefetch"', '"prefetching"'),
            known_capabilities=KNOWN_CAPABILITIES,
        )
    with pytest.raises(ValueError, match="unknown keys"):
        parse_profiles(PROFILE_ROW + 'extends = "core"\n')
    with pytest.raises(ValueError, match="required must be true or false"):
        parse_profiles(PROFILE_ROW.replace("required = true", 'required = "yes"'))
    with pytest.raises(ValueError, match="lists no capabilities"):
        parse_profiles(PROFILE_ROW.replace('["prefetch"]', "[]"))


def test_the_conformance_plugins_hook_answer_parses_back():
    from distconform.conformance.plugin import pytest_distconform_conformance_profiles

    answer = pytest_distconform_conformance_profiles(config=None)
    assert json.loads(json.dumps(answer)) == answer  # plain data, as the hook promises
    assert profiles_from_hook(answer) == list(load_profiles())
    with pytest.raises(ValueError, match="needs name"):
        profiles_from_hook([{"name": "x", "capabilities": "hsdp"}])
    with pytest.raises(ValueError, match="defined twice"):
        profiles_from_hook([{"name": "x", "capabilities": []}] * 2)


# --- user properties at collection -----------------------------------------------------------


def properties(item) -> dict[str, str]:
    return dict(item.user_properties)


@pytest.mark.parametrize(
    ("case_id", "world_size", "param_id", "capabilities", "needs"),
    [
        ("fsdp.world_size_1", 1, "", KNOWN_CAPABILITIES, ""),
        ("fsdp.prefetch.explicit", 2, "", KNOWN_CAPABILITIES, "prefetch"),
        # The case's requires plus its grid values' param_requires, sorted; skipped or not.
        (
            "fsdp.grad_accum.grid",
            2,
            "mesh=1d-raf=2-mode=root_only-rab=True-offload=cpu-rso=False",
            set(),
            "cpu_offload,gradient_accumulation,reshard_after_forward_int",
        ),
        ("fsdp.post_optim_event", 2, "", KNOWN_CAPABILITIES, "post_optim_event"),  # CPU: skip
    ],
)
def test_every_case_item_records_its_case_and_needs(
    case_id, world_size, param_id, capabilities, needs
):
    item = collect(case_id, world_size, param_id, capabilities=capabilities)
    assert item.user_properties == [
        (CASE_PROPERTY, case_id),
        (CAPABILITIES_PROPERTY, needs),
        (SUBJECT_PROPERTY, IMPLEMENTATION),
    ]


def test_recording_twice_keeps_one_entry_each():
    from distconform.harness.controller.session import world_size_of
    from distconform.suites.cases import apply_case_table

    item = collect("fsdp.prefetch.explicit", 2)
    apply_case_table(
        [item],
        device_type="cpu",
        launcher="process",
        capabilities_of=lambda subject: frozenset(),
        world_size_of=world_size_of,
    )
    assert len(item.user_properties) == 3


# --- the report ------------------------------------------------------------------------------

CORE = Profile("fsdp2-core", "the core", True, tuple(sorted(CORE_CAPABILITIES)))
EXTENSIONS = [Profile(cap, f"extension: {cap}", False, (cap,)) for cap in ("cpu_offload", "hsdp")]
ALL_CAPABILITIES = sorted(CORE_CAPABILITIES | {"cpu_offload", "hsdp"})


def case_report(nodeid: str, outcome: str, needs: str, longrepr=None, case="c", when="call"):
    props = [(CASE_PROPERTY, case), (CAPABILITIES_PROPERTY, needs)]
    return report(nodeid, when, outcome, longrepr, user_properties=props)


def build(*reports, declared=ALL_CAPABILITIES, profiles=(CORE, *EXTENSIONS)):
    recorder = Recorder()
    for made in reports:
        recorder.add(made)
    environment = {"implementation": {"name": "acme", "capabilities": list(declared)}}
    return recorder.build(environment, [], profiles)


def test_user_properties_are_read_from_the_reports():
    built = build(
        case_report("a::ran", "passed", "hsdp,prefetch"),
        case_report("a::skipped", "skipped", "hsdp", UNSUPPORTED_HSDP, when="setup"),
        report("a::plain", "call", "passed", user_properties=[(CAPABILITIES_PROPERTY, "hsdp")]),
    )
    found = {r.nodeid: (r.case, r.capabilities) for r in built.tests}
    assert found == {
        "a::ran": ("c", ["hsdp", "prefetch"]),
        "a::skipped": ("c", ["hsdp"]),
        "a::plain": (None, []),  # "capabilities" without a case is someone else's property
    }


def test_membership_core_when_every_need_is_core_else_each_extension():
    profiles = [CORE, *EXTENSIONS]
    assert profiles_of_test([], profiles) == [CORE]
    assert profiles_of_test(["prefetch", "mixed_precision"], profiles) == [CORE]
    assert profiles_of_test(["prefetch", "hsdp"], profiles) == [EXTENSIONS[1]]
    assert profiles_of_test(["cpu_offload", "hsdp"], profiles) == EXTENSIONS


def test_a_missing_core_capability_withholds_the_percentage_and_is_named():
    built = build(
        case_report("a::core_ok", "passed", ""),
        case_report("a::core_ok2", "passed", "mixed_precision"),
        case_report("a::needs_prefetch", "skipped", "prefetch",
                    ("x.py", 3, "Skipped: UNSUPPORTED: needs capability prefetch")),
        declared=sorted(set(ALL_CAPABILITIES) - {"prefetch"}),
    )  # fmt: skip
    lines = terminal.lines(built)
    assert lines[:2] == [
        "verdict: NOT CONFORMANT (to fsdp2-core)",
        "  fsdp2-core: NOT CONFORMANT (does not declare prefetch)",
    ]
    assert lines[4] == (
        "  fsdp2-core (required): 2 of 3 cases applied, no pass rate (does not declare "
        "prefetch); UNSUPPORTED: 1 case needs prefetch"
    )
    assert lines[-1].startswith("verdict: NOT CONFORMANT (to fsdp2-core); conformance ")
    assert "100.0 %" in lines[-1]  # the overall figure stays, no longer alone
    (core,) = built.to_json()["profiles"]
    assert (core["name"], core["declared"], core["missing_capabilities"]) == (
        "fsdp2-core",
        False,
        ["prefetch"],
    )
    assert (core["cases"], core["applied"], core["pass_percent"]) == (3, 2, None)
    check_markdown(markdown.render(built))
    page = markdown.render(built).splitlines()
    assert page[2:5] == [
        "verdict: **NOT CONFORMANT** (to fsdp2-core)",
        "",
        "- fsdp2-core: **NOT CONFORMANT** (does not declare prefetch)",
    ]
    assert built.to_json()["verdict"] == {
        "name": "verdict",
        "status": "NOT CONFORMANT",
        "conformant": False,
        "line": "verdict: NOT CONFORMANT (to fsdp2-core)",
    }


def test_extensions_get_their_own_line_with_grouped_unsupported_cases():
    unsupported = ("x.py", 3, "Skipped: UNSUPPORTED: needs capability cpu_offload")
    built = build(
        case_report("a::core", "passed", ""),
        case_report("a::core_failed", "failed", "gradient_accumulation", "boom"),
        case_report("a::cpu_skip", "skipped", "", ("x.py", 3, "CPU: needs events")),
        *(case_report(f"a::hsdp{i}", "skipped", "hsdp", UNSUPPORTED_HSDP) for i in range(3)),
        case_report("a::hsdp_ok", "passed", "gradient_accumulation,hsdp"),
        case_report("a::both", "skipped", "cpu_offload,hsdp", unsupported),
        declared=sorted(CORE_CAPABILITIES),
    )
    headline = text.headline_lines(built)
    assert headline == [
        "verdict: NOT CONFORMANT (to fsdp2-core)",
        "  fsdp2-core: NOT CONFORMANT (1 of 2 cases fail)",
        "  cpu_offload: NOT CLAIMED (1 case UNSUPPORTED)",
        "  hsdp: CONFORMANT",
        "",
        "profiles (cases applied of those collected from the case table; pass rate over the "
        "applied ones):",
        "  fsdp2-core (required): 2 of 3 cases applied, pass rate 50.0 %; 1 SKIP",
        "  cpu_offload (extension): 0 of 1 case applied; UNSUPPORTED: 1 case needs "
        "cpu_offload + hsdp",
        "  hsdp (extension): 1 of 5 cases applied, pass rate 100.0 %; UNSUPPORTED: 3 cases "
        "need hsdp, 1 case needs cpu_offload + hsdp",
    ]
    assert terminal.lines(built)[: len(headline)] == headline
    hsdp = built.to_json()["profiles"][2]
    assert hsdp["unsupported"] == [
        {"needs": ["hsdp"], "cases": 3, "tests": ["a::hsdp0", "a::hsdp1", "a::hsdp2"]},
        {"needs": ["cpu_offload", "hsdp"], "cases": 1, "tests": ["a::both"]},
    ]


@pytest.mark.parametrize(
    ("state", "device", "line"),
    [
        ("on", "fakeaccel", "stream safety: checked on fakeaccel in every distributed test; "
         "1 failed on accesses no synchronisation orders"),
        ("off", "fakeaccel", "stream safety: not checked (--no-dist-stream-check)"),
        ("unavailable", "cpu", "stream safety: not checked (cpu has no stream checker; "
         "--device fakeaccel checks every kernel, wait and free)"),
    ],
)  # fmt: skip
def test_the_profiles_say_whether_stream_safety_was_checked(state, device, line):
    unordered = f"StreamSafetyError: rank 1: 3 {STREAM_SAFETY_HEADLINE} (stream checker)"
    built = build(
        case_report("a::core", "passed", ""),
        case_report("a::racy", "failed", "", unordered),
        case_report("a::wrong", "failed", "", "AssertionError: gradient of w differs"),
    )
    built.environment = {**built.environment, "stream_check": state, "device": device}
    assert text.headline_lines(built)[-1] == f"  {line}"
    assert f"- {line}" in markdown.render(built)


def test_without_distributed_settings_there_is_no_stream_safety_line():
    built = build(case_report("a::core", "passed", ""))
    assert not any("stream safety" in line for line in text.headline_lines(built))


def test_an_extension_with_no_cases_in_the_run_has_no_line():
    built = build(case_report("a::core", "passed", ""))
    assert [p["name"] for p in built.to_json()["profiles"]] == ["fsdp2-core"]


def old_style_report() -> ConformanceReport:
    # Reports without case properties: a project's own tests, or no profile hook.
    return build(
        report("a::ok", "call", "passed"),
        report("a::unsupported", "setup", "skipped", UNSUPPORTED_HSDP),
        profiles=(),
    )


def test_without_profiles_the_output_is_the_old_one():
    built = old_style_report()
    assert text.headline_lines(built) == []
    assert terminal.lines(built)[0].startswith("implementation: acme")
    assert terminal.lines(built)[-1] == (
        "conformance 100.0 % ((PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL))"
    )
    page = markdown.render(built)
    assert page.startswith("# Conformance report: acme\n\n- implementation: acme")
    assert "profiles" not in page and "Run:" not in page
    assert built.to_json()["profiles"] == []
    # Profiles known, but no test of the run tied to a case: no headline either.
    with_profiles = build(report("a::ok", "call", "passed"))
    assert text.headline_lines(with_profiles) == [] and with_profiles.to_json()["profiles"] == []


def test_markdown_headings_after_a_list_start_a_new_block():
    built = build(
        report("a::bad", "call", "failed", "boom"),
        report("a::unsupported", "setup", "skipped", UNSUPPORTED_HSDP),
        profiles=(),
    )
    # Rendered, each section heading is its own paragraph, not the tail of the list above.
    check_markdown(markdown.render(built))
    incomplete = build(report("a::bad", "call", "failed", "boom"), profiles=())
    incomplete.run = RunState(exit_status="INTERRUPTED", stopped_because="interrupted")
    check_markdown(markdown.render(incomplete))


# --- the hook, through the plugin ------------------------------------------------------------

OWN_PROFILE_CONFTEST = """
import pytest


def pytest_distconform_conformance_profiles(config):
    return [{"name": "mini-core", "description": "", "required": True,
             "capabilities": ["share_comm_ctx"]}]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        item.user_properties.append(("conformance_case", "mini.case"))
        item.user_properties.append(("capabilities", ""))
"""


def test_the_plugin_takes_profiles_from_the_hook_and_none_without_case_tied_tests(pytester):
    pytester.makepyfile(test_own="def test_a():\n    pass\n")
    args = ["--conformance-table", "-p", "no:cacheprovider"]
    without = pytester.runpytest_inprocess(*args)
    without.assert_outcomes(passed=1)
    summary = without.stdout.str().split("= conformance =", 1)[1].splitlines()
    assert summary[1].startswith("implementation: reference"), summary  # the old first line
    assert "profiles (" not in without.stdout.str()

    pytester.makeconftest(textwrap.dedent(OWN_PROFILE_CONFTEST))
    with_hook = pytester.runpytest_inprocess(*args)
    with_hook.assert_outcomes(passed=1)
    with_hook.stdout.fnmatch_lines(
        [
            "verdict: NOT CONFORMANT (to mini-core)",
            "  mini-core: NOT CONFORMANT (does not declare share_comm_ctx)",
            "*mini-core (required): 1 of 1 case applied, no pass rate "
            "(does not declare share_comm_ctx)",
        ]
    )


# --- two subjects: an implementation and a backend ----------------------------------------

BACKEND_CORE = Profile(
    "c10d-core", "backend core", True, ("all_reduce", "dtype.float32"), "backend"
)
BACKEND_AVG = Profile("reduce_op.avg", "extension", False, ("reduce_op.avg",), "backend")


def backend_report(nodeid: str, outcome: str, needs: str, longrepr=None):
    props = [(CASE_PROPERTY, "backend.x"), (CAPABILITIES_PROPERTY, needs)]
    props.append((SUBJECT_PROPERTY, "backend"))
    return report(nodeid, "call", outcome, longrepr, user_properties=props)


def test_each_subject_counts_in_its_own_profiles_with_its_own_declaration():
    recorder = Recorder()
    for made in (
        case_report("a::impl_core", "passed", ""),
        backend_report("b::core", "passed", "all_reduce,dtype.float32"),
        backend_report("b::core_failed", "failed", "all_reduce", "wrong"),
        backend_report("b::avg", "passed", "all_reduce,reduce_op.avg"),
    ):
        recorder.add(made)
    environment = {
        "implementation": {"name": "acme", "capabilities": ALL_CAPABILITIES},
        "backend_declaration": {
            "name": "vendorlink",
            "declaration": "vendorlink.toml",
            "capabilities": ["all_reduce", "reduce_op.avg"],  # not dtype.float32
            "not_declared": {"dtype.float32": "why"},
        },
    }
    built = recorder.build(environment, [], [CORE, *EXTENSIONS, BACKEND_CORE, BACKEND_AVG])
    assert built.subjects() == ["implementation", "backend"]
    results = {r.profile.name: r for r in built.profile_results()}
    assert [t.nodeid for t in results["fsdp2-core"].tests] == ["a::impl_core"]
    assert [t.nodeid for t in results["c10d-core"].tests] == ["b::core", "b::core_failed"]
    assert [t.nodeid for t in results["reduce_op.avg"].tests] == ["b::avg"]
    assert not results["fsdp2-core"].withheld  # the implementation declares its core
    assert results["c10d-core"].missing_capabilities == ["dtype.float32"]
    assert text.verdict_lines(built) == [
        "verdict: NOT CONFORMANT (to c10d-core)",
        "  fsdp2-core: CONFORMANT",
        "  c10d-core: NOT CONFORMANT (1 of 2 cases fail)",
        "  reduce_op.avg: CONFORMANT",
    ]
    assert built.title == "acme and backend vendorlink"
    assert "- `dtype.float32`: why" in markdown.render(built)
    header = text.header_lines(built)
    assert any(line.startswith("backend under test: vendorlink") for line in header)


def test_a_backend_only_run_shows_no_implementation():
    recorder = Recorder()
    recorder.add(backend_report("b::core", "passed", "all_reduce"))
    environment = {
        "implementation": {"name": "reference", "capabilities": []},
        "backend_declaration": {"name": "gloo", "capabilities": ["all_reduce", "dtype.float32"]},
    }
    built = recorder.build(environment, [], [CORE, BACKEND_CORE])
    assert [r.profile.name for r in built.profile_results()] == ["c10d-core"]
    assert built.title == "backend gloo"
    assert not any(line.startswith("implementation:") for line in text.header_lines(built))
