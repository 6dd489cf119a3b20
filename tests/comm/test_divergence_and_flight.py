"""The divergence finder and the trace files, on hand-made calls (no ranks needed)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from distconform.harness.comm import CollectiveCall, find_divergence, flight
from distconform.harness.comm.flight import FlightRecorder
from distconform.harness.comm.flight_files import diagnosis_note, read_rank_trace, trace_paths
from distconform.harness.comm.records import RawCall


def call(
    rank_seq: int,
    kind="all_reduce",
    shape=(4,),
    dtype="f32",
    group="world",
    ranks=(0, 1),
    at=0.0,
    site="t.py:1 in f",
    group_seq=None,
) -> CollectiveCall:
    return CollectiveCall(
        seq=rank_seq,
        group_seq=rank_seq if group_seq is None else group_seq,
        kind=kind,
        api=f"dist.{kind}",
        group=group,
        group_name=group,
        group_ranks=ranks,
        shapes=(shape,),
        dtypes=(dtype,),
        numel=4,
        nbytes=16,
        out_numel=4,
        out_nbytes=16,
        wire_bytes=16,
        phase="-",
        site=site,
        time=at,
    )


def test_agreeing_traces_have_no_divergence():
    trace = [call(0), call(1, kind="all_gather")]
    assert find_divergence({0: trace, 1: list(trace)}) is None


def test_a_dtype_mismatch_is_found_at_its_position():
    found = find_divergence({0: [call(0), call(1)], 1: [call(0), call(1, dtype="bf16")]})
    assert found is not None and found.mismatched and found.group_seq == 1
    text = found.describe()
    assert "rank 0 called all_reduce f32[4]" in text and "rank 1 called all_reduce bf16[4]" in text


def test_the_earliest_divergence_across_groups_wins():
    late = [call(0, group="a", at=5.0)]
    early = [call(0, group="b", at=1.0, kind="barrier")]
    found = find_divergence({0: late + early, 1: [call(0, group="a", at=5.0, shape=(8,))]})
    assert found is not None and found.group == "b" and found.missing == (1,)
    assert "rank 1 issued no collective on this group" in found.describe()


def test_a_rank_absent_from_a_subgroup_is_not_expected_there():
    sub = call(0, group="pair", ranks=(0, 1))
    assert find_divergence({0: [sub], 1: [sub], 2: []}) is None


def test_point_to_point_calls_are_not_matched():
    assert find_divergence({0: [call(0, kind="send")], 1: []}) is None


def test_ranks_whose_ring_dropped_old_calls_are_compared_from_their_oldest_kept_call():
    full = [call(i) for i in range(6)]
    assert find_divergence({0: full, 1: full[3:]}) is None
    found = find_divergence({0: full, 1: full[3:5]})
    assert found is not None and found.group_seq == 5 and found.missing == (1,)


def test_diagnosis_note_names_states():
    note = diagnosis_note({0: [call(0)], 1: []}, {0: "failed", 1: "passed"})
    assert note.startswith("collective trace: rank 1 never arrived at all_reduce #0")
    assert "[passed]" in note and "[failed]" in note
    assert diagnosis_note(None, {}) is None


def _raw(n: int) -> RawCall:
    return RawCall(
        kind="all_reduce",
        api="dist.all_reduce",
        group="g",
        inputs=(),
        out_numel=n,
        out_nbytes=4 * n,
        site=f"t.py:{n} in f",
        auto_phase="-",
        group_ranks=(0, 1),
        shapes=((n,),),
        dtypes=("f32",),
        numel=n,
        nbytes=4 * n,
    )


def test_the_ring_keeps_the_latest_calls_and_survives_a_torn_line(tmp_path):
    with FlightRecorder(tmp_path, rank=3, task_id=8, ring_half=3) as recorder:
        for n in range(8):
            recorder.handle(_raw(n), lambda: None)
    kept = read_rank_trace(tmp_path, 3)
    # 8 calls through halves of 3: the current half holds calls 6-7, the other 3-5.
    assert [c.numel for c in kept] == [3, 4, 5, 6, 7]
    size = sum(p.stat().st_size for p in trace_paths(tmp_path, 3))
    assert size < 8 * 600, size  # a few hundred bytes per call
    current = trace_paths(tmp_path, 3)[recorder._part]
    with open(current, "a") as handle:
        handle.write(json.dumps(kept[-1].to_json())[:40])  # killed mid-write
    assert [c.numel for c in read_rank_trace(tmp_path, 3)] == [3, 4, 5, 6, 7]


def test_the_next_task_starts_an_empty_trace(tmp_path):
    with FlightRecorder(tmp_path, rank=0, task_id=1, ring_half=2) as recorder:
        for n in range(5):
            recorder.handle(_raw(n), lambda: None)
    with FlightRecorder(tmp_path, rank=0, task_id=2, ring_half=2) as recorder:
        recorder.handle(_raw(9), lambda: None)
    assert [c.numel for c in read_rank_trace(tmp_path, 0)] == [9]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_rank_reuses_its_open_trace_files_from_task_to_task(tmp_path):
    before = _open_fds()
    for task in range(1, 30):
        with FlightRecorder(tmp_path, rank=0, task_id=task, ring_half=2) as recorder:
            for n in range(task % 5):
                recorder.handle(_raw(n), lambda: None)
        assert [c.numel for c in read_rank_trace(tmp_path, 0)] == list(range(task % 5))
        header = trace_paths(tmp_path, 0)[0].read_text().splitlines()[0]
        assert json.loads(header) == {"task": task}
    assert _open_fds() - before <= 2  # one pair, kept open for the next task


def test_nested_recorders_of_one_rank_each_keep_their_own_trace(tmp_path):
    outer_dir, inner_dir = tmp_path / "pool", tmp_path / "test"
    outer_dir.mkdir()
    inner_dir.mkdir()
    with FlightRecorder(outer_dir, rank=1, task_id=1) as outer:
        outer.handle(_raw(1), lambda: None)
        with FlightRecorder(inner_dir, rank=1, task_id=7) as inner:
            inner.handle(_raw(2), lambda: None)
        outer.handle(_raw(3), lambda: None)
    assert [c.numel for c in read_rank_trace(outer_dir, 1)] == [1, 3]
    assert [c.numel for c in read_rank_trace(inner_dir, 1)] == [2]


def test_a_removed_trace_directory_gets_new_files(tmp_path):
    directory = tmp_path / "pool"
    directory.mkdir()
    with FlightRecorder(directory, rank=0, task_id=1) as recorder:
        recorder.handle(_raw(1), lambda: None)
    shutil.rmtree(directory)
    directory.mkdir()
    with FlightRecorder(directory, rank=0, task_id=2) as recorder:
        recorder.handle(_raw(2), lambda: None)
    assert [c.numel for c in read_rank_trace(directory, 0)] == [2]


def test_an_abandoned_recorder_gives_its_files_to_nobody(tmp_path):
    hung = FlightRecorder(tmp_path, rank=0, task_id=1)
    hung.__enter__()
    hung.handle(_raw(1), lambda: None)
    hung.abandon()
    with FlightRecorder(tmp_path, rank=0, task_id=2) as recorder:
        recorder.handle(_raw(2), lambda: None)
        with pytest.raises(OSError):  # the hung thread's late call lands nowhere
            hung.handle(_raw(3), lambda: None)
    assert [c.numel for c in read_rank_trace(tmp_path, 0)] == [2]


def test_files_of_short_lived_directories_stay_bounded(tmp_path):
    before = _open_fds()
    for index in range(40):
        directory = tmp_path / str(index)
        directory.mkdir()
        with FlightRecorder(directory, rank=0, task_id=1) as recorder:
            recorder.handle(_raw(1), lambda: None)
        shutil.rmtree(directory)
    assert _open_fds() - before <= 2 * flight._MAX_IDLE


def test_every_public_name_of_the_comm_package_resolves_on_first_use():
    import distconform.harness.comm as comm

    assert sorted(comm._HOMES) == sorted(comm.__all__)
    for name in comm.__all__:
        value = getattr(comm, name)
        assert getattr(value, "__name__", name) == name
    with pytest.raises(AttributeError, match="no_such_name"):
        comm.no_such_name  # noqa: B018
