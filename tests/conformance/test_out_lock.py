"""One conformance run per report directory: a second run is refused in one line naming the
first, a stale lock is taken over, the lock goes with the run however it ends (SIGINT
included), pytest-xdist workers never take it, and a refused run leaves no directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distconform.conformance.out_lock import LOCK_NAME, OutputLock, read_holder

SLOW_TEST = """
import pathlib, time

def test_waits_for_the_signal():
    pathlib.Path("started").write_text("")
    for _ in range(600):
        if pathlib.Path("stop").exists():
            break
        time.sleep(0.1)
"""


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    return int(finished.stdout)


def test_a_second_lock_on_the_directory_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "report"
    first = OutputLock(out, "--conformance-out")
    first.acquire()
    holder = read_holder(out / LOCK_NAME)
    assert holder is not None and holder.pid == os.getpid() and holder.alive()
    with pytest.raises(pytest.UsageError) as refused:
        OutputLock(out, "--conformance-out").acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert f"is in use by the conformance run of process {os.getpid()}" in message
    assert "--out DIR" in message
    first.release()
    assert not out.exists(), "a directory the run created and left empty goes with it"


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    gone = dead_pid()
    (out / LOCK_NAME).write_text(json.dumps(
        {"pid": gone, "started": "2026-11-28T00:00:00Z", "command": "killed -9"}
    ))  # fmt: skip
    lock = OutputLock(out, "--conformance-out")
    lock.acquire()
    assert lock.note is not None and f"stale lock of process {gone}" in lock.note
    assert read_holder(out / LOCK_NAME).pid == os.getpid()
    lock.release()
    assert out.exists(), "a directory that was there before stays"
    assert not (out / LOCK_NAME).exists()


def test_a_reused_pid_with_another_start_time_is_stale(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps(
        {"pid": os.getpid(), "started": "x", "command": "y", "process_start": "-1"}
    ))  # fmt: skip
    lock = OutputLock(out, "--conformance-out")
    lock.acquire()
    assert lock.note is not None
    lock.release()


def test_two_runs_into_one_directory_one_is_refused(pytester):
    pytester.makepyfile(test_slow=SLOW_TEST)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--conformance-out", "out"]
    first = subprocess.Popen(command, cwd=pytester.path, stdout=subprocess.PIPE, text=True)
    try:
        wait_for(pytester.path / "started")
        second = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True)
        assert second.returncode == pytest.ExitCode.USAGE_ERROR, second.stdout + second.stderr
        assert f"is in use by the conformance run of process {first.pid}" in second.stderr
        (pytester.path / "stop").write_text("")
        output, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, output
    assert "report written to out" in output
    assert json.loads((pytester.path / "out" / "conformance.json").read_text())["complete"]
    assert not (pytester.path / "out" / LOCK_NAME).exists()


def test_sigint_while_the_lock_is_held_releases_it(pytester):
    pytester.makepyfile(test_slow=SLOW_TEST)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--conformance-out", "out"]
    run = subprocess.Popen(
        command,
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        text=True,
        # A run started in the background inherits SIGINT ignored; Ctrl-C is what is tested.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(pytester.path / "started")
        assert (pytester.path / "out" / LOCK_NAME).exists()
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == pytest.ExitCode.INTERRUPTED
    assert not (pytester.path / "out" / LOCK_NAME).exists()
    assert json.loads((pytester.path / "out" / "conformance.json").read_text())["complete"] is False


def test_xdist_workers_leave_the_lock_to_the_controller(pytester):
    pytester.makepyfile(test_two="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2",
                                           "--conformance-out", "out")  # fmt: skip
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    assert (
        json.loads((pytester.path / "out" / "conformance.json").read_text())["summary"]["counts"][
            "PASS"
        ]
        == 2
    )
    assert not (pytester.path / "out" / LOCK_NAME).exists()


def test_a_run_refused_on_its_command_line_creates_no_directory(pytester):
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--conformance-out",
                                           "out/deeper", "--impl", "nonexistent")  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert not (pytester.path / "out").exists()


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
