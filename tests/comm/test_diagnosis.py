"""A rank that skips a collective, or calls it with another shape, is named in the report."""

from __future__ import annotations

import inspect
import re
import time

import pytest

from distconform.harness import launch, torch_api
from distconform.harness.controller.failure_report import render_failure
from tests.comm import diverging_bodies

WORLD_SIZES = [2, 4]
DEADLINE_S = 5.0


@pytest.fixture(params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def world_size(request) -> int:
    return request.param


def line_of(fn, marker: str) -> str:
    """``diverging_bodies.py:N in fn`` for the line of ``fn`` that ends with ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if line.rstrip().endswith(marker):
            return f"diverging_bodies.py:{first + offset} in {fn.__name__}"
    raise AssertionError(f"no line ending with {marker!r} in {fn.__name__}")


def says(text: str, line: str) -> bool:
    """``line`` is in ``text``, where ``{path}`` stands for any path prefix of a site."""
    pattern = re.escape(line).replace(re.escape("{path}"), r"\S*")
    return re.search(pattern, text) is not None


def diagnosis(run) -> str:
    notes = [n for n in run.harness_notes if n.startswith("collective trace:")]
    assert len(notes) == 1, run.harness_notes
    assert notes[0] in render_failure(run, context="ctx", reproducer=None)
    return notes[0]


def test_a_skipped_all_reduce_names_the_missing_rank_and_both_call_sites(world_size):
    body = diverging_bodies.skip_an_all_reduce
    skipping = world_size - 1
    started = time.monotonic()
    run = launch(body, world_size, (skipping,), deadline=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S + 10
    assert not run.ok
    text = diagnosis(run)
    assert f"rank {skipping} never arrived at all_reduce #1 on group world" in text, text
    skipped_site = line_of(body, "# the one skipped")
    for rank in range(world_size - 1):
        called = f"rank {rank} called all_reduce f32[4] (dist.all_reduce) at {{path}}"
        assert says(text, called + skipped_site), text
    last_site = line_of(body, "# agreed")
    assert says(
        text,
        f"rank {skipping} never arrived; its last call on this group was all_reduce #0 "
        f"f32[4] at {{path}}{last_site}",
    ), text


def test_an_all_reduce_of_another_shape_names_the_shapes_and_call_site(world_size):
    body = diverging_bodies.all_reduce_another_shape
    run = launch(body, world_size, (1,), deadline=DEADLINE_S)
    assert not run.ok
    text = diagnosis(run)
    assert "the ranks called different collectives at position #1 of group world" in text, text
    site = line_of(body, "# the mismatch")
    assert says(text, f"rank 1 called all_reduce f32[8] (dist.all_reduce) at {{path}}{site}"), text
    assert says(text, f"rank 0 called all_reduce f32[4] (dist.all_reduce) at {{path}}{site}"), text


def test_a_hung_rank_that_never_arrived_is_named():
    body = diverging_bodies.never_arrive
    run = launch(body, 2, (0,), deadline=3.0)
    assert run.results[0].outcome.value == "hung"
    text = diagnosis(run)
    assert "rank 0 never arrived at all_gather #0 on group world" in text, text
    assert "rank 0 issued no collective on this group [hung]" in text, text
    site = line_of(body, "# waits")
    issued = f"dist.{torch_api.ALL_GATHER_SINGLE}"
    assert says(text, f"rank 1 called all_gather f32[2] ({issued}) at {{path}}{site}")


def test_a_passing_run_has_no_diagnosis():
    run = launch(diverging_bodies.all_reduce_another_shape, 2, (-1,), deadline=DEADLINE_S)
    assert run.ok and not run.harness_notes


def test_a_functional_collective_of_another_shape_in_backward_is_named():
    # Issue 9: the always-on recorder used to see torch.distributed calls only.
    body = diverging_bodies.functional_all_reduce_another_shape_in_backward
    run = launch(body, 2, (1,), deadline=DEADLINE_S)
    assert not run.ok
    text = diagnosis(run)
    assert "the ranks called different collectives at position #0 of group world" in text, text
    # The site is the hook's line: the innermost caller outside torch and the harness.
    site = line_of(body, "# bw").replace(body.__name__, "reduce_in_backward")
    for rank, shape in ((0, "f32[4]"), (1, "f32[6]")):
        called = f"rank {rank} called all_reduce {shape} (funcol.all_reduce) at {{path}}{site}"
        assert says(text, called), text


def test_thread_ranks_record_their_collectives_for_the_diagnosis():
    body = diverging_bodies.skip_an_all_reduce
    run = launch(body, 2, (1,), launcher="thread", deadline=DEADLINE_S)
    assert not run.ok
    text = diagnosis(run)
    assert "rank 1 never arrived at all_reduce #1 on group world" in text, text
    site = line_of(body, "# the one skipped")
    assert says(text, f"rank 0 called all_reduce f32[4] (dist.all_reduce) at {{path}}{site}"), text
