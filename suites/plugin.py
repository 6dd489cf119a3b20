"""pytest glue for the conformance suites: ``--impl``, the ``impl`` fixture and the profiles the
conformance report groups cases by (``pytest_distconform_conformance_profiles``).

Registered through the ``pytest11`` entry point ``distconform-suites``. The ``impl`` fixture is
resolved in the pytest parent; the value pickles as its spec (``impl.api.Implementation``'s
``__reduce__``) and each rank process rebuilds it by name, so no implementation state crosses
process boundaries.
"""

from __future__ import annotations

from typing import Any

import pytest

from impl.api import ENV_VAR, Implementation, default_spec, load_implementation

# The marker's name, kept here so this plugin loads without importing the case table.
CASE_MARKER = "conformance_case"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconform-suites", "conformance suites (distconform)")
    group.addoption(
        "--impl",
        default=None,
        metavar="SPEC",
        help=f"implementation under test: reference, torch or package.module[:factory] "
        f"(default: ${ENV_VAR} or reference)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not in suites/conftest.py: @conformance marks functions wherever they
    # are defined (a vendor's own suites, tests of the case table).
    config.addinivalue_line(
        "markers",
        f"{CASE_MARKER}(case_id): the suites/cases.toml row this conformance test implements",
    )


def selected_spec(config: pytest.Config) -> str:
    return config.getoption("--impl") or default_spec()


def pytest_report_header(config: pytest.Config) -> str:
    return f"distconform implementation: {selected_spec(config)}"


# Optional: the spec lives in harness.hookspecs, and this plugin must load without it.
@pytest.hookimpl(optionalhook=True)
def pytest_distconform_conformance_profiles(config: pytest.Config) -> list[dict[str, Any]]:
    """The case table's profiles, for the conformance report's headline."""
    from suites.cases import load_profiles

    return [profile.as_hook_dict() for profile in load_profiles()]


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest) -> Implementation:
    """The implementation under test, chosen by ``--impl`` or ``$DISTCONFORM_IMPL``."""
    spec = selected_spec(request.config)
    try:
        return load_implementation(spec)
    except (ImportError, ValueError, TypeError) as error:
        raise pytest.UsageError(f"--impl {spec}: {error}") from error
