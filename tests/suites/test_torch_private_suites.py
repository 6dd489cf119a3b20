"""``suites/_torch_private.py``: each accessor has an audit of every release of the window,
refuses a torch outside it (or a release its audit lacks) naming this file, and on the installed
torch gives what the backend suite relies on."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from distconform.harness.torch_window import (
    SUPPORTED_TORCH,
    V2_13,
    installed_torch_version,
)
from distconform.suites import _torch_private
from tests.audited_access import audit_tests

MODULE = "suites/_torch_private.py"
CALLS = {"premul_sum": (0.5,), "functional_collectives": ()}

(
    test_every_accessor_has_an_audit_of_every_release,
    test_every_accessor_refuses_a_torch_outside_the_window,
    test_an_accessor_whose_audit_lacks_the_installed_release_is_refused,
) = audit_tests(_torch_private, MODULE, CALLS)
SUITE_CALLS = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "wait_tensor",
)


def test_premul_sum_is_the_premul_sum_reduce_op():
    assert _torch_private.premul_sum(0.5).op == dist.ReduceOp.RedOpType.PREMUL_SUM


def test_functional_collectives_offer_what_the_suite_calls():
    funcol = _torch_private.functional_collectives()
    for name in SUITE_CALLS:
        assert callable(getattr(funcol, name)), name


def test_the_funcol_names_are_chosen_for_every_release():
    assert set(_torch_private._FUNCOL_SINGLE_NAMES) == set(SUPPORTED_TORCH)


def test_functional_collectives_are_the_installed_releases_own_names():
    """2.11 and 2.12 have only ``all_gather_tensor``/``reduce_scatter_tensor``; from 2.13 on
    those warn, so the ``*_single`` names must be the ones returned there."""
    import torch.distributed._functional_collectives as module

    funcol = _torch_private.functional_collectives()
    if installed_torch_version() >= V2_13:
        assert funcol.all_gather_single is module.all_gather_single
        assert funcol.reduce_scatter_single is module.reduce_scatter_single
    else:
        assert funcol.all_gather_single is module.all_gather_tensor
        assert funcol.reduce_scatter_single is module.reduce_scatter_tensor
    for name in ("all_reduce", "all_to_all_single", "wait_tensor"):
        assert getattr(funcol, name) is getattr(module, name)


@pytest.mark.world_size(2)
def test_functional_collectives_move_the_data_without_a_warning(rank_ctx):
    funcol = _torch_private.functional_collectives()
    rank, group = rank_ctx.rank, rank_ctx.group
    mine = torch.arange(4.0, device=rank_ctx.device) + 10 * rank
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        gathered = funcol.wait_tensor(funcol.all_gather_single(mine.clone(), 0, group))
        scattered = funcol.wait_tensor(funcol.reduce_scatter_single(mine.clone(), "sum", 0, group))
    both = [torch.arange(4.0) + 10 * peer for peer in range(2)]
    torch.testing.assert_close(gathered.cpu(), torch.cat(both))
    torch.testing.assert_close(scattered.cpu(), sum(both)[2 * rank : 2 * rank + 2])
