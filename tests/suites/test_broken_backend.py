"""The backend suite fails on a backend that wraps gloo and breaks one thing, with the
complaint that names the bug, and passes the same items on the unbroken wrapper.

Each row runs one backend-suite item in a child ``python -m pytest`` with
``--backend-plugin tests.suites.broken_backend --backend <breakage>_gloo`` and gloo's own
declaration under that name (the wrapper supports what gloo does). Every test module of the
suite has a row; strided all_reduce, broadcast and reduce_scatter (list form), the
precision contract, gather of complex64 and abort fail on gloo itself
(``suites/backend/expectations/gloo.toml``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distconform.suites.backend.declaration import DECLARATIONS_DIR
from tests.suites.child_session import failure_text, run_one_item

SUITE = "suites/backend"


def row(breakage: str, item: str, complaint: str, *, fast: bool = False):
    marks = () if fast else (pytest.mark.slow,)
    return pytest.param(breakage, f"{SUITE}/{item}", complaint, marks=marks, id=breakage)


# Each row costs a child session (about 7 s): one runs by default, all with -m slow.
ROWS = [
    row(
        "wrong_op",
        "test_reductions.py::test_all_reduce[ws2-op=max-dtype=int64]",
        "all_reduce max int64",
        fast=True,
    ),
    row(
        "early_async",
        "test_async.py::test_async_work_completes_only_when_every_rank_has_joined[ws2]",
        "is_completed() was True before rank 1 joined",
    ),
    row(
        "wrong_split",
        "test_data_movement.py::test_all_to_all[ws2-dtype=float32]",
        "single, uneven splits",
    ),
    row(
        "wrong_root",
        "test_data_movement.py::test_broadcast_from_every_rank[ws2-dtype=int8]",
        "src 1",
    ),
    row(
        "dropped_tail",
        "test_data_movement.py::test_all_gather[ws2-dtype=float32]",
        "single form",
    ),
    row(
        "dropped_tail",
        "test_functional.py::test_functional_collectives[ws2-dtype=float32]",
        "all_gather",
    ),
    row(
        "rotated_blocks",
        "test_reductions.py::test_reduce_scatter[ws2-op=sum-dtype=bfloat16]",
        "single form",
    ),
    row(
        "rotated_blocks",
        "test_functional.py::test_dtensor_redistribute[ws2-move=partial-to-shard0]",
        "elements wrong",
    ),
    row(
        "reversed_gather",
        "test_data_movement.py::test_gather_to_every_rank[ws2-dtype=float32]",
        "from rank 0",
    ),
    row(
        "no_barrier",
        "test_groups.py::test_barrier_holds_every_rank_until_the_last_arrives[ws2]",
        "left the barrier before the last rank arrived",
    ),
    row(
        "ignored_tags",
        "test_point_to_point.py::test_send_recv_ring[ws2-dtype=float32]",
        "isend/irecv tag",
    ),
    row(
        "late_timeout",
        "test_errors.py::test_absent_rank_times_the_others_out[ws2]",
        "the error came after",
    ),
    row(
        "coalesced_first_only",
        "test_async.py::test_coalesced_calls[ws2-dtype=float32]",
        "allreduce_coalesced #1",
    ),
    row(
        "local_subgroups",
        "test_groups.py::test_new_subgroups_beside_the_default_group[ws4]",
        "new_subgroups(group_size=2): sum over",
    ),
    row(
        "coalesced_first_only",
        "test_async.py::test_deprecated_coalesced_spellings[ws2-dtype=int64]",
        "dist.all_reduce_coalesced #1",
    ),
    # gloo gathers a transposed input right: only a storage-order read gets it wrong.
    row(
        "storage_order_gather",
        "test_non_contiguous.py::test_non_dense_tensors_give_the_right_result_or_a_contiguity_error"
        "[ws3-operation=all_gather-form=single-layout=transposed]",
        "all_gather_single, input and output",
    ),
    row(
        "offset_blind_reduce_scatter",
        "test_non_contiguous.py::test_non_dense_tensors_give_the_right_result_or_a_contiguity_error"
        "[ws2-operation=reduce_scatter-form=single-layout=offset]",
        "reduce_scatter_single, input and output",
    ),
]


def run_item(tmp_path: Path, backend: str, nodeid: str, *, claims: str = "") -> tuple[list, str]:
    """The child session's failures of ``nodeid`` on ``backend``, and its output.

    The backend runs with gloo's declaration (renamed), plus the capabilities in ``claims``.
    """
    declaration = tmp_path / f"{backend}.toml"
    gloo = (DECLARATIONS_DIR / "gloo.toml").read_text()
    gloo = gloo.replace('backend = "gloo"', f'backend = "{backend}"')
    if claims:
        # The claim moves from [not_declared] (dropped whole) into the capabilities.
        gloo = gloo.split("[not_declared]")[0]
        gloo = gloo.replace("capabilities = [", f'capabilities = ["{claims}", ')
    declaration.write_text(gloo)
    options = ["--backend", backend, "--backend-declaration", str(declaration)]
    if backend != "gloo":
        options += ["--backend-plugin", "tests.suites.broken_backend"]
    return run_one_item(nodeid, options, tmp_path / f"{backend}.xml", 300)


def assert_failed_with(failures: list, output: str, complaints: tuple[str, ...], what: str):
    """``what`` failed, with a message holding one of ``complaints``."""
    assert failures, f"{what} passed:\n{output[-3000:]}"
    message = failure_text(failures)
    assert any(complaint in message for complaint in complaints), (
        f"{what} failed, but with none of {complaints}:\n{message[-3000:]}"
    )


@pytest.mark.parametrize(("breakage", "nodeid", "complaint"), ROWS)
def test_backend_suite_fails_on_a_broken_backend(tmp_path, breakage, nodeid, complaint):
    failures, output = run_item(tmp_path, f"{breakage}_gloo", nodeid)
    assert_failed_with(failures, output, (complaint,), f"{nodeid} on the {breakage} backend")


@pytest.mark.slow
@pytest.mark.parametrize("nodeid", sorted({row.values[1] for row in ROWS}))
def test_the_unbroken_wrapper_passes(tmp_path, nodeid):
    failures, output = run_item(tmp_path, "wrapped_gloo", nodeid)
    assert not failures, f"{nodeid} failed on the unbroken wrapper:\n{output[-3000:]}"


@pytest.mark.slow
def test_a_backend_claiming_mismatch_detection_it_lacks_fails(tmp_path):
    """gloo, declared to detect mismatches: on a shape mismatch the rank receiving more bytes
    than it expects aborts (or, with the sizes the other way round, completes)."""
    nodeid = (
        f"{SUITE}/test_errors.py::test_mismatched_calls_raise_on_every_rank[ws2-mismatch=shape]"
    )
    failures, output = run_item(tmp_path, "gloo", nodeid, claims="mismatch_detection")
    complaints = ("completed while another rank passed a different shape", "killed by SIGABRT")
    assert_failed_with(failures, output, complaints, "gloo claiming mismatch detection")
