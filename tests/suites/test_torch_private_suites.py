"""``suites/_torch_private.py``: each accessor refuses an unaudited torch and, on the audited
one, gives what the backend suite relies on."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from suites import _torch_private


@pytest.mark.parametrize(
    ("accessor", "args"), [("premul_sum", (0.5,)), ("functional_collectives", ())]
)
def test_accessors_refuse_an_unaudited_torch(monkeypatch, accessor, args):
    monkeypatch.setattr(_torch_private, "installed_torch_version", lambda: (9, 99))
    with pytest.raises(_torch_private.PrivateTorchAccessError, match=accessor):
        getattr(_torch_private, accessor)(*args)


def test_the_installed_torch_is_audited():
    assert _torch_private.installed_torch_version() in _torch_private.AUDITED_TORCH


def test_premul_sum_is_the_premul_sum_reduce_op():
    assert _torch_private.premul_sum(0.5).op == dist.ReduceOp.RedOpType.PREMUL_SUM


def test_functional_collectives_offer_what_the_suite_calls():
    funcol = _torch_private.functional_collectives()
    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single", "wait_tensor"):
        assert callable(getattr(funcol, name)), name
