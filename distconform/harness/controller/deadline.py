"""Per-test deadlines owned by the parent, and the process-group timeout under them.

Precedence: the ``deadline`` marker, then ``--dist-deadline``, then the
``dist_deadline`` ini value, then 300 s. When pytest-timeout is active for the test,
the deadline is pulled below its timeout so the harness (which dumps every rank's
stacks and kills the ranks) reports the hang instead of pytest-timeout (which can
neither see the ranks nor clean them up).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from distconform.harness.controller.config import DEFAULT_DEADLINE_S, ConfigError
from distconform.harness.controller.markers import deadline_of
from distconform.harness.controller.option_group import option_group


def pytest_addoption(parser: pytest.Parser) -> None:
    group = option_group(parser)
    group.addoption(
        "--dist-deadline",
        default=None,
        metavar="SECONDS",
        help="per-test deadline owned by the harness (default: ini dist_deadline or 300)",
    )
    parser.addini("dist_deadline", "default per-test deadline in seconds", default="")


def pg_timeout_for(deadline: float) -> float:
    """Collectives must time out (and raise in the rank) before the parent gives up."""
    return max(1.0, min(deadline - 2.0, deadline * 0.8))


def _positive(value: object, source: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{source} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ConfigError(f"{source} must be positive, got {value!r}")
    return seconds


def configured_deadline(config: pytest.Config) -> float:
    option = config.getoption("dist_deadline", None)
    if option is not None:
        return _positive(option, "--dist-deadline")
    ini = config.getini("dist_deadline")
    if ini:
        return _positive(ini, "the dist_deadline ini value")
    return DEFAULT_DEADLINE_S


def timeout_plugin_seconds(item: pytest.Item) -> float | None:
    """The timeout pytest-timeout will apply to this item, if that plugin is active."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = item.config.getoption("timeout", None)
        if value is None:
            value = item.config.getini("timeout") or None
    try:
        seconds = float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None


def deadline_for(item: pytest.Item, default: float) -> float:
    marker = item.get_closest_marker("deadline")
    return deadline_of(marker) if marker else default


@dataclass(frozen=True)
class OuterLimit:
    """A limit outside the harness (pytest-timeout's) that its report must beat."""

    started_at: float  # time.monotonic() when pytest-timeout's clock started (setup)
    timeout: float  # pytest-timeout's seconds for the test
    kept_back: float  # seconds kept back from it for the report itself

    @property
    def ends_at(self) -> float:
        """When the harness must have reported."""
        return self.started_at + self.timeout - self.kept_back

    def shortening_note(self, deadline: float, shortened_to: float, spent: float) -> str:
        """Why the test had ``shortened_to`` seconds where it asked for ``deadline``."""
        return (
            f"the {deadline:g} s deadline was cut to {shortened_to:.1f} s to report before "
            f"pytest-timeout's {self.timeout:g} s limit for this test (less {self.kept_back:.1f} s "
            f"kept for the report, less {spent:.1f} s spent before the ranks started, pool "
            f"start-up included): raise --timeout or the test's timeout marker to at least "
            f"{deadline + self.kept_back + spent:.0f} s, or lower its deadline"
        )


def outer_limit_for(item: pytest.Item, item_started: float) -> OuterLimit | None:
    """When the harness must have reported, so pytest-timeout never fires.

    pytest-timeout's clock starts with the test's setup; pool start-up counts too.
    """
    outer = timeout_plugin_seconds(item)
    if outer is None:
        return None
    margin = max(3.0, 0.1 * outer)
    kept_back = margin if outer > margin else outer * 0.5
    return OuterLimit(started_at=item_started, timeout=outer, kept_back=kept_back)
