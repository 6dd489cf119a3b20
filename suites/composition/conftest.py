"""Collection rules of the composition suites, decided in the pytest parent.

* ``@pytest.mark.default_run("ws4-1F1B-...", ...)``: of a parametrized test, only the items
  whose parameter id is listed stay in the default run; the others are marked ``slow``.
  (World sizes are the harness's own parametrization, so per-size ``slow`` marks cannot be
  put on ``pytest.param`` values.)
* ``@pytest.mark.cpu_skip("why")``: skipped on a CPU run with the reason ``CPU: why``; it runs
  where the ranks have an accelerator.
* Capabilities: a test (or one of its ``pytest.param`` values) says what it needs with
  ``@pytest.mark.requires_capabilities("pp", "dcp")``; the marks of an item are unioned, and
  an item whose implementation does not declare all of them is skipped before any rank
  starts, with the reason ``UNSUPPORTED: needs capability <names>`` (the prefix the report
  relies on).
"""

from __future__ import annotations

import pytest

from impl.api import KNOWN_CAPABILITIES, load_implementation
from suites.plugin import selected_spec

MARKER = "requires_capabilities"
DEFAULT_RUN_MARKER = "default_run"
CPU_SKIP_MARKER = "cpu_skip"
CPU_PREFIX = "CPU:"
UNSUPPORTED_PREFIX = "UNSUPPORTED:"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names): impl.api capabilities the item needs; "
        f"UNSUPPORTED skip when the implementation does not declare them",
    )
    config.addinivalue_line(
        "markers",
        f"{DEFAULT_RUN_MARKER}(*param_ids): the only items of this test kept out of 'slow'",
    )
    config.addinivalue_line(
        "markers", f"{CPU_SKIP_MARKER}(reason): cannot run on CPU; skipped there with 'CPU: reason'"
    )


def needed_capabilities(item: pytest.Item) -> set[str]:
    needed: set[str] = set()
    for mark in item.iter_markers(MARKER):
        needed.update(mark.args)
    unknown = needed - KNOWN_CAPABILITIES
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: unknown capability name(s) {sorted(unknown)}")
    return needed


def unsupported_reason(missing: set[str]) -> str:
    return f"{UNSUPPORTED_PREFIX} needs capability {', '.join(sorted(missing))}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # First, so that -m "not slow" sees the slow marks added here.
    for item in items:
        keep = item.get_closest_marker(DEFAULT_RUN_MARKER)
        callspec = getattr(item, "callspec", None)
        if keep is not None and callspec is not None and callspec.id not in keep.args:
            item.add_marker(pytest.mark.slow)
    if (config.getoption("device") or "cpu") == "cpu":
        for item in items:
            cpu_skip = item.get_closest_marker(CPU_SKIP_MARKER)
            if cpu_skip is not None:
                item.add_marker(pytest.mark.skip(reason=f"{CPU_PREFIX} {cpu_skip.args[0]}"))
    gated = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if not gated:
        return
    spec = selected_spec(config)
    try:
        declared = load_implementation(spec).capabilities
    except (ImportError, ValueError, TypeError) as error:
        raise pytest.UsageError(f"--impl {spec}: {error}") from error
    for item in gated:
        missing = needed_capabilities(item) - declared
        if missing:
            item.add_marker(pytest.mark.skip(reason=unsupported_reason(missing)))
