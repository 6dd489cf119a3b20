"""The device registry: one place a device plug-in states its facts, read by the leases,
the device count, the default backend, the plug-in loading and the case skips."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distconform.extension import DeviceRegistryError, DeviceType, device_type, register_device
from distconform.harness.controller.config import device_backend, device_count
from distconform.harness.controller.leasing import DeviceLease
from distconform.harness.shared import device_registry
from distconform.harness.shared.backend_plugins import published

ACME = DeviceType(
    "acmeaccel",
    visibility_variable="ACME_VISIBLE_DEVICES",
    default_backend="gloo",
    count=lambda: 3,
    case_skips={"fsdp.tp.some_case": {"tp=2": "ACMEACCEL: no attention kernel for TP shards"}},
)


@pytest.fixture
def acme(monkeypatch):
    monkeypatch.setattr(device_registry, "_DEVICES", dict(device_registry._DEVICES))
    monkeypatch.delenv("DISTCONFORM_FAKE_DEVICE_COUNT", raising=False)
    return register_device(ACME)


def test_what_a_plugin_registers_is_what_every_reader_sees(acme):
    assert device_type("acmeaccel:1") is acme
    assert DeviceLease("acmeaccel", (4, 5)).visibility_env() == {"ACME_VISIBLE_DEVICES": "4,5"}
    assert device_count("acmeaccel") == 3
    assert device_backend(None, "acmeaccel") == "gloo"
    assert acme.case_skip_reason("fsdp.tp.some_case", ["ws2", "tp=2"]).startswith("ACMEACCEL:")
    assert acme.case_skip_reason("fsdp.tp.some_case", ["ws2", "tp=1"]) is None
    assert acme.case_skip_reason("fsdp.other", ["tp=2"]) is None


def test_torch_accelerators_are_known_before_any_plugin():
    assert device_type("cuda").visibility_variable == "CUDA_VISIBLE_DEVICES"
    assert DeviceLease("cuda", (1,)).visibility_env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert DeviceLease("cpu", (0,)).visibility_env() == {}


def test_a_contradicting_visibility_variable_is_refused(acme):
    with pytest.raises(DeviceRegistryError, match="already narrowed by ACME_VISIBLE_DEVICES"):
        register_device(DeviceType("acmeaccel", visibility_variable="OTHER_VISIBLE"))


def test_a_case_skip_must_name_its_device(acme):
    with pytest.raises(DeviceRegistryError, match="must start with 'ACMEACCEL:'"):
        register_device(DeviceType("acmeaccel", case_skips={"c": {"t": "no reason prefix"}}))


def test_a_bundled_device_is_loaded_by_its_registered_plugin(monkeypatch):
    """``--device NAME`` imports the module the registry names, as the fake device is."""
    monkeypatch.setattr(device_registry, "_DEVICES", dict(device_registry._DEVICES))
    loaded = []
    monkeypatch.setattr(
        "distconform.harness.shared.backend_plugins.import_plugins",
        lambda modules: loaded.extend(modules) or list(modules),
    )
    register_device(DeviceType("acmeaccel", plugin="acme_device_plugin"))
    with published((), None, "acmeaccel"):  # puts the ranks' plug-in list back afterwards
        assert loaded == ["acme_device_plugin"]
    assert device_type("fakeaccel").plugin == "distconform.harness.devices.fakeaccel"


def test_the_registry_imports_neither_torch_nor_pytest():
    code = (
        "import sys, distconform.harness.shared.device_registry; "
        "print([m for m in ('torch', 'pytest') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr
