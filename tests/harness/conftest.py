"""Shared helpers for the harness tests: a pool manager and tasks built from functions."""

from __future__ import annotations

import sys

import pytest

from distconform.harness.controller.dispatch import make_pool
from distconform.harness.controller.pools import PoolKey, PoolManager
from distconform.harness.shared.task import RankTask, pack_call


def task_for(fn, *args, seed: int = 0) -> RankTask:
    payload, modules = pack_call(fn, args, {})
    return RankTask(
        test_id=fn.__name__,
        payload=payload,
        modules=modules,
        sys_path=tuple(sys.path),
        seed=seed,
        pg_timeout=8.0,
    )


@pytest.fixture
def pools():
    manager = PoolManager(lambda key: make_pool(key, echo=None))
    yield manager
    manager.shutdown()


KEY4 = PoolKey(
    launcher="process", world_size=4, backend="gloo", device_type="cpu", threads_per_rank=1
)
