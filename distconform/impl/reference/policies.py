"""Policy types with FSDP2's field names and defaults, and what each field means for a group.

* ``MixedPrecisionPolicy``: ``param_dtype`` is the dtype of the all-gather and of the unsharded
  parameters (forward and backward compute); ``reduce_dtype`` the dtype gradients are reduced
  in (default: the compute dtype); the sharded parameters and their gradients keep the
  parameter's original dtype. ``output_dtype`` casts floating-point forward outputs;
  ``cast_forward_inputs`` casts floating-point forward inputs to ``param_dtype`` before every
  module of the group runs.
* ``CPUOffloadPolicy``: sharded parameters, their gradients (and so the optimizer state) live
  on the CPU; each unshard copies the shard to the compute device before the all-gather, each
  reduction copies the reduced shard back. ``pin_memory`` needs an accelerator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


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
    if (
        isinstance(offload_policy, CPUOffloadPolicy)
        and offload_policy.pin_memory
        and not torch.accelerator.is_available()
    ):
        # Pinned (page-locked) host memory only exists to speed up copies to an accelerator.
        raise RuntimeError(
            "CPUOffloadPolicy(pin_memory=True) needs an accelerator to pin host memory for, "
            "and none is available; pass CPUOffloadPolicy(pin_memory=False)"
        )


def offloads_to_cpu(offload_policy: OffloadPolicy) -> bool:
    return isinstance(offload_policy, CPUOffloadPolicy)


def pins_memory(offload_policy: OffloadPolicy) -> bool:
    return isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory


# --- dtypes of one group ---------------------------------------------------------------------


def compute_dtype(mp_policy: MixedPrecisionPolicy, orig_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the all-gather and the unsharded parameters.

    ``param_dtype`` applies to floating-point parameters only; integer parameters keep theirs.
    """
    if mp_policy.param_dtype is None or not orig_dtype.is_floating_point:
        return orig_dtype
    return mp_policy.param_dtype


def reduce_dtype(mp_policy: MixedPrecisionPolicy, orig_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype gradients are reduced (and accumulated without sync) in; ``None``: as computed.

    FSDP2 compares ``reduce_dtype`` with the policy's ``param_dtype`` (not the clamped compute
    dtype): equal means "no extra cast".
    """
    if mp_policy.reduce_dtype is None or mp_policy.reduce_dtype == mp_policy.param_dtype:
        return None
    return mp_policy.reduce_dtype


def gradient_divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """``(pre, post)``: divide by ``pre`` before the summing collectives and ``post`` after.

    fp32 and bf16 have the range to sum first and divide once. Other types (fp16) split the
    division around the sum into two factors near ``sqrt(factor)`` (powers of two before) so
    neither the sum overflows nor the divided inputs underflow; FSDP2 splits for the same
    dtypes (fp64 included), so results match it to the last bit where the sums do.
    """
    if dtype in (torch.float32, torch.bfloat16):
        return 1.0, float(factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


# --- forward inputs and outputs ---------------------------------------------------------------


def cast_forward_inputs(
    mp_policy: MixedPrecisionPolicy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Floating-point tensors of ``args``/``kwargs`` cast to ``param_dtype`` if the policy asks."""
    if not (mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None):
        return args, kwargs
    dtype = mp_policy.param_dtype
    return map_floating_tensors(args, dtype), map_floating_tensors(kwargs, dtype)


def cast_forward_output(mp_policy: MixedPrecisionPolicy, output: Any) -> Any:
    """Floating-point tensors in ``output`` cast to ``output_dtype`` (if the policy sets one)."""
    if mp_policy.output_dtype is None:
        return output
    return map_floating_tensors(output, mp_policy.output_dtype)


def map_floating_tensors(value: Any, dtype: torch.dtype) -> Any:
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        return tensor.to(dtype)

    return _map_tensors(value, cast)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return dataclasses.replace(
            value, **{f.name: _map_tensors(getattr(value, f.name), fn) for f in fields if f.init}
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value
