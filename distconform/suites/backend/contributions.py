"""What each rank puts into a collective: deterministic, so every rank can compute every other
rank's input and with it the ground truth, without trusting the backend under test.

Values are small integers (or integers plus an imaginary part), exact in every dtype the
suite covers, chosen per reduce op so that the exact result also fits and still depends on
every rank: sums of at most 8 values in [-8, 8], products of +-1 with at most one factor 2
per element, AND / OR of 7-bit values where at most one rank clears or sets a bit per
element (``tests/suites/test_backend_inputs.py`` holds these properties). Data-movement ops
use values that differ between ranks and positions, so that an element delivered from the
wrong rank or offset is seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from distconform.suites.backend_capabilities import DTYPES, REDUCE_OPS

#: Element counts every item checks: empty, a single element, an odd count. Strided tensors
#: have a case of their own (``test_non_contiguous``): a backend that ignores strides gets
#: every op wrong at once, which would otherwise turn every case red and hide the rest.
SIZES = (0, 1, 37)

_FLOATING = {"float32", "float64", "float16", "bfloat16"}
_INTEGRAL = {"int8", "int32", "int64"}


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def valid_reduction(op: str, dtype: str) -> bool:
    """Whether c10d defines ``op`` on ``dtype`` (what NCCL and gloo document; no backend's
    refusal can make a combination valid or invalid)."""
    if op in ("avg", "premul_sum"):
        return dtype in _FLOATING or dtype == "complex64"
    if op in ("band", "bor", "bxor"):
        return dtype in _INTEGRAL or dtype == "bool"
    if op in ("min", "max"):
        return dtype != "complex64"
    if op == "product":
        return dtype not in ("bool", "complex64")
    return dtype != "bool"  # sum: bool has no agreed meaning (OR in gloo, error elsewhere)


def reduction_points(ops: tuple[str, ...] = REDUCE_OPS) -> Iterator[tuple[str, str]]:
    for op in ops:
        for dtype in DTYPES:
            if valid_reduction(op, dtype):
                yield op, dtype


def _integers(rank: int, numel: int, salt: int, recipe: str, world_size: int) -> torch.Tensor:
    # Built on the CPU on purpose: the ground truth never touches the device under test.
    i = torch.arange(numel, dtype=torch.int64, device="cpu")
    # At each element at most one rank is "marked", a different one from element to element:
    # reductions that would otherwise saturate (AND of many values, OR of many bits, a sign
    # that flips once per element) keep a result that depends on which rank sent what.
    marked = (i * 7 + salt) % (world_size + 1) == rank
    bit = 1 << ((i * 5 + rank) % 7)
    if recipe == "product":
        sign = torch.where((i + salt) // (rank + 1) % 2 == 1, -1, 1)
        return torch.where(marked, 2 * sign, sign)
    if recipe == "band":
        return torch.where(marked, 127 - bit, 127)
    if recipe == "bor":
        return torch.where(marked, bit, 0)
    if recipe == "bxor":
        return (rank * 29 + i * 13 + salt) % 101
    if recipe == "sum":
        # Period 17 * 17, so that equal-sized blocks of one rank's input differ (a period
        # dividing the block size would hide a block delivered to the wrong rank).
        return (rank * 5 + i * 7 + (i // 17) * 3 + salt) % 17 - 8
    return (rank * 37 + i * 11 + salt) % 101 - 50  # "move": distinct per rank and offset


def recipe_for(op: str | None) -> str:
    if op in ("product", "band", "bor", "bxor"):
        return op
    if op in ("sum", "avg", "premul_sum"):
        return "sum"
    return "move"


#: For bool, which recipe's marks stand in for each op (True where the rank is marked).
_BOOL_MARKS = {"band": False, "min": False, "bor": True, "max": True}


def contribution(
    rank: int,
    numel: int,
    dtype: str,
    *,
    op: str | None = None,
    salt: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rank ``rank``'s input of ``numel`` elements for reduce op ``op`` (None: data movement)."""
    if dtype == "bool" and op in _BOOL_MARKS:
        marked = _integers(rank, numel, salt, "bor", world_size) != 0
        tensor = marked if _BOOL_MARKS[op] else ~marked
        return tensor.to(device)
    values = _integers(rank, numel, salt, recipe_for(op), world_size)
    if dtype == "bool":
        tensor = values % 2 == 1
    elif dtype == "complex64":
        imaginary = _integers(rank + 1, numel, salt + 7, recipe_for(op), world_size)
        tensor = torch.complex(values.float(), imaginary.float())
    else:
        tensor = values.to(torch_dtype(dtype))
    return tensor.to(device)


def pair_salt(dst: int) -> int:
    """The salt that makes rank src's data-movement input for ``dst`` differ from every other
    (src, dst) pair's, up to 8 ranks: the "move" recipe's offset 37 * (src + 8 * dst) mod 101
    is distinct for each pair (37 is invertible mod the prime 101, and src + 8 * dst < 101)."""
    return 37 * 8 * dst


def strided(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as every other element of a fresh buffer twice as long."""
    buffer = torch.zeros(2 * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    view = buffer[::2]
    view.copy_(tensor.reshape(-1))
    return view.view(tensor.shape) if tensor.dim() == 1 else view.reshape(tensor.shape)
