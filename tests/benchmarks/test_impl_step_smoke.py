"""The reference-vs-FSDP2 step benchmark still runs end to end, on the smallest case.

Times and memory are not judged here (a busy CI machine makes them meaningless); what is
checked is that every measurement is present and finite, and the two things that do not
depend on load: both implementations move exactly the minimum bytes per step, and the
minimum itself equals a count made by hand for ``MLPStack(256)``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import impl_step

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "impl_step.py"

# MLPStack(256): MLPs with hidden sizes 768, 1024, 768; each is two Linear layers with biases.
MLP_GROUP_ELEMENTS = [2 * 256 * h + h + 256 for h in (768, 1024, 768)]


def test_minimum_bytes_match_a_hand_count() -> None:
    from distconform.suites.models import MLPStack

    model = MLPStack(256)
    groups = impl_step.parameter_groups(model, list(model))
    assert [sum(math.prod(s) for s in g) for g in groups] == MLP_GROUP_ELEMENTS
    # ws 2, fp32: an all-gather brings in the other half of every group, a reduce-scatter
    # sends it; nothing is padded (every dim 0 is even); raf True gathers twice.
    half = sum(MLP_GROUP_ELEMENTS) * 4 // 2
    expected = impl_step.expected_traffic(groups, 2, raf=True)
    assert expected["all_gather_bytes"] == 2 * half
    assert expected["reduce_scatter_bytes"] == half
    assert expected["all_reduce_bytes"] == 0
    assert expected["all_gather_calls"] == 6 and expected["reduce_scatter_calls"] == 3
    # ws 4: every dim 0 is a multiple of 4 as well; a quarter of each group stays home.
    quarter = sum(MLP_GROUP_ELEMENTS) * 4 // 4
    assert impl_step.expected_traffic(groups, 4, raf=False)["all_gather_bytes"] == 3 * quarter


def test_bootstrap_interval_brackets_the_median() -> None:
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 1.2, 1.0]
    low, high = impl_step.bootstrap_median_interval(values, resamples=2000)
    assert low <= 1.0 <= high
    assert min(values) <= low < high <= max(values)
    assert impl_step.bootstrap_median_interval([2.0] * 7, resamples=100) == (2.0, 2.0)


@pytest.mark.slow  # runs the benchmark end to end (11 s): nightly
def test_benchmark_runs_and_reports_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "impl_step.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--world-sizes",
            "2",
            "--models",
            "mlp",
            "--raf",
            "true",
            "--pairs",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--warmup-per-run",
            "0",
            "--mem-steps",
            "1",
            "--mem-repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "| 2 | mlp | True | reference / torch |" in completed.stdout
    assert "| 2 | mlp | True | torch / torch (A/A) |" in completed.stdout
    (row,) = json.loads(out.read_text())["rows"]
    for arm in impl_step.ARMS:
        assert len(row["times_s"][arm]) == 2
        assert all(math.isfinite(t) and t > 0 for t in row["times_s"][arm])
    for key in ("ratio", "aa_ratio"):
        low, high = row[key]["ci95"]
        assert 0 < low <= row[key]["median"] <= high
    for impl in ("reference", "torch"):
        assert row["peak_rss_above_baseline_bytes"][impl] > 0
        traffic = row["traffic"][impl]
        assert traffic["ratio"] == 1.0, traffic
        for rank_traffic in traffic["per_rank"]:
            assert rank_traffic["all_gather_calls"] == 6
            assert rank_traffic["reduce_scatter_calls"] == 3
            assert rank_traffic["all_reduce_calls"] == 0
        # Every dim 0 is even at ws 2: the shards are exactly half the parameters.
        assert row["sharded_storage_bytes"][impl] == row["ideal_shard_bytes"]
    assert row["ideal_shard_bytes"] == sum(MLP_GROUP_ELEMENTS) * 4 // 2
