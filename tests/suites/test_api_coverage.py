"""The public API coverage tables (``suites/coverage/*.toml``, one per family the suites claim;
``suites/backend/api_coverage.toml`` for c10d): every public name of the installed torch has a
row, none is left uncovered, every row tells the truth about this release, and the rows are
validated against the case table."""

from __future__ import annotations

import pytest

from distconform.harness.torch_window import installed_torch_version
from distconform.suites.api_coverage import (
    BACKEND_COVERAGE_FILE,
    COVERAGE_FILE,
    FAMILIES,
    coverage_problems,
    parse_coverage,
    read_coverage,
    release,
    row_group,
    uncovered_problems,
)
from distconform.suites.api_surface import SURFACES, c10d_surface, public_surface, value_classes
from distconform.suites.cases import (
    BACKEND,
    BACKEND_CASES_FILE,
    CASES_FILE,
    IMPLEMENTATION,
    read_cases,
)

CASES = read_cases(CASES_FILE, IMPLEMENTATION)
BACKEND_CASES = read_cases(BACKEND_CASES_FILE, BACKEND)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_every_public_name_of_the_installed_torch_has_a_row(family):
    rows = read_coverage(CASES, family.table)
    surface = SURFACES[family.name]()
    problems = coverage_problems(rows, surface, installed_torch_version(), family.table)
    problems += uncovered_problems(rows, surface, family.table)
    assert problems == [], "\n".join(problems)


def test_a_name_is_listed_by_one_family_only():
    owners: dict[str, str] = {}
    twice = []
    for family in FAMILIES:
        for row in read_coverage(CASES, family.table):
            for name in row.names:
                if name in owners:
                    twice.append(f"{name}: in {owners[name]} and {family.name}")
                owners[name] = family.name
    assert twice == []


def test_value_classes_come_from_the_annotation():
    assert value_classes("bool | int | None") == ["True", "False", "int", "None"]
    assert value_classes("Optional[torch.dtype]") == ["dtype", "None"]
    assert value_classes("Placement | tuple[Placement | None, ...] | None") == [
        "Shard",
        "Replicate",
        "tuple",
        "None",
    ]
    # One class, or only containers of one: no choice to cover.
    assert value_classes("int") == []
    assert value_classes("DeviceMesh | None") == []
    assert value_classes("torch.Tensor | tuple[torch.Tensor, ...] | None") == []
    assert value_classes("dict[str, Placement] | None") == []


def test_the_surface_lists_value_classes_and_method_arguments():
    surface = set(public_surface())
    assert {
        "fully_shard(reshard_after_forward=True)",
        "fully_shard(reshard_after_forward=int)",
        "MixedPrecisionPolicy.cast_forward_inputs=False",
        "FSDPModule.set_requires_gradient_sync(recurse=False)",
    } <= surface
    assert "StateDictOptions.broadcast_from_rank0=True" in SURFACES["state_dict"]()
    assert "RowwiseParallel(input_layouts=Shard)" in SURFACES["tensor_parallel"]()
    pipelining = SURFACES["pipelining"]()
    assert {"ScheduleGPipe(scale_grads=False)", "Schedule1F1B.step(losses)"} <= set(pipelining)


def test_row_groups():
    assert row_group("fully_shard(reshard_after_forward=int)") == "fully_shard"
    assert row_group("StateDictOptions.strict=True") == "StateDictOptions.strict"
    assert row_group("FSDPModule.unshard(async_op)") == "FSDPModule.unshard"


def test_a_name_left_uncovered_fails_where_torch_has_it():
    rows = parse_coverage(
        ROW.replace('cases = ["fsdp.parity.single_group"]', 'uncovered = "x"'), CASES
    )
    (problem,) = uncovered_problems(rows, ["fully_shard"], COVERAGE_FILE)
    assert problem.startswith("fully_shard: uncovered in suites/coverage/fsdp.toml")
    assert uncovered_problems(rows, ["replicate"], COVERAGE_FILE) == []


def test_every_public_c10d_name_of_the_installed_torch_has_a_row():
    rows = read_coverage(BACKEND_CASES, BACKEND_COVERAGE_FILE)
    torch = installed_torch_version()
    assert coverage_problems(rows, c10d_surface(), torch, BACKEND_COVERAGE_FILE) == []
    new = coverage_problems(rows, [*c10d_surface(), "all_reduce_v2"], torch, BACKEND_COVERAGE_FILE)
    assert new == [
        f"all_reduce_v2: public in torch {torch[0]}.{torch[1]} but in no row of "
        "suites/backend/api_coverage.toml (add it with the cases that exercise it, or why it "
        "is out of scope or uncovered)"
    ]
    # A class only CUDA builds have is never missing; one every build has is.
    cpu_build = [n for n in c10d_surface() if n not in ("ProcessGroupNCCL", "all_reduce")]
    (missing,) = coverage_problems(rows, cpu_build, torch, BACKEND_COVERAGE_FILE)
    assert missing.startswith("all_reduce: listed for torch 2.11 and later")


def test_the_surface_is_read_from_torch_not_from_the_table():
    surface = set(public_surface())
    # FSDP2's own objects are expanded; FSDP1's are listed by name only.
    assert {"fully_shard(mesh)", "FSDPModule.unshard", "UnshardHandle.wait"} <= surface
    assert {"MixedPrecisionPolicy.param_dtype", "CPUOffloadPolicy.pin_memory"} <= surface
    assert {"replicate", "replicate(mesh)", "register_fsdp_forward_method(method_name)"} <= surface
    assert "FullyShardedDataParallel" in surface
    assert not any(name.startswith("FullyShardedDataParallel.") for name in surface)


def test_a_name_a_new_release_adds_fails_until_a_row_lists_it():
    rows = read_coverage(CASES)
    surface = [*public_surface(), "FSDPModule.set_new_thing", "fully_shard(new_arg)"]
    problems = coverage_problems(rows, surface, installed_torch_version())
    assert [problem.split(":")[0] for problem in problems] == [
        "FSDPModule.set_new_thing",
        "fully_shard(new_arg)",
    ]
    assert "in no row of suites/coverage/fsdp.toml" in problems[0]


def test_a_row_claiming_a_name_this_release_lacks_fails():
    rows = read_coverage(CASES)
    surface = [name for name in public_surface() if name != "FSDPModule.reshard"]
    (problem,) = coverage_problems(rows, surface, installed_torch_version())
    assert problem.startswith("FSDPModule.reshard: listed for torch 2.11 and later")


def test_since_dates_a_name_to_the_release_that_added_it():
    rows = read_coverage(CASES)
    until_2_14 = [name for row in rows if release(row.since) <= (2, 14) for name in row.names]
    added_in_2_15 = sorted(name for row in rows if row.since == "2.15" for name in row.names)
    assert "FSDPModule.finalize_backward" in added_in_2_15
    assert coverage_problems(rows, until_2_14, (2, 14)) == []
    missing = coverage_problems(rows, until_2_14, (2, 15))
    assert [problem.split(":")[0] for problem in missing] == added_in_2_15


ROW = """
[[api]]
names = ["fully_shard"]
cases = ["fsdp.parity.single_group"]
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ROW.replace("fsdp.parity.single_group", "fsdp.nope"), "no case 'fsdp.nope'"),
        (ROW + 'uncovered = "x"\n', "exactly one of cases, out_of_scope or uncovered"),
        (ROW.replace('cases = ["fsdp.parity.single_group"]', ""), "exactly one of"),
        (ROW + 'since = "2.9"\n', "not a release of the window"),
        (ROW + 'sinse = "2.12"\n', "unknown keys"),
        (ROW + ROW, "listed in an earlier row too"),
        (ROW.replace('["fully_shard"]', "[]"), "names must be a non-empty list"),
    ],
)
def test_rows_are_validated(text, message):
    with pytest.raises(ValueError, match=message):
        parse_coverage(text, CASES)


def test_every_row_names_only_implemented_cases():
    rows = read_coverage(CASES)
    assert rows and all(CASES[case].suite for row in rows for case in row.cases)
    assert COVERAGE_FILE.name == "fsdp.toml"
