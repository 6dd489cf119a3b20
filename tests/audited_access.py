"""The checks every audited private-torch module passes (harness, impl, suites, adopt).

A module's test file names the module, its path and one call of each accessor (the
arguments; every call must be refused before it touches anything), and takes its three
tests from :func:`audit_tests`: every accessor has an audit of every release of the
window; a torch outside the window is refused with the window named; an accessor whose
audit lacks the installed release is refused naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from distconform.harness.torch_window import (
    SUPPORTED_TORCH,
    Audit,
    PrivateTorchAccessError,
    describe_window,
    installed_torch_version,
)

OUTSIDE_THE_WINDOW = ("2.10.0", "2.16.0", "3.0.0a0", "2.9.1+cpu")


def accessor_functions(module: ModuleType) -> set[str]:
    """The module's public functions but its version check: its accessors."""
    return {
        name
        for name, function in inspect.getmembers(module, inspect.isfunction)
        if function.__module__ == module.__name__
        and not name.startswith("_")
        and name != "require_audited_torch"
    }


def audit_tests(
    module: ModuleType, path: str, calls: dict[str, tuple]
) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
    def call(accessor: str) -> None:
        getattr(module, accessor)(*calls[accessor])

    def test_every_accessor_has_an_audit_of_every_release() -> None:
        assert set(module.AUDITS) == accessor_functions(module) == set(calls)
        for accessor, audit in module.AUDITS.items():
            assert audit.reads.strip(), accessor
            assert set(audit.versions) == set(SUPPORTED_TORCH), accessor
            assert all(finding.strip() for finding in audit.versions.values()), accessor

    @pytest.mark.parametrize("accessor", sorted(calls))
    @pytest.mark.parametrize("version", OUTSIDE_THE_WINDOW)
    def test_every_accessor_refuses_a_torch_outside_the_window(
        monkeypatch: pytest.MonkeyPatch, version: str, accessor: str
    ) -> None:
        monkeypatch.setattr(torch, "__version__", version)
        with pytest.raises(PrivateTorchAccessError) as raised:
            call(accessor)
        message = str(raised.value)
        assert f"{path}:{accessor}" in message and version in message
        assert describe_window() in message

    @pytest.mark.parametrize("accessor", sorted(calls))
    def test_an_accessor_whose_audit_lacks_the_installed_release_is_refused(
        monkeypatch: pytest.MonkeyPatch, accessor: str
    ) -> None:
        audit = module.AUDITS[accessor]
        installed = installed_torch_version()
        without = {
            version: text for version, text in audit.versions.items() if version != installed
        }
        monkeypatch.setitem(module.AUDITS, accessor, Audit(audit.reads, without))
        with pytest.raises(PrivateTorchAccessError) as raised:
            call(accessor)
        assert f"{path}:{accessor} is audited for" in str(raised.value)

    return (
        test_every_accessor_has_an_audit_of_every_release,
        test_every_accessor_refuses_a_torch_outside_the_window,
        test_an_accessor_whose_audit_lacks_the_installed_release_is_refused,
    )
