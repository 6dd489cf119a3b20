"""The environment check of a warm rank's hygiene, in this process (no ranks needed)."""

from __future__ import annotations

import os

from distconform.harness.rank import hygiene
from distconform.harness.shared.environ import VOLATILE_ENV


def test_every_kind_of_environment_change_is_named(monkeypatch):
    monkeypatch.setenv("DISTCONFORM_T_CHANGED", "before")
    monkeypatch.setenv("DISTCONFORM_T_REMOVED", "here")
    monkeypatch.delenv("DISTCONFORM_T_ADDED", raising=False)
    before = hygiene.take_snapshot()
    monkeypatch.setenv("DISTCONFORM_T_CHANGED", "after")
    monkeypatch.delenv("DISTCONFORM_T_REMOVED")
    monkeypatch.setenv("DISTCONFORM_T_ADDED", "new")
    for volatile in VOLATILE_ENV:
        monkeypatch.setenv(volatile, "changes every test")
    assert hygiene._changed_env(before) == [
        "environment variable DISTCONFORM_T_ADDED changed from None to 'new'",
        "environment variable DISTCONFORM_T_CHANGED changed from 'before' to 'after'",
        "environment variable DISTCONFORM_T_REMOVED changed from 'here' to None",
    ]


def test_an_untouched_environment_is_clean(monkeypatch):
    monkeypatch.setenv("DISTCONFORM_T_SAME", "x")
    before = hygiene.take_snapshot()
    os.environ["DISTCONFORM_T_SAME"] = "x"  # written again, unchanged
    assert hygiene._changed_env(before) == []
