"""Hooks other plugins implement to extend distconform."""

from __future__ import annotations

import pytest


def pytest_distconform_reproducer_args(config: pytest.Config) -> list[str]:
    """Extra command-line arguments a reproducer command needs (e.g. ``--impl torch``).

    Every implementation's list is appended, in plugin order.
    """
    raise NotImplementedError
