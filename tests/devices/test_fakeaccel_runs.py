"""The harness and the suites on the fake accelerator, as a user runs them.

Each test is one command a user types (``pytest --device fakeaccel``, ``python -m distconform
conformance --device fakeaccel``), run as a child process, and checks what its report
says. They are the default run's proof that the accelerator paths work: device placement,
one device per rank and leases, ranks sharing one device, a Python backend on a device,
and the post-optim event cases, which the CPU cannot run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from distconform.harness.controller.leasing import LEASE_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _conformance(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    completed = _run(
        ["-m", "distconform", "conformance", "--quick", "--device", "fakeaccel",
         "--out", str(tmp_path), *args],
        env=env,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-2000:]
    return json.loads((tmp_path / "conformance.json").read_text())


def _statuses(report: dict, fragment: str) -> set[str]:
    return {test["status"] for test in report["tests"] if fragment in test["nodeid"]}


def test_reference_conformance_on_the_fake_device_runs_what_the_cpu_cannot(tmp_path):
    """The quick cases only an accelerator runs (the post-optim events), and those that move
    tensors between host and device (CPU offload, with its training parity): all pass on
    the fake device. The whole quick run there is the slow test below."""
    report = _conformance(tmp_path, "--impl", "reference", "-k", "post_optim_event or offload")
    assert report["summary"]["counts"]["FAIL"] == 0
    assert _statuses(report, "test_post_optim_event.py") == {"PASS"}
    assert _statuses(report, "test_cpu_offload_training_parity") == {"PASS"}
    assert report["summary"]["counts"]["PASS"] >= 8


@pytest.mark.slow
def test_reference_conformance_quick_on_the_fake_device_runs_the_event_cases(tmp_path):
    report = _conformance(tmp_path, "--impl", "reference")
    assert report["summary"]["counts"]["FAIL"] == 0
    assert _statuses(report, "test_post_optim_event.py") == {"PASS"}
    assert report["summary"]["counts"]["PASS"] >= 85


def _junit_outcomes(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name", "")] = kinds[0] if kinds else "passed"
    return outcomes


def test_the_accelerator_tests_pass_one_device_per_rank(tmp_path):
    junit = tmp_path / "junit.xml"
    completed = _run(
        ["-m", "pytest", "tests/accelerator/test_on_device.py", "--device", "fakeaccel",
         "-p", "no:cacheprovider", "-q", "--junitxml", str(junit)],
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-4000:]
    outcomes = _junit_outcomes(junit)
    assert set(outcomes.values()) == {"passed"}, outcomes
    assert "test_reference_fully_shard_trains_on_the_device[ws2]" in outcomes


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_the_accelerator_tests_pass_with_ranks_sharing_one_device(tmp_path):
    junit = tmp_path / "junit.xml"
    completed = _run(
        ["-m", "pytest", "tests/accelerator/test_on_device.py", "--device", "fakeaccel",
         "--dist-share-devices", "--world-sizes", "2", "-p", "no:cacheprovider",
         "--junitxml", str(junit)],
        env={"FAKEACCEL_DEVICE_COUNT": "1"},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-4000:]
    outcomes = _junit_outcomes(junit)
    skipped = {name for name, outcome in outcomes.items() if outcome == "skipped"}
    assert skipped == {"test_ranks_see_only_their_leased_devices[ws2]"}, outcomes
    assert "ranks share the 1 fakeaccel device(s) round-robin" in completed.stdout


LEASE_PROBE = """
import json, os, pytest, torch

@pytest.mark.world_size(2)
@pytest.mark.parametrize("worker_test", range(4))
def test_record_the_leased_devices(rank_ctx, worker_test):
    # Each rank writes which machine devices its process may see while the test runs.
    record = os.environ["LEASE_RECORD"]
    line = json.dumps([os.getpid(), os.environ["FAKEACCEL_VISIBLE_DEVICES"]])
    with open(record, "a") as sink:
        sink.write(line + "\\n")
"""


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_parallel_workers_lease_disjoint_fake_devices(tmp_path):
    (tmp_path / "test_leases.py").write_text(LEASE_PROBE)
    record = tmp_path / "record.jsonl"
    completed = _run(
        ["-m", "pytest", str(tmp_path / "test_leases.py"), "-n", "2", "--device", "fakeaccel",
         "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path)],
        # Leases of its own: other runs on this machine lease fake devices from the same
        # default directory.
        env={
            "FAKEACCEL_DEVICE_COUNT": "4",
            "LEASE_RECORD": str(record),
            LEASE_DIR_ENV: str(tmp_path / "leases"),
        },
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-4000:]
    visible_by_pid = dict(json.loads(line) for line in record.read_text().splitlines())
    pools = {tuple(sorted(v.split(","))) for v in visible_by_pid.values()}
    # Two workers, each with one warm pool of 2 ranks holding its lease for the whole
    # session: two pools of 2 devices, no device in both.
    assert len(pools) == 2 and all(len(pool) == 2 for pool in pools), pools
    devices = [device for pool in pools for device in pool]
    assert len(devices) == len(set(devices)), pools


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "torch"])
def test_conformance_quick_at_ws_2_and_4_on_one_shared_fake_device(tmp_path, implementation):
    report = _conformance(
        tmp_path,
        "--impl", implementation, "--dist-share-devices", "--world-sizes", "2,4",
        env={"FAKEACCEL_DEVICE_COUNT": "1"},
    )  # fmt: skip
    assert report["summary"]["counts"]["FAIL"] == 0
    passed_at = {t["world_size"] for t in report["tests"] if t["status"] == "PASS"}
    assert {2, 4} <= passed_at <= {2, 4, None}  # None: the property case draws its own


MARKERS_ON_A_DEVICE = """
import pytest, torch

@pytest.mark.world_size(2)
@pytest.mark.requires_devices(4)
def test_needs_four_devices(rank_ctx):
    pass

@pytest.mark.world_size(1)
@pytest.mark.requires_accelerator
def test_runs_on_an_accelerator(rank_ctx):
    assert rank_ctx.device.type == "fakeaccel"

@pytest.mark.world_size(1)
@pytest.mark.device_audit
def test_creates_a_tensor_without_a_device(rank_ctx):
    return torch.randn(4)

@pytest.mark.world_size(1)
@pytest.mark.device_audit
def test_creates_its_tensor_on_the_rank_device(rank_ctx):
    return torch.randn(4, device=rank_ctx.device)
"""


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_markers_and_the_device_audit_on_the_fake_device(tmp_path):
    (tmp_path / "test_markers.py").write_text(MARKERS_ON_A_DEVICE)
    junit = tmp_path / "junit.xml"
    completed = _run(
        ["-m", "pytest", str(tmp_path / "test_markers.py"), "--device", "fakeaccel",
         "-p", "no:cacheprovider", "-rs", "--rootdir", str(tmp_path), "--junitxml", str(junit)],
        env={"FAKEACCEL_DEVICE_COUNT": "2"},
    )  # fmt: skip
    outcomes = _junit_outcomes(junit)
    assert outcomes == {
        "test_needs_four_devices[ws2]": "skipped",
        "test_runs_on_an_accelerator[ws1]": "passed",
        "test_creates_a_tensor_without_a_device[ws1]": "failure",
        "test_creates_its_tensor_on_the_rank_device[ws1]": "passed",
    }, completed.stdout[-4000:]
    assert "needs 4 fakeaccel device(s), this machine has 2" in completed.stdout
    assert "test_markers.py:" in completed.stdout and "randn" in completed.stdout
