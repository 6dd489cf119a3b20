"""Parity tools: train a plain reference next to a distributed model and compare them.

Works on any module whose parameters are ``DTensor``s or plain tensors; it knows nothing
about FSDP. Pieces:

* ``tolerance(dtype)``: PyTorch's ``assertEqual`` defaults by dtype.
* ``average_gradients(module, group)``: the explicit data-parallel reference step: every
  gradient is summed over ``group`` and divided by its size.
* ``ReferenceModel``: a deep copy of a module with its own optimizer, trained with
  ``average_gradients``.
* ``assert_losses_equal`` / ``LossHistory``: per-step loss comparison.
* ``assert_sharded_parity(reference, model)``: each parameter (and gradient) of ``model`` equals
  the reference's, re-sharded the same way (``distribute_tensor`` onto the parameter's mesh and
  placements, each rank slicing locally) and compared shard by shard.

Every failure names the parameter, the rank, and the max absolute and relative differences.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# PyTorch's assertEqual defaults (torch.testing._comparison.default_tolerances), copied as data
# so that no private module is imported.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


class ParityError(AssertionError):
    """A distributed result differs from the reference beyond tolerance."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for ``dtype``; exact comparison for integer and bool dtypes."""
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass(frozen=True)
class Mismatch:
    """Where two tensors differ beyond the tolerance: how many elements, the largest
    differences, and the tolerance applied (``describe()`` says it in one line)."""

    what: str
    max_abs_diff: float
    max_rel_diff: float
    mismatched: int
    total: int
    rtol: float
    atol: float

    def describe(self) -> str:
        return (
            f"{self.what} differs on rank {_rank()}: {self.mismatched}/{self.total} elements "
            f"outside rtol={self.rtol:g}, atol={self.atol:g}; "
            f"max abs diff {self.max_abs_diff:.3e}, max rel diff {self.max_rel_diff:.3e}"
        )


def compare_tensors(
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> Mismatch | None:
    """``None`` if ``actual`` matches ``expected``; ``ParityError`` if dtype or shape differ."""
    if actual.dtype != expected.dtype:
        raise ParityError(
            f"{what}: dtype {actual.dtype} on rank {_rank()}, reference has {expected.dtype}"
        )
    if actual.shape != expected.shape:
        raise ParityError(
            f"{what}: shape {tuple(actual.shape)} on rank {_rank()}, "
            f"reference has {tuple(expected.shape)}"
        )
    default_rtol, default_atol = tolerance(actual.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    actual = actual.detach().to(expected.device)
    expected = expected.detach()
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    diff = (actual.double() - expected.double()).abs()
    rel = diff / expected.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
    return Mismatch(
        what=what,
        max_abs_diff=float(diff.nan_to_num(float("inf")).max()),
        max_rel_diff=float(rel.nan_to_num(float("inf")).max()),
        mismatched=int((~close).sum()),
        total=close.numel(),
        rtol=rtol,
        atol=atol,
    )


def assert_tensors_close(
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Raise :class:`ParityError` naming ``what``, the rank and the largest differences
    unless ``actual`` equals ``expected`` within ``rtol``/``atol`` (None: the dtype's
    defaults, :func:`tolerance`)."""
    mismatch = compare_tensors(what, actual, expected, rtol=rtol, atol=atol)
    if mismatch is not None:
        raise ParityError(mismatch.describe())


# --- the reference ---------------------------------------------------------------------------


def average_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every gradient of ``module`` over ``group`` and divide by its size (explicit DDP).

    The gradients of one dtype and device go end to end into one all-reduce: the sum is
    elementwise either way, and a collective costs 4 ms at 4 gloo ranks on 2 cores whatever
    its size (measured 2026-11-24), so one per parameter was most of a small test's time.
    """
    size = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in module.parameters():
        if param.grad is not None:
            buckets.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for grads in buckets.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(size)
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(averaged.view(grad.shape))


class ReferenceModel:
    """A plain copy of a module trained with explicit gradient averaging over ``group``.

    ``make_optimizer`` builds the optimizer from the copy's parameters, so the reference and
    the distributed model can use the same recipe, e.g. ``lambda ps: Adam(ps, lr=1e-2)``.
    """

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = copy.deepcopy(module)
        self.optimizer = make_optimizer(self.module.parameters())
        self.group = group

    def forward_backward(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        """Run ``loss_fn(module)``, backward, then average gradients; returns the detached loss."""
        loss = loss_fn(self.module)
        loss.backward()
        average_gradients(self.module, self.group)
        return loss.detach()

    def step(self, *, set_to_none: bool = True) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=set_to_none)


def assert_losses_equal(
    step: int,
    loss: torch.Tensor,
    reference_loss: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """:func:`assert_tensors_close` for one training step's loss against the reference's.

    Raises:
        ParityError: naming the step when the losses differ beyond the tolerance.
    """
    assert_tensors_close(f"loss at step {step}", loss, reference_loss, rtol=rtol, atol=atol)


@dataclass
class LossHistory:
    """Losses of both models per step; ``check()`` names the first diverging step."""

    losses: list[torch.Tensor] = field(default_factory=list)
    reference_losses: list[torch.Tensor] = field(default_factory=list)

    def record(self, loss: torch.Tensor, reference_loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        self.reference_losses.append(reference_loss.detach())

    def check(self, *, rtol: float | None = None, atol: float | None = None) -> None:
        if len(self.losses) != len(self.reference_losses):
            raise ParityError(
                f"{len(self.losses)} losses recorded, "
                f"but {len(self.reference_losses)} reference losses"
            )
        for step, (loss, ref) in enumerate(zip(self.losses, self.reference_losses, strict=True)):
            assert_losses_equal(step, loss, ref, rtol=rtol, atol=atol)


# --- sharded comparison ----------------------------------------------------------------------


def _reshard_like(reference: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``reference`` cut the way ``like`` is (its local shard), or itself for plain tensors."""
    if not isinstance(like, DTensor):
        return reference.detach()
    # src_data_rank=None: every rank slices its own copy; no communication, and a reference
    # that differs between ranks is not papered over by rank 0's copy.
    resharded = distribute_tensor(
        reference.detach(), like.device_mesh, like.placements, src_data_rank=None
    )
    return resharded.to_local()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        name = name.replace(prefix, "")
    return name


def assert_sharded_parity(
    reference: nn.Module,
    model: nn.Module,
    *,
    check_grads: bool = True,
    prefixes_to_ignore: tuple[str, ...] = (),
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Every parameter (and gradient) of ``model`` equals the reference's, shard by shard.

    Parameters are paired in ``named_parameters()`` order and must have the same names once
    ``prefixes_to_ignore`` are removed from the model's names. All mismatches are reported
    together, one line each.
    """
    ref_params = list(reference.named_parameters())
    params = list(model.named_parameters())
    if len(ref_params) != len(params):
        raise ParityError(
            f"model has {len(params)} parameters, reference has {len(ref_params)} "
            f"(model: {[n for n, _ in params]}, reference: {[n for n, _ in ref_params]})"
        )
    problems: list[str] = []
    for (ref_name, ref_param), (name, param) in zip(ref_params, params, strict=True):
        clean = _strip(name, prefixes_to_ignore)
        if clean != ref_name:
            raise ParityError(
                f"parameter order differs: model has {name!r} where reference has {ref_name!r}"
            )
        with torch.no_grad():
            mismatch = compare_tensors(
                f"parameter {clean!r}",
                _local(param),
                _reshard_like(ref_param, param),
                rtol=rtol,
                atol=atol,
            )
        if mismatch is not None:
            problems.append(mismatch.describe())
        if not check_grads:
            continue
        if ref_param.grad is None or param.grad is None:
            if (ref_param.grad is None) != (param.grad is None):
                problems.append(
                    f"gradient of {clean!r} on rank {_rank()}: model has "
                    f"{'none' if param.grad is None else 'one'}, reference has "
                    f"{'none' if ref_param.grad is None else 'one'}"
                )
            continue
        if isinstance(param, DTensor) and not isinstance(param.grad, DTensor):
            problems.append(f"gradient of {clean!r} on rank {_rank()} is not a DTensor")
            continue
        with torch.no_grad():
            mismatch = compare_tensors(
                f"gradient of {clean!r}",
                _local(param.grad),
                _reshard_like(ref_param.grad, param),
                rtol=rtol,
                atol=atol,
            )
        if mismatch is not None:
            problems.append(mismatch.describe())
    if problems:
        raise ParityError("\n".join(problems))
