"""Ground truth for the backend suite, computed in plain torch on each rank from every rank's
contribution (``distconform.suites.backend.contributions``), in float64 / int64 / complex128 and
cast once at the end: what a reduction in exact arithmetic gives.

``Findings`` collects every mismatch of an item (each size and layout it checks) and fails
once with all of them, so one red test shows the whole pattern (only odd sizes, only
strided inputs, only one source rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: PREMUL_SUM's factor: a power of two, so the exact result stays exact in every dtype.
PREMUL_FACTOR = 0.5


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():
        return tensor.to(torch.complex128)
    if tensor.is_floating_point():
        return tensor.to(torch.float64)
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.to(torch.int64)


def reduce(inputs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``op`` over ``inputs`` (in rank order) in exact arithmetic, cast to their dtype."""
    dtype = inputs[0].dtype
    wide = [_wide(t.detach().cpu()) for t in inputs]
    result = wide[0].clone()
    for tensor in wide[1:]:
        if op in ("sum", "avg", "premul_sum"):
            result = result + tensor
        elif op == "product":
            result = result * tensor
        elif op == "min":
            result = torch.minimum(result, tensor)
        elif op == "max":
            result = torch.maximum(result, tensor)
        elif op == "band":
            result = result & tensor
        elif op == "bor":
            result = result | tensor
        elif op == "bxor":
            result = result ^ tensor
        else:
            raise ValueError(f"unknown reduce op {op!r}")
    if op == "avg":
        result = result / len(wide)
    elif op == "premul_sum":
        result = result * PREMUL_FACTOR
    return result.to(dtype)


def unlike(expected: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A buffer for a result, on ``device``, that differs from ``expected`` at every element:
    a backend that leaves any element unwritten is seen (zeros would hide the zeros)."""
    # expected + 1 is exact: every expected value is a small integer (or a third of one).
    filler = ~expected if expected.dtype == torch.bool else expected + 1
    return filler.to(device if device is not None else expected.device).contiguous()


def rounds(op: str) -> bool:
    """Whether the exact result may be rounded once in the dtype (AVG divides)."""
    return op == "avg"


class Findings:
    """Every mismatch one test item finds; ``raise_if_any`` fails with all of them."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.problems: list[str] = []

    def expect_equal(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        where: str,
        *,
        one_rounding: bool = False,
    ) -> None:
        """``actual`` must equal ``expected`` (within one rounding in the dtype if asked)."""
        actual_cpu = actual.detach().cpu()
        expected = expected.to(actual_cpu.device)
        if actual_cpu.dtype != expected.dtype:
            self.problems.append(f"{where}: dtype {actual_cpu.dtype}, expected {expected.dtype}")
            return
        if actual_cpu.shape != expected.shape:
            self.problems.append(
                f"{where}: shape {tuple(actual_cpu.shape)}, expected {tuple(expected.shape)}"
            )
            return
        if one_rounding and (expected.is_floating_point() or expected.is_complex()):
            # One rounding of the exact result: within a relative eps (an exact 0 stays 0).
            eps = torch.finfo(expected.dtype).eps
            wrong = ~torch.isclose(actual_cpu, expected, rtol=eps, atol=0.0)
        else:
            wrong = actual_cpu != expected
        count = int(wrong.sum())
        if count:
            index = int(wrong.reshape(-1).nonzero()[0])
            got = actual_cpu.reshape(-1)[index].item()
            want = expected.reshape(-1)[index].item()
            self.problems.append(
                f"{where}: {count} of {expected.numel()} elements wrong, first at flat index "
                f"{index}: got {got!r}, expected {want!r}"
            )

    def expect_each_from_its_rank(
        self, received: Sequence[torch.Tensor], sent: Sequence[torch.Tensor], where: str
    ) -> None:
        """``received[r]`` must equal what rank r sent (a gathered list, in rank order)."""
        for src, (got, want) in enumerate(zip(received, sent, strict=True)):
            self.expect_equal(got, want, f"from rank {src}, {where}")

    def note(self, problem: str) -> None:
        self.problems.append(problem)

    def raise_if_any(self) -> None:
        if self.problems:
            shown = self.problems[:12]
            more = len(self.problems) - len(shown)
            raise AssertionError(
                f"{self.what}: {len(self.problems)} check(s) failed\n  "
                + "\n  ".join(shown)
                + (f"\n  ... and {more} more" if more else "")
            )
