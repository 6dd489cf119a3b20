"""``suites/_torch_private.py``: each accessor refuses an unaudited torch, naming this file, and
on the audited one gives what the backend suite relies on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness._torch_private import PrivateTorchAccessError
from suites import _torch_private


@pytest.mark.parametrize(
    ("accessor", "args"), [("premul_sum", (0.5,)), ("functional_collectives", ())]
)
def test_accessors_refuse_an_unaudited_torch(monkeypatch, accessor, args):
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(PrivateTorchAccessError) as raised:
        getattr(_torch_private, accessor)(*args)
    assert f"suites/_torch_private.py:{accessor}" in str(raised.value)
    assert "2.14.0" in str(raised.value)


def test_premul_sum_is_the_premul_sum_reduce_op():
    assert _torch_private.premul_sum(0.5).op == dist.ReduceOp.RedOpType.PREMUL_SUM


def test_functional_collectives_offer_what_the_suite_calls():
    funcol = _torch_private.functional_collectives()
    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "wait_tensor"):
        assert callable(getattr(funcol, name)), name
