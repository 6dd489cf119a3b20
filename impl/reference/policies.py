"""Policy types with FSDP2's field names and defaults.

The reference accepts only the defaults today (full precision, no offload); issue 6 adds
mixed precision and CPU offload on top of the same parameter group machinery. Passing a
non-default policy raises ``NotImplementedError`` instead of being silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def is_full_precision(self) -> bool:
        return self.param_dtype is None and self.reduce_dtype is None and self.output_dtype is None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    pin_memory: bool = True


def require_supported_policies(
    mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy
) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}"
        )
    if not mp_policy.is_full_precision:
        raise NotImplementedError(
            "the reference implementation does not support mixed precision yet (issue 6); "
            f"got {mp_policy}"
        )
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            "the reference implementation does not support CPU offload yet (issue 6)"
        )
