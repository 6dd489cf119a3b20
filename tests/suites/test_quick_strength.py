"""``--quick`` (the default, non-slow subset of the cases) keeps, for every suite module that a
broken adapter is known to fail, at least one item that adapter fails: what a vendor runs
first is never blind to a feature the full run checks.

The broken-adapter rows (``tests/suites/test_broken_adapters.py``) name the item each
adapter fails; this test reads the case table to see whether that item is in the quick
subset. It runs nothing: the rows themselves prove the failures.
"""

from __future__ import annotations

import re
from collections import defaultdict

from distconform.suites.cases import CASES_FILE, IMPLEMENTATION, read_cases
from distconform.suites.catalogue import SUITES_DIR, conformance_functions
from tests.suites.test_broken_adapters import ROWS

CASES = read_cases(CASES_FILE, IMPLEMENTATION)
_ITEM = re.compile(r"^(?P<function>\w+)\[ws(?P<ws>\d+)(?:-(?P<params>.*))?\]$")


def quick(module: str, item: str) -> bool:
    """Whether ``module::item`` belongs to the quick subset, by the case table."""
    match = _ITEM.match(item)
    assert match, f"{item}: not a parametrized suite item"
    functions = {f: case for case, f in conformance_functions(SUITES_DIR / f"{module}.py").items()}
    case = CASES[functions[match["function"]]]
    return case.is_fast(match["params"] or "", int(match["ws"]))


def test_every_feature_with_a_broken_adapter_has_a_quick_item_it_fails():
    by_module: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for row in ROWS:
        module, item, adapter = row.values[:3]
        by_module[module].append((item, adapter))
    blind = {
        module: rows
        for module, rows in by_module.items()
        if not any(quick(module, item) for item, _adapter in rows)
    }
    assert not blind, (
        "--quick runs none of the items these broken adapters fail (add the item to its "
        "case's `fast` patterns, or a row failing a quick item):\n"
        + "\n".join(f"  {module}: {rows}" for module, rows in sorted(blind.items()))
    )


def test_the_check_reads_the_case_table():
    # The quick subset is the `fast` patterns: a slow grid point is not quick.
    assert quick(
        "test_training_parity",
        "test_train_parity_single_group_shard_dim0[ws2-lin_shapes=7x15_15x3]",
    )
    assert not quick(
        "test_reduce_controls",
        "test_every_reduction_path_divides_by_the_factor[ws2-mesh=hsdp-reduce=fp16-factor=none]",
    )
