"""Bad input is rejected before anything is spawned, with a message that says what to do."""

from __future__ import annotations

import pytest

from distconform.harness import ConfigError, launch
from distconform.harness.controller.config import (
    check_device_type,
    check_world_size,
    default_threads_per_rank,
    parse_world_sizes,
)
from distconform.harness.controller.deadline import pg_timeout_for
from distconform.harness.controller.launcher_registry import launcher_named, resolve_backend
from tests.harness import rank_bodies


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: launcher_named("mpi"), "unknown launcher 'mpi': choose one of process, thread"),
        (lambda: check_world_size(0), "world size must be a positive integer, got 0"),
        (lambda: check_world_size(-2), "got -2"),
        (lambda: check_world_size(True), "got True"),
        (lambda: check_device_type("cuda:1"), "--device takes a device type"),
        (lambda: check_device_type("toaster"), "unknown device 'toaster'"),
        (lambda: resolve_backend("process", "carrier-pigeon", "cpu"), "unknown backend"),
        (lambda: resolve_backend("process", "nccl", "cpu"), "does not support device 'cpu'"),
        (lambda: resolve_backend("process", "threaded", "cpu"), "use --launcher thread"),
        (lambda: resolve_backend("thread", "gloo", "cpu"), "always uses the 'threaded'"),
        (lambda: resolve_backend("thread", None, "cuda"), "runs on the CPU only"),
        (lambda: parse_world_sizes("2,x"), "comma-separated integers"),
        (lambda: parse_world_sizes("2,0"), "got 0"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(call, message):
    with pytest.raises(ConfigError, match=None) as excinfo:
        call()
    assert message in str(excinfo.value)


def test_defaults_resolve_to_gloo_and_split_cores():
    assert resolve_backend("process", None, "cpu") == "gloo"
    assert resolve_backend("process", "auto", "cpu") == "gloo"
    assert resolve_backend("thread", None, "cpu") == "threaded"
    assert parse_world_sizes("2, 4") == (2, 4)
    assert default_threads_per_rank(64) == 1


def test_collectives_time_out_before_the_deadline():
    for deadline in (1.0, 5.0, 30.0, 300.0):
        assert pg_timeout_for(deadline) < deadline or deadline <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world size must be a positive integer"),
        ({"world_size": 2, "device": "cuda"}, "2 ranks need 2 cuda devices, this machine has 0"),
        ({"world_size": 2, "launcher": "bogus"}, "unknown launcher"),
        ({"world_size": 2, "deadline": 0}, "deadline must be positive"),
    ],
)
def test_launch_rejects_bad_input_without_spawning(monkeypatch, kwargs, message):
    from distconform.harness.controller.process.pool import ProcessPool

    def refuse(*args, **kw):
        raise AssertionError("spawned despite bad input")

    monkeypatch.setattr(ProcessPool, "_spawn", refuse)
    monkeypatch.setenv("DISTCONFORM_FAKE_DEVICE_COUNT", "0")  # "has 0" on a GPU machine too
    with pytest.raises(ConfigError) as excinfo:
        launch(rank_bodies.all_reduce_rank_sum, **kwargs)
    assert message in str(excinfo.value)


def test_launch_cannot_start_an_external_world():
    with pytest.raises(ConfigError, match="--launcher external"):
        launch(rank_bodies.all_reduce_rank_sum, 2, launcher="external")
