"""What the harness knows about each device type, in one registry a device plug-in fills.

A device type is torch's name for it (``cuda``, ``xpu``, ``npu``, ``fakeaccel``...). For each,
the harness needs: the environment variable that narrows a process's visible devices (set
by device leases, as ``CUDA_VISIBLE_DEVICES``), the backend a run uses when none is named,
how many devices the machine has, the module that loads the device into a process (for a
device that is not built into torch), and the conformance case items it cannot run.

A vendor's device plug-in imports :func:`register_device` (through
:mod:`distconform.extension`) and calls it at import. This module imports neither torch nor
pytest: ranks and the pytest process read it alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceType:
    """One device type's facts, as its plug-in (or the harness, for torch's own) states them.

    Attributes:
        name: torch's device type (``torch.device(name).type``).
        visibility_variable: the environment variable listing the device indices a process
            may use (``CUDA_VISIBLE_DEVICES``); leases set it for each rank. None: the
            device has none, and ranks choose their device by index only.
        default_backend: the ``torch.distributed`` backend a run uses without ``--backend``;
            None: torch's default for the device type.
        count: how many devices this machine has; None: ``torch.accelerator.device_count()``
            when the current accelerator is this type.
        plugin: the module that loads the device into a process, imported in the pytest
            process and in every rank of a run on it; None for a device built into torch.
        case_skips: case id -> {grid token -> reason}: the conformance items this device
            cannot run, skipped with a reason that starts with ``NAME:`` (upper case).
    """

    name: str
    visibility_variable: str | None = None
    default_backend: str | None = None
    count: Callable[[], int] | None = None
    plugin: str | None = None
    case_skips: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def skip_prefix(self) -> str:
        """How each of this device's case-skip reasons starts: ``FAKEACCEL:``."""
        return f"{self.name.upper()}:"

    def case_skip_reason(self, case_id: str, tokens: Iterable[str]) -> str | None:
        """Why this device skips the item of ``case_id`` with these grid tokens, or None."""
        skips = self.case_skips.get(case_id, {})
        return next((skips[token] for token in tokens if token in skips), None)


class DeviceRegistryError(ValueError):
    """A registration that contradicts one made earlier in this process."""


_DEVICES: dict[str, DeviceType] = {}


def register_device(device: DeviceType) -> DeviceType:
    """Record ``device`` for this process and return it.

    Registering a type again replaces the earlier entry, keeping its ``plugin`` when the new
    one names none (the harness pre-registers its bundled devices by plugin only).

    Raises:
        DeviceRegistryError: when the visibility variable differs from one already
            registered for the type, or a case-skip reason does not start with
            ``device.skip_prefix``.
    """
    earlier = _DEVICES.get(device.name)
    if (
        earlier is not None
        and earlier.visibility_variable is not None
        and device.visibility_variable is not None
        and earlier.visibility_variable != device.visibility_variable
    ):
        raise DeviceRegistryError(
            f"the visible devices of {device.name} are already narrowed by "
            f"{earlier.visibility_variable}, not {device.visibility_variable}"
        )
    for case_id, tokens in device.case_skips.items():
        for token, reason in tokens.items():
            if not reason.startswith(device.skip_prefix):
                raise DeviceRegistryError(
                    f"{device.name}: the skip of {case_id} [{token}] must start with "
                    f"{device.skip_prefix!r}: {reason!r}"
                )
    if earlier is not None and device.plugin is None:
        device = dataclasses.replace(device, plugin=earlier.plugin)
    _DEVICES[device.name] = device
    return device


def device_type(name: str) -> DeviceType | None:
    """The registered facts of device type ``name`` (``cuda:1`` means ``cuda``), or None."""
    return _DEVICES.get(name.split(":")[0].lower())


def registered() -> tuple[str, ...]:
    """The registered device types' names, sorted."""
    return tuple(sorted(_DEVICES))


def visibility_variable(name: str) -> str | None:
    """The variable that narrows ``name``'s visible devices, or None."""
    found = device_type(name)
    return found.visibility_variable if found is not None else None


def plugin_module(name: str) -> str | None:
    """The module that loads device type ``name`` into a process, or None."""
    found = device_type(name)
    return found.plugin if found is not None else None


# torch's own accelerators: their visibility variables.
for _builtin in (
    DeviceType("cuda", visibility_variable="CUDA_VISIBLE_DEVICES"),
    DeviceType("xpu", visibility_variable="ZE_AFFINITY_MASK"),
    DeviceType("hpu", visibility_variable="HABANA_VISIBLE_MODULES"),
    # The harness's own device plug-in: its module registers the rest when imported.
    DeviceType("fakeaccel", plugin="distconform.harness.devices.fakeaccel"),
):
    register_device(_builtin)
