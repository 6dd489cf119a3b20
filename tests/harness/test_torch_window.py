"""``harness/torch_window.py``: the supported torch releases, and the check every private access
runs first (a torch outside the window, an accessor without an audit, a release its audit lacks:
each refused with what to do)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from distconform.harness import torch_window
from distconform.harness.torch_window import (
    SUPPORTED_TORCH,
    V2_11,
    V2_12,
    V2_13,
    V2_14,
    V2_15,
    Audit,
    PrivateTorchAccessError,
)

ROOT = Path(__file__).resolve().parents[2]
MODULE = "some/_torch_private.py"
FULL = Audit(
    reads="torch.some._private_name",
    versions={version: "same" for version in SUPPORTED_TORCH},
)
WITHOUT_2_14 = Audit(
    reads="torch.other._private_name",
    versions={version: "same" for version in SUPPORTED_TORCH if version != V2_14},
)
AUDITS = {"full": FULL, "without_2_14": WITHOUT_2_14}


def test_the_window_is_2_11_to_2_15_oldest_first():
    assert SUPPORTED_TORCH == (V2_11, V2_12, V2_13, V2_14, V2_15)
    assert torch_window.describe_window() == "torch 2.11 to 2.15"


def test_pyproject_allows_exactly_the_window():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [dep for dep in project["dependencies"] if re.match(r"torch\s*[<>=]", dep)]
    bounds = re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", requirement)
    assert bounds, requirement
    lowest, first_excluded = (int(bounds[1]), int(bounds[2])), (int(bounds[3]), int(bounds[4]))
    newest_major, newest_minor = SUPPORTED_TORCH[-1]
    assert (lowest, first_excluded) == (SUPPORTED_TORCH[0], (newest_major, newest_minor + 1))


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("2.13.0", (2, 13)),
        ("2.11.0+cu130", (2, 11)),
        ("2.15.0a0+git1234", (2, 15)),
        ("3.0.0", (3, 0)),
    ],
)
def test_installed_torch_version_reads_major_and_minor(monkeypatch, version, parsed):
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_window.installed_torch_version() == parsed


def test_the_version_is_read_without_importing_torch():
    # The plugins ask at configure, before the rank fork server starts importing torch:
    # an import here would put pytest's own torch import ahead of the fork server's.
    script = (
        "import sys; from distconform.harness import torch_window; "
        "version = torch_window.installed_torch_version(); "
        "print('torch' in sys.modules, version)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    major, minor = torch.__version__.split(".")[:2]
    assert done.stdout.split(maxsplit=1) == ["False", f"({major}, {minor})\n"]


def test_the_installed_torch_is_in_the_window():
    assert torch_window.installed_torch_version() in SUPPORTED_TORCH


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cpu", "2.13.0", "2.14.1", "2.15.0+cu130"])
def test_an_audited_release_of_the_window_passes(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    assert torch_window.require_audited(AUDITS, "full", MODULE) is None


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0", "3.0.0a0", "1.13.1+cpu"])
def test_a_torch_outside_the_window_is_refused_with_the_window_named(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(PrivateTorchAccessError) as raised:
        torch_window.require_audited(AUDITS, "full", MODULE)
    message = str(raised.value)
    assert "torch 2.11 to 2.15" in message
    assert f"{MODULE}:full" in message and version in message


def test_a_release_missing_from_the_audit_is_refused_naming_the_accessor(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.14.1")
    with pytest.raises(PrivateTorchAccessError) as raised:
        torch_window.require_audited(AUDITS, "without_2_14", MODULE)
    message = str(raised.value)
    assert f"{MODULE}:without_2_14" in message
    assert "2.11, 2.12, 2.13, 2.15" in message and "2.14.1" in message
    assert WITHOUT_2_14.reads in message  # what to read in the new release
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    torch_window.require_audited(AUDITS, "without_2_14", MODULE)


def test_an_accessor_without_an_audit_is_refused(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with pytest.raises(PrivateTorchAccessError, match=f"{MODULE}:unaudited has no Audit"):
        torch_window.require_audited(AUDITS, "unaudited", MODULE)


def test_the_refusal_is_a_runtime_error():
    assert issubclass(PrivateTorchAccessError, RuntimeError)
