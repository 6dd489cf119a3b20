"""The arguments of the harness's markers, read and checked in one place.

``check_markers`` runs at collection (from ``pytest_generate_tests``): a mistake such as
``deadline()``, ``deadline("5")``, ``requires_devices("x")`` or ``world_size(2, 2)`` stops the
run before any rank starts, as a one-line collection error naming the test and the fix,
instead of an IndexError from inside the harness once the test runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from distconform.harness.controller.config import ConfigError, check_world_size, parse_memory_limit


def _single_argument(marker: pytest.Mark, example: str) -> Any:
    if len(marker.args) != 1 or marker.kwargs:
        given = ", ".join(
            [*map(repr, marker.args), *(f"{k}={v!r}" for k, v in marker.kwargs.items())]
        )
        raise ConfigError(
            f"@pytest.mark.{marker.name} takes one argument, e.g. {example}; "
            f"got {marker.name}({given})"
        )
    return marker.args[0]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def deadline_of(marker: pytest.Mark) -> float:
    """``@pytest.mark.deadline(seconds)``: a positive number (not a string)."""
    seconds = _single_argument(marker, "@pytest.mark.deadline(120)")
    if not _number(seconds) or seconds <= 0:
        raise ConfigError(
            f"@pytest.mark.deadline needs a positive number of seconds, got {seconds!r}"
        )
    return float(seconds)


def required_devices_of(marker: pytest.Mark) -> int:
    """``@pytest.mark.requires_devices(n)``: a positive integer."""
    count = _single_argument(marker, "@pytest.mark.requires_devices(2)")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(
            f"@pytest.mark.requires_devices needs a positive number of devices, got {count!r}"
        )
    return count


def memory_limit_of(marker: pytest.Mark) -> int:
    """``@pytest.mark.memory_limit(size)``: bytes, or a size such as "2GiB"."""
    size = _single_argument(marker, '@pytest.mark.memory_limit("2GiB")')
    return parse_memory_limit(size, "@pytest.mark.memory_limit")


def world_sizes_of(marker: pytest.Mark) -> list[int]:
    """``@pytest.mark.world_size(*sizes)``: distinct positive integers (a list also works)."""
    sizes = list(marker.args)
    if len(sizes) == 1 and isinstance(sizes[0], list | tuple):
        sizes = list(sizes[0])
    if not sizes:
        raise ConfigError("@pytest.mark.world_size needs at least one world size")
    sizes = [check_world_size(size) for size in sizes]
    repeated = sorted({size for size in sizes if sizes.count(size) > 1})
    if repeated:
        raise ConfigError(
            f"@pytest.mark.world_size lists {', '.join(map(str, repeated))} more than once; "
            f"each size is one test item, so list it once"
        )
    return sizes


def slow_world_sizes_of(marker: pytest.Mark, sizes: list[int]) -> frozenset[int]:
    """The sizes of ``world_size(*sizes, slow=...)`` that only run with ``-m slow``."""
    unknown = sorted(set(marker.kwargs) - {"slow"})
    if unknown:
        raise ConfigError(
            f"@pytest.mark.world_size takes only the keyword slow=, got {', '.join(unknown)}"
        )
    slow = marker.kwargs.get("slow", ())
    slow = [slow] if isinstance(slow, int) else list(slow)
    slow = [check_world_size(size) for size in slow]
    missing = [size for size in slow if size not in sizes]
    if missing:
        listed = ", ".join(str(size) for size in sizes)
        wanted = ", ".join(str(size) for size in sorted(set(sizes) | set(missing)))
        raise ConfigError(
            f"@pytest.mark.world_size({listed}, slow=...): slow world size "
            f"{', '.join(str(size) for size in missing)} is not one of the test's world sizes; "
            f"list it among them too, e.g. @pytest.mark.world_size({wanted}, "
            f"slow=({', '.join(str(size) for size in slow)},))"
        )
    return frozenset(slow)


_CHECKS = {
    "deadline": deadline_of,
    "requires_devices": required_devices_of,
    "memory_limit": memory_limit_of,
}


def check_markers(node: pytest.Item) -> None:
    """Raise ConfigError for the first harness marker on ``node`` with bad arguments."""
    for name, check in _CHECKS.items():
        marker = node.get_closest_marker(name)
        if marker is not None:
            check(marker)
