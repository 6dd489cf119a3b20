"""Choosing an implementation, shipping it to ranks by name, and its declared capabilities."""

from __future__ import annotations

import pickle

import pytest
from torch import nn

from impl.api import (
    ENV_VAR,
    KNOWN_CAPABILITIES,
    Implementation,
    default_spec,
    load_implementation,
)


@pytest.mark.parametrize("spec", ["reference", "torch", "impl.reference:ReferenceImplementation"])
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
        ("impl.reference:not_a_factory", ValueError, "has no factory"),
        ("impl.sharding_that_does_not_exist", ImportError, "sharding_that_does_not_exist"),
        ("impl.reference.policies:OffloadPolicy", TypeError, "not an impl.api.Implementation"),
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
    from impl.reference import ReferenceImplementation

    with pytest.raises(TypeError, match="load_implementation"):
        pickle.dumps(ReferenceImplementation())


def test_impl_does_not_import_pytest():
    import subprocess
    import sys

    code = (
        "import sys, impl.api, impl.reference, impl.torch_adapter; "
        "sys.exit('pytest' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
