"""Hooks other plugins implement to extend conformance runs."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=True)
def pytest_distconform_conformance_profiles(config: pytest.Config) -> list[dict[str, Any]] | None:
    """The conformance profiles the report groups test cases by, or None for none.

    Each profile is a dict: ``name`` (str), ``description`` (str), ``required`` (bool) and
    ``capabilities`` (list of capability names). The report places every test that carries
    the user properties ``("conformance_case", case_id)`` and ``("capabilities", "a,b")``
    (the sorted capabilities it needs, comma-separated; empty for none): in each required
    profile that lists all of them, else in each other profile that lists one of them. An
    implementation that does not declare all of a required profile's capabilities gets no
    percentage for it and is reported as not conformant to it. Tests without the properties
    stay out of every profile. The conformance plugin answers last with the profiles of
    ``suites/cases.toml``; a plugin that answers first replaces them.
    """
    raise NotImplementedError
