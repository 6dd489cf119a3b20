"""The run's distributed configuration, checked before any rank is spawned.

Every error here names the bad value and what would be accepted, so a typo on the
command line costs one second, not a spawn and a timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from distconform.harness.controller.leasing import fake_device_count
from distconform.harness.shared.device_registry import device_type as registered_device
from distconform.harness.shared.memory_sizes import parse_size

THREADED_BACKEND = "threaded"
#: torch's default backend for the CPU in every release (``get_default_backend_for_device``).
CPU_BACKEND = "gloo"
DEFAULT_DEADLINE_S = 300.0
DEFAULT_PEER_GRACE_S = 2.0


class ConfigError(ValueError):
    """The distributed configuration is invalid; nothing was spawned."""


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_threads_per_rank(world_size: int) -> int:
    """Split the cores between the ranks: oversubscribed ranks run several times slower."""
    return max(1, available_cores() // world_size)


def check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    return world_size


def check_device_type(device_type: str) -> str:
    """``device_type`` as torch names it (``CUDA`` gives ``cuda``).

    Raises:
        ConfigError: for a type torch does not know, or one given with an index (``cuda:1``).
    """
    if device_type == "cpu":
        # The default, answered without torch: a session's own torch import then happens at
        # collection, beside the rank fork server's (started by then), not before it.
        return device_type
    # torch only when a device is named: the fork server's clients and the device leases
    # read this module's constants without paying for torch.
    import torch

    try:
        parsed = torch.device(device_type)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {device_type!r}: {exc}") from None
    if parsed.index is not None:
        raise ConfigError(
            f"--device takes a device type ({parsed.type!r}), not {device_type!r}: each rank "
            f"owns the device whose index is its rank"
        )
    return parsed.type


def _plain_cpu(device_type: str) -> bool:
    """The CPU, with no device registration of its own changing its backend."""
    return device_type == "cpu" and registered_device(device_type) is None


def device_backend(backend: str | None, device_type: str) -> str:
    """The backend a run on ranks of their own uses: the device's default unless one is
    named (the ``threaded`` backend needs rank threads:
    ``distconform.harness.controller.thread_host.launcher``)."""
    if backend in (None, "auto", CPU_BACKEND) and _plain_cpu(device_type):
        return CPU_BACKEND  # without torch, as check_device_type answers for the CPU
    import torch.distributed as dist  # as in check_device_type

    if backend == THREADED_BACKEND:
        raise ConfigError(
            f"the {THREADED_BACKEND!r} backend only works with rank threads: use --launcher thread"
        )
    if backend in (None, "auto"):
        registered = registered_device(device_type)
        if registered is not None and registered.default_backend is not None:
            return registered.default_backend
        try:
            return dist.get_default_backend_for_device(device_type)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"no default distributed backend for device {device_type!r} ({exc}); "
                f"name one with --backend"
            ) from None
    name = backend.lower()
    if name not in dist.Backend.backend_list:
        known = ", ".join(b for b in dist.Backend.backend_list if b != "undefined")
        raise ConfigError(
            f"unknown backend {backend!r}: registered backends are {known} (a vendor backend "
            f"must be registered first, e.g. with --backend-plugin MODULE)"
        )
    supported = dist.Backend.backend_capability.get(name, [])
    if supported and device_type not in supported:
        raise ConfigError(
            f"backend {name!r} does not support device {device_type!r} "
            f"(it supports {', '.join(supported)})"
        )
    return name


#: Backends that cannot put two ranks of one group on one device, and why.
DEVICE_EXCLUSIVE_BACKENDS = {
    "nccl": "NCCL refuses two ranks of one communicator on one GPU",
}


def sharing_refusal(backend: str, device_type: str, world_size: int, devices: int) -> str | None:
    """Why ``world_size`` ranks cannot share ``devices`` devices on ``backend``; None if they can.

    One line: the backend, the world size, the device count, and what to run instead.
    """
    reason = DEVICE_EXCLUSIVE_BACKENDS.get(backend)
    if reason is None or world_size <= devices:
        return None
    plural = "s" if devices != 1 else ""
    return (
        f"{backend} cannot share devices ({reason}): ws {world_size} on {devices} "
        f"{device_type} device{plural}; run it with --backend staged_gloo --dist-share-devices, "
        f"or on {world_size} devices"
    )


def binds_device_id(backend: str) -> bool:
    """Whether ``init_process_group`` may bind this backend to the rank's device.

    c10d's own backends take ``device_id``. A backend registered from Python (a vendor's
    plug-in, ``staged_gloo``) is a CUSTOM backend type, and torch 2.13 fails the init of one
    bound to a device ("No backend type associated with device type"): it starts unbound.
    """
    import torch.distributed as dist  # as in check_device_type

    kind = dist.Backend.backend_type_map.get(backend)
    return kind is not None and kind != dist.ProcessGroup.BackendType.CUSTOM


def device_count(device_type: str) -> int | None:
    """How many devices of this type the machine has; None means unlimited (CPU ranks)."""
    if device_type == "cpu":
        return None
    fake = fake_device_count()
    if fake is not None:
        return fake
    registered = registered_device(device_type)
    if registered is not None and registered.count is not None:
        return registered.count()
    import torch  # as in check_device_type

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or accelerator.type != device_type:
        return 0
    return torch.accelerator.device_count()


@dataclass(frozen=True)
class DistSettings:
    """What the command line and ini file chose for every distributed test of the run."""

    launcher: str = "process"
    backend: str = "gloo"
    device_type: str = "cpu"
    seed: int = 0
    deadline: float = DEFAULT_DEADLINE_S
    threads_per_rank: int | None = None
    world_sizes: tuple[int, ...] | None = None
    fresh_pool: bool = False
    peer_grace: float = DEFAULT_PEER_GRACE_S
    rendezvous: str = "file"
    memory_limit: int | None = None
    device_audit: bool = False
    stream_check: bool = True
    #: Whether --dist-deadline or ini dist_deadline named ``deadline`` (else the default,
    #: which a test's recorded durations may replace: harness/controller/deadline_history.py).
    deadline_named: bool = False
    share_devices: bool = False
    #: pytest's warning filters (ini ``filterwarnings``, then ``-W``), each with whether its
    #: text is literal: shipped to ranks that keep a warnings state of their own.
    warning_filters: tuple[tuple[str, bool], ...] = ()

    def threads_for(self, world_size: int) -> int:
        return self.threads_per_rank or default_threads_per_rank(world_size)

    def placement(self, world_size: int) -> str:
        """``ws 4`` or, with shared devices, ``ws 4 on 1 device``: how a failure names its world."""
        if not self.share_devices or self.device_type == "cpu":
            return f"ws {world_size}"
        devices = device_count(self.device_type) or 0
        if devices >= world_size:
            return f"ws {world_size}"
        return f"ws {world_size} on {devices} device{'s' if devices != 1 else ''}"


def device_placement_line(settings: DistSettings) -> str:
    """The session header's line on how ranks meet devices (accelerator runs only)."""
    devices = device_count(settings.device_type) or 0
    kind = settings.device_type
    if settings.share_devices:
        placement = f"ranks share the {devices} {kind} device(s) round-robin (--dist-share-devices)"
        refusal = DEVICE_EXCLUSIVE_BACKENDS.get(settings.backend)
        if refusal is not None:
            placement += f"; {settings.backend} cannot ({refusal}): larger worlds skip"
    else:
        placement = f"one {kind} device per rank ({devices} visible)"
    if binds_device_id(settings.backend):
        return f"{placement}; process groups bound to their device (device_id)"
    return (
        f"{placement}; device_id not bound: {settings.backend} is a backend registered from "
        f"Python, which c10d cannot bind to a device"
    )


def parse_world_sizes(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--world-sizes takes comma-separated integers, got {text!r}") from None
    for size in sizes:
        check_world_size(size)
    return sizes


def parse_memory_limit(value: object, source: str) -> int | None:
    """A per-rank memory limit (``"512MiB"``, bytes) from ``source``; None for none."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
