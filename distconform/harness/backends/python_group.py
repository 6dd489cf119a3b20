"""The base of the process groups the harness writes in Python (threaded, staged_gloo)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PythonProcessGroup(dist.ProcessGroup):
    """A process group implemented in Python: it names itself, and it is its own backend on
    every device.

    c10d never names a group written in Python, and the functional collectives look groups up
    by name: each one carries the name c10d gave its creator (``group_name``) and its
    backend's (``getBackendName``).

    From torch 2.14 on, ``batch_isend_irecv`` asks a group for its backend on the tensors'
    device (``group._get_backend(device).supports_coalescing``). c10d's lookup knows only the
    backends it created and raises for a group written in Python ("No backend type
    associated with device type cpu"). This group answers for itself, and since it has no
    ``supports_coalescing``, torch issues the operations one by one, as it does before 2.14.

    torch also asks a group which device types it serves (``_device_types``): the distributed
    state dict's broadcast from rank 0 stages tensors on the first one unless the tensor's own
    device is among them. c10d lists the backends it registered, none for a group written in
    Python; this group serves the CPU and the accelerator (if there is one) itself.
    """

    def __init__(self, rank: int, size: int, *, name: str, backend_name: str) -> None:
        super().__init__(rank, size)
        self._name = name
        self._backend_name = backend_name

    @property
    def group_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return self._backend_name

    def _get_backend(self, device: Any) -> PythonProcessGroup:
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        devices = [torch.device("cpu")]
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            devices.append(torch.device(accelerator.type))
        return devices
