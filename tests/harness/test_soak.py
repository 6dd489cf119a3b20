"""Soak: one pytest session of 10,000 trivial ws-2 tests stays on one warm pool, and the
ranks' resources stay flat (slow: about a minute per launcher).

Every 500th test each rank writes its pid, resident memory, open file descriptors and
thread count to a file; the parent side counts the harness's temp directories before and
after the session. Bounds, after the first sample (warm-up: imports, allocator pools):
RSS grows by at most 16 MiB, file descriptors and threads not at all, no temp directory is
left, the pid never changes (the pool was never recycled), and the last 1,000 tests take
at most 1.5x as long per test as the 1,000 after the warm-up.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

TESTS = 10_000
SAMPLE_EVERY = 500
RSS_GROWTH_BOUND = 16 * 2**20
DRIFT_BOUND = 1.5

SOAK_MODULE = f"""
import json
import os
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range({TESTS}))
def test_trivial(rank_ctx, index):
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
    if index % {SAMPLE_EVERY} == 0 or index == {TESTS} - 1:
        me = psutil.Process()
        sample = {{
            "index": index,
            "time": time.monotonic(),
            "pid": os.getpid(),
            "rss": me.memory_info().rss,
            "fds": me.num_fds(),
            "threads": threading.active_count(),
        }}
        path = os.path.join(os.environ["SOAK_DIR"], f"rank{{rank_ctx.rank}}.jsonl")
        with open(path, "a") as handle:
            handle.write(json.dumps(sample) + "\\n")
"""


def _harness_temp_dirs() -> set[str]:
    return {path.name for path in Path(tempfile.gettempdir()).glob("distconform-*")}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["process", "thread"])
def test_ten_thousand_tests_on_one_warm_pool_stay_flat(pytester, monkeypatch, launcher):
    samples_dir = pytester.path / "samples"
    samples_dir.mkdir()
    monkeypatch.setenv("SOAK_DIR", str(samples_dir))
    pytester.makepyfile(test_soak=SOAK_MODULE)
    before = _harness_temp_dirs()
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-q", "--launcher", launcher, timeout=1200
    )
    wall = time.monotonic() - started
    result.assert_outcomes(passed=TESTS)
    assert _harness_temp_dirs() - before == set()
    for rank in (0, 1):
        samples = [json.loads(line) for line in (samples_dir / f"rank{rank}.jsonl").open()]
        assert len(samples) == TESTS // SAMPLE_EVERY + 1
        assert {s["pid"] for s in samples} == {samples[0]["pid"]}, "the pool was recycled"
        warm = samples[1]
        assert max(s["rss"] for s in samples[1:]) - warm["rss"] <= RSS_GROWTH_BOUND, samples
        assert max(s["fds"] for s in samples[1:]) <= warm["fds"], samples
        assert max(s["threads"] for s in samples[1:]) <= warm["threads"], samples
        per_test = {s["index"]: s["time"] for s in samples if s["index"] % SAMPLE_EVERY == 0}
        early = (per_test[1500] - per_test[500]) / 1000
        late = (per_test[TESTS - SAMPLE_EVERY] - per_test[TESTS - SAMPLE_EVERY - 1000]) / 1000
        assert late <= DRIFT_BOUND * early, (early, late)
    print(
        f"{launcher}: {TESTS} tests in {wall:.1f} s; rank 0 RSS {samples[1]['rss'] / 2**20:.1f}"
        f" -> {samples[-1]['rss'] / 2**20:.1f} MiB, fds {samples[1]['fds']} -> "
        f"{samples[-1]['fds']}, threads {samples[1]['threads']} -> {samples[-1]['threads']}, "
        f"per test {early * 1000:.2f} -> {late * 1000:.2f} ms"
    )
