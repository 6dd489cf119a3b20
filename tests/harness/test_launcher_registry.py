"""Launchers are implementations of one protocol, found in a registry: a new one is one module
that registers itself (``tests/harness/toy_launcher.py``), and a distributed test runs on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distconform.harness.controller.config import ConfigError
from distconform.harness.controller.launcher_registry import (
    BUILT_IN_LAUNCHERS,
    launcher_named,
    names,
)

ROOT = Path(__file__).resolve().parents[2]

TOY_TESTS = """
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.world_size(2)
def test_runs_on_the_toy_launchers_ranks(rank_ctx):
    assert os.environ.get("DISTCONFORM_TOY_LAUNCHER") == "1"
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2


@pytest.mark.world_size(2)
def test_fails_on_rank_1(rank_ctx):
    assert rank_ctx.rank != 1, "rank 1 disagrees"
"""


def test_the_built_in_launchers_answer_for_themselves():
    for name in BUILT_IN_LAUNCHERS:
        assert launcher_named(name).name == name
    assert launcher_named("process").limits_memory
    assert not launcher_named("thread").isolates_warnings
    assert not launcher_named("external").starts_ranks
    with pytest.raises(ConfigError, match="unknown launcher 'mpi': choose one of process"):
        launcher_named("mpi")
    assert set(BUILT_IN_LAUNCHERS) <= set(names())


def test_a_launcher_in_one_module_runs_a_distributed_test(tmp_path):
    (tmp_path / "test_on_toy.py").write_text(TOY_TESTS)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(tmp_path / "test_on_toy.py"),
            "-p",
            "tests.harness.toy_launcher",
            "--launcher",
            "toy",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "1 failed, 1 passed" in out, out[-4000:]
    assert "launcher toy" in out, out[-4000:]  # the session header names it
    assert "toy-run --ranks 2 python -m pytest" in out, out[-4000:]  # its reproduce command
