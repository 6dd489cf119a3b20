"""Collection of the conformance suites: the case table decides skips, ``slow`` and pools."""

from __future__ import annotations

import pytest

from impl.api import load_implementation
from suites.cases import CASE_MARKER, apply_case_table
from suites.plugin import selected_spec


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # First, so that the slow marks added here are seen by -m's deselection.
    from harness.plugin import world_size_of

    if not any(item.get_closest_marker(CASE_MARKER) for item in items):
        return
    spec = selected_spec(config)
    try:
        capabilities = load_implementation(spec).capabilities
    except (ImportError, ValueError, TypeError) as error:
        raise pytest.UsageError(f"--impl {spec}: {error}") from error
    inapplicable = apply_case_table(
        items,
        device_type=config.getoption("device") or "cpu",
        launcher=config.getoption("launcher") or config.getini("dist_launcher"),
        capabilities=capabilities,
        world_size_of=world_size_of,
    )
    if inapplicable:
        left_out = {id(item) for item in inapplicable}
        items[:] = [item for item in items if id(item) not in left_out]
        config.hook.pytest_deselected(items=inapplicable)
