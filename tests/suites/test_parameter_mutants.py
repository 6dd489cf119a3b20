"""Every covered name of the coverage tables fails its cases when ignored.

A row of ``suites/coverage/*.toml`` claims that its cases check its names' effect: their
oracle would differ if the argument were dropped, the value replaced by another class, the
setter ignored. Each such name has a mutant (``tests/suites/parameter_mutants.py``); the slow
test runs it on the row's cases in a child session and requires a failure:

* on the cases' quick items (the default run, ``--quick``) when they have any: what a vendor
  runs first is never blind to a name the table claims;
* otherwise on all their items.

The fast tests check what makes that hold: every covered name has a mutant or a reason it
cannot have one, every row group has a row whose cases have quick items, and the suites call
the functions a mutant patches through their module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from distconform.impl.torch_adapter import TorchImplementation
from distconform.suites.api_coverage import FAMILIES, ApiRow, read_coverage, row_group
from distconform.suites.api_surface import SURFACES
from distconform.suites.cases import CASES_FILE, IMPLEMENTATION, Case, read_cases
from distconform.suites.catalogue import SUITES_DIR, conformance_functions
from tests.suites.parameter_mutants import (
    TORCH_MODULES,
    Mutant,
    NoMutant,
    mutant_for,
    spec,
)

ROOT = Path(__file__).resolve().parents[2]
CASES = read_cases(CASES_FILE, IMPLEMENTATION)
INSTALLED = frozenset(name for surface in SURFACES.values() for name in surface())

#: Why a covered name may have no mutant: the row's other names carry the check (the
#: argument's own name, its other value classes), or a hand-written broken adapter does
#: (``DataParallelMeshDims.shard=None``: a mesh dim's name cannot be made up without the
#: call; ``tests/suites/broken.py``'s ``dp_mesh_dims_on_the_wrong_dim`` moves the dims).
ALLOWED_WITHOUT_MUTANT = (
    "a required argument",
    "a function or class itself",
    "a method other than FSDPModule's setters",
    "a value class no other value can replace",
)


def covered_names() -> list[tuple[str, ApiRow]]:
    """The covered names the installed torch has, with their rows."""
    return [
        (name, row)
        for family in FAMILIES
        for row in read_coverage(CASES, family.table)
        if row.cases
        for name in row.names
        if name in INSTALLED
    ]


def _mutated() -> list:
    params = []
    for name, row in covered_names():
        mutant = mutant_for(name)
        if isinstance(mutant, Mutant):
            params.append(pytest.param(name, row, id=name, marks=pytest.mark.slow))
    return params


def quick_cases(row: ApiRow) -> list[Case]:
    return [CASES[case] for case in row.cases if CASES[case].fast != ()]


def test_every_covered_name_has_a_mutant_or_a_reason():
    unexplained = []
    for name, _row in covered_names():
        mutant = mutant_for(name)
        if isinstance(mutant, NoMutant) and not mutant.reason.startswith(ALLOWED_WITHOUT_MUTANT):
            unexplained.append(f"{name}: {mutant.reason}")
    assert unexplained == []


def test_every_row_group_has_a_row_caught_by_quick_items():
    groups: dict[str, bool] = {}
    for name, row in covered_names():
        if isinstance(mutant_for(name), Mutant):
            group = row_group(name)
            groups[group] = groups.get(group, False) or bool(quick_cases(row))
    blind = sorted(group for group, quick in groups.items() if not quick)
    assert blind == [], (
        "row groups whose covered names are checked by no quick item (give one of their "
        f"cases a `fast` pattern): {blind}"
    )


def _imported_by_name(path: Path) -> list[str]:
    """``from <torch module a mutant patches> import <function>`` lines of ``path``."""
    patched = {module.__name__ for module in TORCH_MODULES}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in patched:
            module = sys.modules[node.module]
            for alias in node.names:
                if callable(getattr(module, alias.name, None)) and not isinstance(
                    getattr(module, alias.name), type
                ):
                    found.append(f"{path.relative_to(ROOT)}: {node.module}.{alias.name}")
    return found


def test_suites_call_the_patched_functions_through_their_module():
    # A mutant patches a function as a module attribute; a name imported from the module
    # before the patch keeps the original, and the mutant would pass unseen.
    found = [line for path in sorted(SUITES_DIR.rglob("*.py")) for line in _imported_by_name(path)]
    assert found == [], "call these through their module (import the module, not the name)"


def _test_parameters(case: Case) -> list[str]:
    """The parameters of the suite function that implements ``case``."""
    path = SUITES_DIR / f"{case.suite}.py"
    function = conformance_functions(path)[case.case_id]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [arg.arg for arg in node.args.args]
    raise LookupError(f"{case.case_id}: no function {function} in {path}")


def test_cases_of_patched_names_build_the_implementation():
    # A mutant of torch's own API is installed when the ranks build the implementation under
    # test, which they do for a test that asks for the impl fixture: a case that never does
    # would run unpatched torch, and every mutant of its names would pass unseen.
    patched_rows = [
        row
        for family in FAMILIES
        if family.name != "fsdp"
        for row in read_coverage(CASES, family.table)
        if row.cases
    ]
    missing = sorted(
        {
            case_id
            for row in patched_rows
            for case_id in row.cases
            if "impl" not in _test_parameters(CASES[case_id])
        }
    )
    assert missing == [], f"these cases must take the impl fixture: {missing}"


def base_for(row: ApiRow) -> str:
    """torch's FSDP2 where it has what the row's cases need (realistic bugs sit there), else
    the reference."""
    needed = {capability for case in row.cases for capability in CASES[case].requires}
    return "torch" if needed <= TorchImplementation.capabilities else "reference"


def nodeids(cases: list[Case]) -> list[str]:
    ids = []
    for case in cases:
        functions = conformance_functions(SUITES_DIR / f"{case.suite}.py")
        ids.append(f"suites/{case.suite}.py::{functions[case.case_id]}")
    return ids


def run_cases(cases: list[Case], impl: str, markers: str, report: Path) -> tuple[int, str]:
    """Failures of the cases' items selected by ``markers`` under ``impl``, stopping at the
    first; and the output."""
    options = ["--device", "fakeaccel"] if not all(case.cpu for case in cases) else []
    command = [sys.executable, "-m", "pytest", *nodeids(cases), "--impl", impl, *options]
    command += ["-m", markers, "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert report.exists(), f"no report from the child session:\n{output[-3000:]}"
    testcases = ET.parse(report).getroot().findall(".//testcase")
    ran = [case for case in testcases if not case.findall("skipped")]
    assert ran, f"no item of {[c.case_id for c in cases]} ran under {impl}:\n{output[-3000:]}"
    failed = [case for case in ran if case.findall("failure") or case.findall("error")]
    return len(failed), output


@pytest.mark.parametrize(("name", "row"), _mutated())
def test_ignoring_a_covered_name_fails_its_cases(tmp_path, name, row):
    impl = spec(base_for(row), name)
    quick = quick_cases(row)
    if quick:
        failed, output = run_cases(quick, impl, "not slow", tmp_path / "quick.xml")
        where = "the quick items of"
    else:
        cases = [CASES[case] for case in row.cases]
        failed, output = run_cases(cases, impl, "slow or not slow", tmp_path / "all.xml")
        where = "any item of"
    assert failed, f"{name} ignored ({impl}): {where} {list(row.cases)} passed\n{output[-2000:]}"
