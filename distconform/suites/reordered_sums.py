"""How far two correct trainings may drift apart when only the order of their sums differs.

Tensor parallelism splits each matmul's reduction over ranks and adds the partial sums
afterwards; the unsharded reference adds the same terms in another order, and an
accelerator's kernels choose orders of their own (split-K, tiles). Both results are right,
and they differ by rounding alone. A constant tolerance cannot say how much: the difference
grows with the length of the sums, and Adam then divides each gradient by its own running
magnitude, which turns a rounding difference in a gradient near zero into a visible
difference of the parameter. The bound here is derived from the computation instead:

* a sum of ``n`` terms in a dtype with unit roundoff ``u``, computed in two orders, differs
  by at most ``2 λ √n u Σ|terms|`` except with probability below ``2 exp(-λ²/2)`` per sum
  (the probabilistic bound of Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019); with
  ``λ = 6`` that is below 3e-8. A gradient's largest entry stands in for ``Σ|terms|``;
* Adam's step is ``lr · m̂ / (√v̂ + eps)``: a gradient error ``δ`` moves it by at most about
  ``2 lr δ / (√v̂ + eps)`` (through ``m`` and through ``v``), and never by more than
  ``2 lr`` (the whole step, either way). The bound adds that up per element, step by step,
  from the reference's own optimizer state.

An implementation bug moves every element by a sizeable fraction of ``lr`` or of the values
themselves; the bound stays near rounding for every element whose gradient is not itself at
rounding level.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from distconform.api import ParityError, tolerance

#: Unit roundoff (half the distance from 1 to the next number) of each floating dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
#: λ of the probabilistic bound: exceeded with probability below 2·exp(-λ²/2) per sum.
CONFIDENCE = 6.0


def reordered_sum_bound(dtype: torch.dtype, length: int, magnitude: float) -> float:
    """How far two orders of one sum of ``length`` terms of total size ``magnitude`` differ."""
    return 2.0 * CONFIDENCE * math.sqrt(max(length, 1)) * UNIT_ROUNDOFF[dtype] * magnitude


def longest_reduction(model: nn.Module, tokens: int) -> int:
    """The longest sum a training step of ``model`` adds up: a linear layer's input width
    (forward), its output width (the input gradient) or the tokens of every data-parallel
    rank (the weight gradient and its average)."""
    widths = [
        max(layer.in_features, layer.out_features)
        for layer in model.modules()
        if isinstance(layer, nn.Linear)
    ]
    return max([tokens, *widths])


class AdamDrift:
    """Per parameter, the elementwise bound on how far it may have drifted from the
    reference's by rounding alone; call :meth:`before_step` with the reference's gradients
    in place and :meth:`after_step` once its optimizer stepped."""

    def __init__(self, reference: nn.Module, optimizer: torch.optim.Adam, length: int) -> None:
        self.reference = reference
        self.optimizer = optimizer
        self.length = length
        self.bounds: dict[str, torch.Tensor] = {}
        self._gradient_errors: dict[str, float] = {}

    def gradient_bound(self, name: str) -> float:
        """How far a gradient of ``name`` may differ from the reference's this step."""
        return self._gradient_errors[name]

    def before_step(self) -> None:
        self._gradient_errors = {
            name: reordered_sum_bound(
                param.grad.dtype, self.length, param.grad.detach().abs().max().item()
            )
            for name, param in self.reference.named_parameters()
            if param.grad is not None
        }

    def after_step(self) -> None:
        for group in self.optimizer.param_groups:
            lr, eps = group["lr"], group["eps"]
            _, beta2 = group["betas"]
            for param in group["params"]:
                name = self._name_of(param)
                if name not in self._gradient_errors:
                    continue
                state = self.optimizer.state[param]
                step = float(state["step"])
                second_moment = state["exp_avg_sq"] / (1.0 - beta2**step)
                moved = 2.0 * lr * self._gradient_errors[name] / (second_moment.sqrt() + eps)
                drift = moved.clamp(max=2.0 * lr)
                self.bounds[name] = self.bounds.get(name, torch.zeros_like(drift)) + drift

    def _name_of(self, param: torch.Tensor) -> str:
        for name, candidate in self.reference.named_parameters():
            if candidate is param:
                return name
        raise KeyError("a parameter the optimizer holds is not the reference's")

    def assert_within(self, what: str, name: str, actual: torch.Tensor, expected: torch.Tensor):
        """``actual`` equals ``expected`` up to the dtype's default tolerance plus the drift."""
        rtol, atol = tolerance(expected.dtype)
        drift = self.bounds.get(name, torch.zeros_like(expected))
        allowed = atol + rtol * expected.abs() + drift.to(expected.device)
        excess = (actual - expected).abs() - allowed
        if bool((excess > 0).any()):
            worst = int(excess.argmax())
            differs = float((actual - expected).abs().flatten()[worst])
            bound, drifted = float(allowed.flatten()[worst]), float(drift.flatten()[worst])
            raise ParityError(
                f"{what}: {int((excess > 0).sum())} of {expected.numel()} elements differ by "
                f"more than rounding can explain; the worst (flat index {worst}) by "
                f"{differs:.3g}, allowed {bound:.3g} (of which {drifted:.3g} is the drift Adam "
                f"may have made of reordered sums)"
            )
