"""A per-rank memory limit: an allocation beyond it raises in that rank, and says so."""

from __future__ import annotations

import pytest

from distconform.harness import Outcome
from distconform.harness.controller.failure_report import render_failure
from distconform.harness.shared.memory_sizes import format_size, parse_size
from tests.harness.conftest import KEY4, task_for


@pytest.mark.parametrize(
    ("text", "size"),
    [("512MiB", 512 * 2**20), ("2 GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), (4096, 4096)],
)
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "0", "-3MiB"])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_an_allocation_over_the_limit_fails_in_that_rank_only(pools):
    from dataclasses import replace

    from tests.harness import rank_bodies

    task = replace(task_for(rank_bodies.allocate_on, 2, 512), memory_limit=parse_size("128MiB"))
    run = pools.run(KEY4, task, deadline=30.0, peer_grace=0.5)
    over = run.results[2]
    assert over.outcome is Outcome.FAILED
    assert over.note == f"rank 2 exceeded its memory limit of {format_size(128 * 2**20)}"
    assert [r.outcome for r in run.results if r.rank != 2] == [Outcome.PASSED] * 3
    assert "rank 2 exceeded its memory limit" in render_failure(run, context="", reproducer=None)
    # The limit belongs to the test: the next test on a fresh pool allocates freely.
    after = pools.run(
        KEY4, task_for(rank_bodies.allocate_on, 2, 512), deadline=30.0, peer_grace=0.5
    )
    assert after.ok
