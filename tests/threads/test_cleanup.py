"""Hangs and cleanup: nothing the runner installs outlives it.

Kept apart from the other runner tests so that no module-scoped runner is open while
these check that the thread-local c10d world is gone.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from distconform.harness import _torch_private
from distconform.harness.shared.outcomes import Outcome
from distconform.harness.threads import RunnerUnusableError, ThreadRunner, run_threaded


def _hang_outside_collectives(release: threading.Event) -> None:
    if dist.get_rank() == 1:
        release.wait(60)  # blocks while holding the baton: only the deadline can tell
    dist.barrier()


def test_hang_is_reported_with_stack_and_runner_becomes_unusable():
    release = threading.Event()
    threads_before = set(threading.enumerate())
    runner = ThreadRunner(2, deadline=0.5)
    try:
        start = time.monotonic()
        result = runner.run(_hang_outside_collectives, release)
        assert time.monotonic() - start < 0.5 + 1.0 + 0.5
        assert result.hung
        hung = result.results[1]
        assert hung.outcome is Outcome.HUNG
        assert "_hang_outside_collectives" in hung.stacks
        assert "release.wait(60)" in hung.stacks
        assert result.results[0].outcome is Outcome.ABORTED_BY_PEER
        assert not runner.usable
        with pytest.raises(RunnerUnusableError, match="hung"):
            runner.run(_hang_outside_collectives, release)
    finally:
        runner.close()
        release.set()
        # Only this test's rank threads: other tests may leave hung ones behind on purpose.
        for thread in threading.enumerate():
            if thread.name.startswith("distconform-rank") and thread not in threads_before:
                thread.join(5)
    _assert_world_restored()


# --- nothing stays patched -----------------------------------------------------------------


def _assert_world_restored() -> None:
    """The process-wide c10d (and its name registry) works like in a fresh process."""
    assert not _torch_private.thread_local_c10d_world_installed()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.full((2,), 3.0)
        dist.all_reduce(t)
        assert t.tolist() == [3.0, 3.0]
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(4.0)
        assert torch.equal(distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full)
    finally:
        dist.destroy_process_group()


def test_main_thread_untouched_while_installed_and_restored_after():
    hook = sys.excepthook
    with ThreadRunner(2) as runner:
        assert _torch_private.thread_local_c10d_world_installed()
        runner.run(dist.barrier).raise_on_failure()
        assert not dist.is_initialized()  # the ranks' groups live in their own worlds
        assert sys.excepthook is hook  # init_process_group wraps it; the run undoes that
    _assert_world_restored()


def test_store_based_init_barrier_does_not_deadlock(monkeypatch):
    # With TORCH_DIST_INIT_BARRIER=1 c10d blocks in store.wait during init and new_group.
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    result = run_threaded(lambda: dist.new_group([0, 1]) and dist.barrier(), 3, deadline=30.0)
    result.raise_on_failure()


def test_main_thread_groups_keep_working_while_a_runner_is_open():
    # Isolation mode makes group names per-thread; the main thread's existing groups must
    # stay resolvable for functional collectives (DTensor) while the runner is open.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(6.0)
        with ThreadRunner(2) as runner:
            runner.run(dist.barrier).raise_on_failure()
            assert dist.get_backend() == "gloo"  # the ranks' worlds did not replace ours
            assert torch.equal(distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full)
        assert torch.equal(distribute_tensor(full, mesh, [Shard(0)]).full_tensor(), full)
    finally:
        dist.destroy_process_group()
    _assert_world_restored()
