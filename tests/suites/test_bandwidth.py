"""``python -m distconform bench-collectives``: the nccl-tests arithmetic, the size parsing, the
command line's usage errors, and one tiny real run per launcher.

Expected values are worked out by hand from nccl-tests' doc/PERFORMANCE.md (busbw factors
2(n-1)/n, (n-1)/n and 1; GB/s are 10**9 bytes per second), not from the module's own code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distconform.suites.backend.bandwidth import main
from distconform.suites.backend.bandwidth.arithmetic import (
    DEFAULT_OPS,
    Layout,
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    choose_iters,
    format_bytes,
    layout,
    layouts_for,
    parse_bytes,
    parse_ops,
    parse_world_sizes,
    size_ladder,
)
from distconform.suites.backend.bandwidth.measure import Target, make_records

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("op", "world_size", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_gather", 2, 0.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("all_to_all", 2, 0.5),
        ("all_to_all", 8, 0.875),
        ("broadcast", 4, 1.0),
        ("reduce", 8, 1.0),
    ],
)
def test_bus_factor_is_nccl_tests_correction(op, world_size, factor):
    assert bus_factor(op, world_size) == pytest.approx(factor)


def test_bandwidths_in_gigabytes_per_second():
    # 16 MiB = 16_777_216 B in 10 ms: 1.6777216 GB/s.
    assert algbw_gbps(16_777_216, 0.01) == pytest.approx(1.6777216)
    # all_reduce at ws 4: times 2*3/4 = 1.5.
    assert busbw_gbps("all_reduce", 16_777_216, 0.01, 4) == pytest.approx(2.5165824)
    # all_gather at ws 8 of 1 GB in 0.5 s: 2 GB/s, times 7/8.
    assert busbw_gbps("all_gather", 10**9, 0.5, 8) == pytest.approx(1.75)
    # broadcast: busbw is algbw.
    assert busbw_gbps("broadcast", 4096, 1e-6, 4) == pytest.approx(4.096)


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_bandwidth_needs_a_positive_time(seconds):
    with pytest.raises(ValueError, match="positive"):
        algbw_gbps(1024, seconds)


def test_unknown_op_has_no_bus_factor():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8", 8),
        ("16B", 16),
        ("4K", 4096),
        ("4k", 4096),
        ("1.5K", 1536),
        ("64M", 67_108_864),
        ("16MiB", 16_777_216),
        (" 2 g ", 2_147_483_648),
        ("1GiB", 1_073_741_824),
    ],
)
def test_parse_bytes_reads_binary_multiples(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "cannot read"),
        ("M", "cannot read"),
        ("-1", "cannot read"),
        ("0", "positive"),
        ("1.3", "whole number"),
        ("64MB", "ambiguous"),
        ("4T", "unknown unit"),
    ],
)
def test_parse_bytes_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(text)


def test_format_bytes_is_exact():
    assert format_bytes(16) == "16 B"
    assert format_bytes(4096) == "4 KiB"
    assert format_bytes(1536) == "1536 B"
    assert format_bytes(16_777_216) == "16 MiB"


def test_size_ladder_includes_max_when_reached():
    assert size_ladder(16, 16 * 2**20, 4) == [
        16,
        64,
        256,
        1024,
        4096,
        16384,
        65536,
        262144,
        1048576,
        4194304,
        16777216,
    ]
    assert size_ladder(8, 16 * 2**20, 4)[-1] == 8 * 2**20  # 32 MiB would pass the max
    assert size_ladder(8, 8, 2) == [8]


@pytest.mark.parametrize(("low", "high", "factor"), [(64, 8, 2), (0, 8, 2), (8, 64, 1)])
def test_size_ladder_refuses(low, high, factor):
    with pytest.raises(ValueError):
        size_ladder(low, high, factor)


@pytest.mark.parametrize(
    ("op", "size", "world_size", "itemsize", "expected"),
    [
        # S is the full buffer: all_gather's output, reduce_scatter's input.
        ("all_gather", 16 * 2**20, 4, 4, Layout(1_048_576, 4_194_304, 16_777_216)),
        ("reduce_scatter", 16 * 2**20, 4, 4, Layout(4_194_304, 1_048_576, 16_777_216)),
        ("all_to_all", 4096, 2, 4, Layout(1024, 1024, 4096)),
        ("all_reduce", 4096, 4, 2, Layout(2048, 2048, 4096)),
        ("broadcast", 64, 8, 8, Layout(8, 8, 64)),
        # Rounded down to whole elements per rank: 100 B over 3 ranks of float32 is
        # 8 elements each, 96 B in all.
        ("all_to_all", 100, 3, 4, Layout(24, 24, 96)),
        ("all_reduce", 10, 2, 4, Layout(2, 2, 8)),
        # ...but at least one element per rank: 8 B at ws 4 becomes 16 B.
        ("reduce_scatter", 8, 4, 4, Layout(4, 1, 16)),
        ("all_reduce", 1, 2, 4, Layout(1, 1, 4)),
    ],
)
def test_layout(op, size, world_size, itemsize, expected):
    assert layout(op, size, world_size, itemsize) == expected


def test_layouts_that_round_alike_are_measured_once():
    shapes = layouts_for("all_gather", [4, 8, 16, 64], 4, 4)
    assert [shape.size_bytes for shape in shapes] == [16, 64]


@pytest.mark.parametrize(
    ("max_iters", "estimate", "budget", "expected"),
    [
        (20, None, 0.5, 20),  # no warm-up, no estimate
        (20, 0.001, 0.5, 20),  # 500 would fit
        (20, 0.05, 0.5, 10),
        (20, 0.3, 0.5, 5),  # 1 fits, the floor is 5
        (3, 1.0, 0.5, 3),  # asked for fewer than the floor
        (20, 0.05, 0.0, 20),  # no budget
    ],
)
def test_choose_iters(max_iters, estimate, budget, expected):
    assert choose_iters(max_iters, estimate, budget) == expected


def test_parse_world_sizes_and_ops():
    assert parse_world_sizes("2,4") == (2, 4)
    assert parse_world_sizes("4, 2,4") == (4, 2)
    assert parse_world_sizes("1") == (1,)  # the local path, as nccl-tests on one GPU
    assert parse_ops("all") == DEFAULT_OPS
    assert parse_ops("broadcast,all_reduce,broadcast") == ("broadcast", "all_reduce")
    for bad in ("0", "2,x", ""):
        with pytest.raises(ValueError):
            parse_world_sizes(bad)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        parse_ops("allreduce")


def test_records_take_the_slowest_rank():
    target = Target("gloo", "process", "cpu")
    shapes = [Layout(250_000, 250_000, 1_000_000)]
    per_rank = [
        [{"size_bytes": 1_000_000, "iters": 7, "mean_s": 0.001}],
        [{"size_bytes": 1_000_000, "iters": 7, "mean_s": 0.002}],
        [{"size_bytes": 1_000_000, "iters": 7, "mean_s": 0.0015}],
        [{"size_bytes": 1_000_000, "iters": 7, "mean_s": 0.0005}],
    ]
    (record,) = make_records(target, "all_reduce", 4, shapes, "float32", 5, per_rank)
    assert record.time_us == pytest.approx(2000.0)
    assert record.algbw_gbps == pytest.approx(0.5)  # 1e6 B / 2 ms
    assert record.busbw_gbps == pytest.approx(0.75)  # times 2*3/4
    assert record.iters == 7
    assert record.rank_time_us == pytest.approx([1000.0, 2000.0, 1500.0, 500.0])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-bytes", "64MB"], "ambiguous"),
        (["--min-bytes", "1M", "--max-bytes", "1K"], "min-bytes <= max-bytes"),
        (["--world-sizes", "0"], "at least one rank"),
        (["--ops", "allreduce"], "unknown collective"),
        (["--dtype", "float8"], "unknown dtype"),
        (["--backend", "nosuchbackend"], "unknown backend 'nosuchbackend'"),
        (["--launcher", "thread", "--backend", "gloo"], "--launcher thread"),
        (["--backend-plugin", "no_such_module_xyz"], "cannot import it"),
        (["--json", "/no/such/folder/out.json"], "does not exist"),
    ],
)
def test_usage_errors_exit_2_without_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from distconform.suites.backend.bandwidth import main\n"
        "assert main(['--help']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "--no-peer" in done.stdout


@pytest.mark.parametrize(
    ("argv", "backends"),
    [
        (["--backend", "gloo"], {"gloo"}),
        (["--launcher", "thread", "--backend", "threaded"], {"threaded", "gloo"}),
    ],
    ids=["gloo", "threaded-with-gloo-peer"],
)
def test_end_to_end(argv, backends, tmp_path, capsys):
    out = tmp_path / "bench.json"
    flight_before = os.environ.get("DISTCONFORM_COMM_FLIGHT")
    common = ["--world-sizes", "2", "--min-bytes", "16", "--max-bytes", "256"]
    common += ["--iters", "2", "--warmup", "1", "--json", str(out)]
    assert main(argv + common) == 0
    assert os.environ.get("DISTCONFORM_COMM_FLIGHT") == flight_before
    document = json.loads(out.read_text())
    assert document["environment"]["backend"] == argv[-1]
    assert document["failures"] == []
    records = document["records"]
    # 5 ops x 3 sizes (16, 64, 256 B) per backend.
    assert {r["backend"] for r in records} == backends
    assert len(records) == 15 * len(backends)
    assert {r["op"] for r in records} == set(DEFAULT_OPS)
    for record in records:
        assert record["world_size"] == 2
        assert record["size_bytes"] in (16, 64, 256)
        assert record["time_us"] > 0
        assert record["algbw_gbps"] > 0
        assert record["busbw_gbps"] > 0
        assert len(record["rank_time_us"]) == 2
    table = capsys.readouterr().out
    assert "busbw" in table
    assert ("ratio" in table) == (len(backends) == 2)
    assert "all_to_all" in table
