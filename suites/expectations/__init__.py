"""Expectations of the bundled implementations (``<spec>.toml``) and the suites' helper.

A suite that compares numbers takes the ``conformance_tolerance`` fixture (from
``conformance.plugin``; it pickles, so rank bodies can take it too) and passes
``conformance_tolerance.resolve(rtol, atol)`` to ``harness.parity``: the implementation's
``[[tolerance]]`` override where its expectations file has one, the test's own values
otherwise. Outside a fixture, :func:`tolerance_for` gives the same for a pytest item.
File format: :mod:`conformance.expectations`.
"""

from __future__ import annotations

import pytest

from conformance.plugin import TOLERANCE_KEY
from conformance.tolerance import Tolerance

__all__ = ["Tolerance", "tolerance_for"]


def tolerance_for(item: pytest.Item) -> Tolerance:
    """``item``'s tolerance override (empty, i.e. falsy, when the file has none)."""
    return item.stash.get(TOLERANCE_KEY, Tolerance())
