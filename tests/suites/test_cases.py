"""The case table's collection rules (``suites/cases.py``), composition cases included.

The unit tests feed ``apply_case_table`` the project's own table and stand-in items (only what
it reads of a pytest item: the case marker, the callspec and the marks it adds). One test
collects the real composition modules in a child pytest, with an implementation that declares
no capability, and reads back each item's marks: the items a CPU cannot run say ``CPU:``
(before any capability), the others ``UNSUPPORTED: needs capability ...`` with every
capability the case and its parameter tokens need; and every composition test that takes the
``impl`` fixture is tied to a case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from distconform.harness.controller.session import WORLD_SIZE_PARAM, world_size_of
from distconform.impl.api import KNOWN_CAPABILITIES
from distconform.suites.cases import CASE_MARKER, apply_case_table, load_cases, parse_cases

ROOT = Path(__file__).resolve().parents[2]
TP_ATTENTION_CPU = "CPU: no sharding strategy for CPU attention on TP activations in torch 2.13"
COMPOSITION_CASES = {
    "fsdp.tp.2d_mesh",
    "fsdp.tp.3d_hsdp_mesh",
    "fsdp.tp.shard_placement_fn_tp_ep",
    "fsdp.tp.layout",
    "replicate.tp",
    "pp.parity",
    "pp.one_reduction_per_step",
    "pp.microbatch_scaling",
    "pp.tp_dp_3d",
    "pp.dcp.stage_fqns",
    "dcp.continue_training",
}


class StandInItem:
    """The parts of a pytest item that ``apply_case_table`` reads and writes."""

    def __init__(self, case_id: str, world_size: int, param_id: str = "") -> None:
        full_id = f"ws{world_size}-{param_id}" if param_id else f"ws{world_size}"
        self.callspec = SimpleNamespace(id=full_id, params={WORLD_SIZE_PARAM: world_size})
        # The case marker as apply_case_table reads it (name and args), unregistered here.
        self.marks = [SimpleNamespace(name=CASE_MARKER, args=(case_id,), kwargs={})]
        self.user_properties: list[tuple[str, object]] = []

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, decorator) -> None:
        self.marks.append(decorator.mark)

    @property
    def slow(self) -> bool:
        return self.get_closest_marker("slow") is not None

    @property
    def skip_reason(self) -> str | None:
        # pytest skips with the first skip mark of an item.
        skip = self.get_closest_marker("skip")
        return None if skip is None else skip.kwargs["reason"]


def collect(
    case_id: str,
    world_size: int,
    param_id: str = "",
    *,
    capabilities=KNOWN_CAPABILITIES,
    device_type: str = "cpu",
) -> StandInItem:
    item = StandInItem(case_id, world_size, param_id)
    apply_case_table(
        [item],
        device_type=device_type,
        launcher="process",
        capabilities_of=lambda subject: frozenset(capabilities),
        world_size_of=world_size_of,
    )
    return item


def test_composition_cases_are_rows_of_the_table():
    cases = load_cases()
    assert set(cases) >= COMPOSITION_CASES
    for case_id in COMPOSITION_CASES:
        assert cases[case_id].suite.startswith("composition/"), case_id


@pytest.mark.parametrize(
    ("case_id", "world_size", "param_id", "capabilities", "reason"),
    [
        # Case-level needs, named in sorted order.
        ("pp.dcp.stage_fqns", 4, "", {"dcp"}, "UNSUPPORTED: needs capability pp"),
        ("pp.dcp.stage_fqns", 4, "", set(), "UNSUPPORTED: needs capability dcp, pp"),
        # Bare tokens of value-only ids add their capabilities ...
        (
            "pp.parity",
            4,
            "1F1B-replicate-bf16",
            {"pp"},
            "UNSUPPORTED: needs capability mixed_precision, replicate",
        ),
        (
            "pp.parity",
            4,
            "1F1B-fully_shard-bf16",
            {"pp", "replicate"},
            "UNSUPPORTED: needs capability mixed_precision",
        ),
        (
            "dcp.continue_training",
            8,
            "hsdp-to-fsdp-half",
            {"dcp"},
            "UNSUPPORTED: needs capability hsdp",
        ),
        (
            "dcp.continue_training",
            4,
            "fsdp-to-replicate",
            {"dcp", "hsdp"},
            "UNSUPPORTED: needs capability replicate",
        ),
        # ... and only those tokens: "fsdp-half" is not "hsdp", 1F1B not Interleaved1F1B.
        ("dcp.continue_training", 4, "fsdp-half-to-fsdp", {"dcp"}, None),
        ("pp.parity", 4, "1F1B-fully_shard-fp32", {"pp"}, None),
        # name=value tokens in the tensor-parallel grids.
        (
            "fsdp.tp.2d_mesh",
            4,
            "raf=True-ac=True-dim=3",
            {"tp"},
            "UNSUPPORTED: needs capability activation_checkpointing",
        ),
        ("replicate.tp", 4, "ac=False-dim=3", {"tp"}, "UNSUPPORTED: needs capability replicate"),
        (
            "fsdp.tp.shard_placement_fn_tp_ep",
            8,
            "tp=1-dpr=2-reshard=2",
            {"shard_placement_fn"},
            "UNSUPPORTED: needs capability hsdp, reshard_after_forward_int",
        ),
        (
            "fsdp.tp.shard_placement_fn_tp_ep",
            8,
            "tp=1-dpr=1-reshard=False",
            {"shard_placement_fn"},
            None,
        ),
        # The CPU verdict comes first, even when capabilities are missing too.
        ("fsdp.tp.shard_placement_fn_tp_ep", 8, "tp=2-dpr=2-reshard=True", set(), TP_ATTENTION_CPU),
        (
            "fsdp.tp.shard_placement_fn_tp_ep",
            8,
            "tp=2-dpr=1-reshard=2",
            KNOWN_CAPABILITIES,
            TP_ATTENTION_CPU,
        ),
    ],
)
def test_composition_skip_reasons_on_cpu(case_id, world_size, param_id, capabilities, reason):
    item = collect(case_id, world_size, param_id, capabilities=capabilities)
    assert item.skip_reason == reason


def test_composition_cpu_skip_applies_only_to_cpu_runs():
    on_gpu = collect(
        "fsdp.tp.shard_placement_fn_tp_ep", 8, "tp=2-dpr=1-reshard=True", device_type="cuda"
    )
    assert on_gpu.skip_reason is None
    lacking_tp = collect(
        "fsdp.tp.shard_placement_fn_tp_ep",
        8,
        "tp=2-dpr=1-reshard=True",
        capabilities=KNOWN_CAPABILITIES - {"tp"},
        device_type="cuda",
    )
    assert lacking_tp.skip_reason == "UNSUPPORTED: needs capability tp"


@pytest.mark.parametrize(
    ("case_id", "world_size", "param_id", "slow"),
    [
        ("pp.parity", 4, "1F1B-fully_shard-fp32", False),
        ("pp.parity", 4, "Interleaved1F1B-replicate-fp32", False),
        ("pp.parity", 8, "1F1B-fully_shard-fp32", True),  # a pattern without ws: ws 4 only
        ("pp.parity", 4, "Interleaved1F1B-fully_shard-fp32", True),
        ("pp.parity", 4, "1F1B-fully_shard-bf16", True),
        ("pp.one_reduction_per_step", 4, "InterleavedZeroBubble-fully_shard", False),
        ("pp.one_reduction_per_step", 4, "1F1B-fully_shard", True),
        ("pp.tp_dp_3d", 8, "GPipe-fp32", True),
        ("pp.dcp.stage_fqns", 4, "", False),  # no fast key: in the default run
        ("dcp.continue_training", 4, "fsdp-to-fsdp", False),
        ("dcp.continue_training", 4, "fsdp-to-fsdp-half", False),
        ("dcp.continue_training", 4, "fsdp-half-to-fsdp", True),  # exact, not a prefix
        ("dcp.continue_training", 8, "fsdp-to-fsdp", True),
        ("fsdp.tp.2d_mesh", 4, "raf=True-ac=False-dim=3", False),
        ("fsdp.tp.2d_mesh", 4, "raf=False-ac=False-dim=3", True),
        ("fsdp.tp.3d_hsdp_mesh", 8, "raf=True-ac=False-dim=3", True),
        ("replicate.tp", 4, "ac=False-dim=3", True),
        ("fsdp.tp.shard_placement_fn_tp_ep", 8, "tp=1-dpr=1-reshard=True", True),
    ],
)
def test_composition_default_subset(case_id, world_size, param_id, slow):
    assert collect(case_id, world_size, param_id).slow is slow


def test_bare_token_keys_parse_and_are_validated():
    row = """
    [case."c"]
    world_sizes = [4]
    requires = ["pp"]
    param_requires = { "bf16" = ["mixed_precision"] }
    cpu_skip = { "tp=2" = "CPU: why" }
    """
    cases = parse_cases(textwrap.dedent(row), known_capabilities=KNOWN_CAPABILITIES)
    assert cases["c"].missing_capabilities(("1F1B", "bf16"), frozenset()) == [
        "mixed_precision",
        "pp",
    ]
    assert cases["c"].cpu_skip_reason(("tp=2",)) == "CPU: why"
    with pytest.raises(ValueError, match="unknown capabilities"):
        parse_cases(
            textwrap.dedent(row).replace('["mixed_precision"]', '["bf16_support"]'),
            known_capabilities=KNOWN_CAPABILITIES,
        )
    with pytest.raises(ValueError, match="must start with 'CPU:'"):
        parse_cases(textwrap.dedent(row).replace('"CPU: why"', '"why"'))


# --- the real composition modules, collected in a child pytest -------------------------------

NO_CAPABILITIES = """
from distconform.impl.api import load_implementation


def make():
    impl = type(load_implementation("reference"))()
    impl.name = "reference-declaring-nothing"
    impl.capabilities = frozenset()
    return impl
"""

# After the case table's marks: one JSON line per item (the child selects every item).
MARK_DUMP = """
import json

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        skip = item.get_closest_marker("skip")
        case = item.get_closest_marker("conformance_case")
        print("ITEM " + json.dumps({
            "id": item.nodeid.split("::", 1)[1],
            "slow": item.get_closest_marker("slow") is not None,
            "skip": None if skip is None else skip.kwargs["reason"],
            "case": None if case is None else case.args[0],
            "uses_impl": "impl" in item.fixturenames,
        }))
"""


# Slow: a child pytest pays a torch import and collects every composition module (10-45 s on
# 2 shared cores); the rules themselves are unit-tested above in the default run.
@pytest.mark.slow
def test_composition_modules_collect_cpu_and_unsupported_skips(tmp_path):
    (tmp_path / "declares_nothing.py").write_text(NO_CAPABILITIES)
    (tmp_path / "dump_composition_marks.py").write_text(MARK_DUMP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "distconform/suites/composition",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "dump_composition_marks",
            "--impl",
            "declares_nothing:make",
            "--device",
            "cpu",
            "-m",
            "slow or not slow",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    items = {
        entry["id"]: entry
        for line in result.stdout.splitlines()
        if line.startswith("ITEM ")
        for entry in [json.loads(line[5:])]
    }
    expected = {
        "test_pipeline_parity[ws4-1F1B-fully_shard-fp32]": (
            False,
            "UNSUPPORTED: needs capability pp",
        ),
        "test_pipeline_parity[ws8-GPipe-replicate-bf16]": (
            True,
            "UNSUPPORTED: needs capability mixed_precision, pp, replicate",
        ),
        "test_3d_tp_dp_pp[ws8-GPipe-bf16]": (
            True,
            "UNSUPPORTED: needs capability mixed_precision, pp, tp",
        ),
        "test_checkpoint_continues_training[ws4-fsdp-to-fsdp-half]": (
            False,
            "UNSUPPORTED: needs capability dcp",
        ),
        "test_checkpoint_continues_training[ws8-hsdp-to-fsdp-half]": (
            True,
            "UNSUPPORTED: needs capability dcp, hsdp",
        ),
        "test_pipeline_stage_checkpoint_keeps_fqns[ws4]": (
            False,
            "UNSUPPORTED: needs capability dcp, pp",
        ),
        "test_2d_fully_shard_tp[ws4-raf=True-ac=True-dim=3]": (
            True,
            "UNSUPPORTED: needs capability activation_checkpointing, tp",
        ),
        "test_replicate_tp[ws4-ac=False-dim=16]": (
            True,
            "UNSUPPORTED: needs capability replicate, tp",
        ),
        "test_shard_placement_fn_tp_ep[ws8-tp=1-dpr=2-reshard=2]": (
            True,
            "UNSUPPORTED: needs capability hsdp, reshard_after_forward_int, shard_placement_fn",
        ),
        "test_shard_placement_fn_tp_ep[ws8-tp=2-dpr=2-reshard=2]": (True, TP_ATTENTION_CPU),
        # Not a case: the evidence for the CPU skip above, slow by its own mark.
        "test_cpu_attention_on_tp_activations_has_no_sharding_strategy[ws2]": (True, None),
    }
    found = {
        item_id: (items[item_id]["slow"], items[item_id]["skip"])
        for item_id in expected
        if item_id in items
    }
    assert found == expected
    cpu_skipped = sorted(
        item_id for item_id, entry in items.items() if (entry["skip"] or "").startswith("CPU:")
    )
    assert cpu_skipped == sorted(
        f"test_shard_placement_fn_tp_ep[ws8-tp=2-dpr={dpr}-reshard={reshard}]"
        for dpr in (1, 2)
        for reshard in (False, True, 2)
    )
    # A composition test of an implementation that is not tied to a case would run on every
    # implementation, whatever it declares: each one needs a row and @conformance.
    uncased = sorted(
        item_id for item_id, entry in items.items() if entry["uses_impl"] and entry["case"] is None
    )
    assert not uncased, f"composition tests without a suites/cases.toml row: {uncased}"
    assert {entry["case"] for entry in items.values()} - {None} == COMPOSITION_CASES
