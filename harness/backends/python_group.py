"""The base of the process groups the harness writes in Python (threaded, staged_gloo)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class PythonProcessGroup(dist.ProcessGroup):
    """A process group implemented in Python: it is its own backend on every device.

    From torch 2.14 on, ``batch_isend_irecv`` asks a group for its backend on the tensors'
    device (``group._get_backend(device).supports_coalescing``). c10d's lookup knows only the
    backends it created and raises for a group written in Python ("No backend type
    associated with device type cpu"). This group answers for itself, and since it has no
    ``supports_coalescing``, torch issues the operations one by one, as it does before 2.14.
    """

    def _get_backend(self, device: Any) -> PythonProcessGroup:
        return self
