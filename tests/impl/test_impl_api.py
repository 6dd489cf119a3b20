"""Choosing an implementation, shipping it to ranks by name, and its declared capabilities."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from distconform.impl.api import (
    ENV_VAR,
    KNOWN_CAPABILITIES,
    Implementation,
    default_spec,
    load_implementation,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "spec", ["reference", "torch", "distconform.impl.reference:ReferenceImplementation"]
)
def test_loads_and_pickles_by_name(spec):
    impl = load_implementation(spec)
    assert isinstance(impl, Implementation)
    assert impl.spec == spec
    assert load_implementation(spec) is impl, "one object per spec in a process"
    payload = pickle.dumps(impl)
    assert len(payload) < 200, "an implementation travels as its name, not its state"
    assert pickle.loads(payload) is impl
    assert impl.capabilities <= KNOWN_CAPABILITIES
    assert "replicate" in impl.capabilities


def test_policy_and_module_types_are_exposed():
    for spec in ("reference", "torch"):
        impl = load_implementation(spec)
        assert impl.MixedPrecisionPolicy().param_dtype is None
        assert impl.MixedPrecisionPolicy().cast_forward_inputs is True
        assert isinstance(impl.CPUOffloadPolicy(), impl.OffloadPolicy)
        assert not impl.is_managed(nn.Linear(2, 2))


def test_default_spec_follows_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert default_spec() == "reference"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert default_spec() == "torch"
    assert load_implementation().name == "torch"


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("no such thing", ValueError, "bad implementation spec"),
        ("acme_unregistered", ValueError, r"unknown implementation .*\(reference, torch"),
        ("distconform.impl.reference:not_a_factory", ValueError, "has no factory"),
        (
            "distconform.impl.sharding_that_does_not_exist",
            ImportError,
            "sharding_that_does_not_exist",
        ),
        (
            "distconform.impl.reference.policies:OffloadPolicy",
            TypeError,
            "not a distconform.impl.api.Implementation",
        ),
    ],
)
def test_bad_specs_fail_clearly(spec, error, message):
    with pytest.raises(error, match=message):
        load_implementation(spec)


def test_supports_rejects_unknown_capability_names():
    impl = load_implementation("reference")
    assert impl.supports("replicate")
    assert not impl.supports("share_comm_ctx")
    with pytest.raises(ValueError, match="unknown capability"):
        impl.supports("replicat")


def test_an_implementation_not_loaded_by_name_refuses_to_pickle():
    from distconform.impl.reference import ReferenceImplementation

    with pytest.raises(TypeError, match="load_implementation"):
        pickle.dumps(ReferenceImplementation())


def test_impl_does_not_import_pytest():
    code = (
        "import sys, distconform.impl.api, distconform.impl.reference, "
        "distconform.impl.torch_adapter; "
        "sys.exit('pytest' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


ACME_MODULE = """
from distconform.impl.reference import ReferenceImplementation


class Acme(ReferenceImplementation):
    name = "acme"
"""


def test_an_installed_vendor_package_is_found_by_its_registered_name(tmp_path):
    """A package whose distribution registers ``acme`` in ``distconform.implementations`` is
    loaded by ``--impl acme``, with no module path: here a bare dist-info on ``sys.path``, as
    ``pip install`` leaves one, and one suite item run against it."""
    site = tmp_path / "site"
    (site / "acme_fsdp-0.1.dist-info").mkdir(parents=True)
    (site / "acme_fsdp.py").write_text(ACME_MODULE)
    (site / "acme_fsdp-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-fsdp\nVersion: 0.1\n"
    )
    (site / "acme_fsdp-0.1.dist-info" / "entry_points.txt").write_text(
        "[distconform.implementations]\nacme = acme_fsdp:Acme\n"
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "distconform/suites/test_world_size_1.py",
        "--impl",
        "acme",
    ]
    command += ["-q", "-p", "no:cacheprovider", "-k", "ws1"]

    def run(*paths: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
        return subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
        )

    installed = run(site, ROOT)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert " passed" in installed.stdout, installed.stdout[-3000:]
    # The control: without the distribution, the name means nothing.
    missing = run(ROOT)
    assert missing.returncode != 0
    assert "unknown implementation 'acme'" in missing.stdout + missing.stderr
