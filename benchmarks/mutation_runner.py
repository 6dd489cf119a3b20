"""Running the conformance suites against one mutant, in a private copy of the repository.

The checkout the benchmark starts from is never written: others may be working in it, and
a mutant left behind by a killed benchmark would break their runs. Instead:

- ``build_tree`` copies the repository (the working tree as ``git ls-files`` lists it, or a
  committed revision through ``git archive``) into a temporary directory;
- every run starts from that copy with ``PYTHONPATH`` naming it first. distconform is
  installed in editable mode, but its import hook (setuptools' ``__editable__`` finder)
  sits *after* the path finder on ``sys.meta_path``, so ``PYTHONPATH`` wins in the pytest
  process; the rank fork server is a fresh interpreter that the harness starts with the
  directory it imported ``harness`` from first on ``PYTHONPATH``, so the ranks import the
  copy too. ``verify_tree`` checks both before any mutant runs;
- ``Tree.mutated`` writes one mutant into the copy, deletes that module's cached bytecode
  (a same-size edit within the same second would otherwise run the stale ``.pyc``), and
  restores the file afterwards.

A stage is one ``python -m distconform conformance --impl reference`` run with ``-x``: the quick
stage is ``--quick`` (the items not marked slow), the full stage adds only the slow items
(``-m slow``), since the quick ones already passed against the same mutant: together they
are the full run. Each run has a wall-clock limit; a run over it is killed, with every
process it started, and counts as timed out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from mutation_ids import Mutant

PLUGIN = Path(__file__).resolve().parent / "mutation_plugin.py"
STAGES = ("quick", "full")
#: Run with a limit below this is not worth starting: the imports alone take that long.
MIN_STAGE_S = 20.0
_HUNG_WORDS = ("hung", "deadline")
_CANARY = '''"""Written by benchmarks/mutation.py: the copy is what the pytest process and the ranks
import, not the checkout distconform is installed from."""

import os

import pytest

import distconform.harness
import distconform.impl.reference

TREE = os.path.realpath(os.environ["MUTATION_BENCH_TREE"])


def _inside(path):
    return os.path.realpath(path).startswith(TREE + os.sep)


def test_the_pytest_process_imports_the_copy():
    assert _inside(distconform.impl.reference.__file__), distconform.impl.reference.__file__
    assert _inside(distconform.harness.__file__), distconform.harness.__file__


@pytest.mark.world_size(2)
def test_the_ranks_import_the_copy(rank_ctx):
    assert _inside(distconform.impl.reference.__file__), distconform.impl.reference.__file__
    assert _inside(distconform.harness.__file__), distconform.harness.__file__
'''


@dataclass
class StageResult:
    """What one stage of one mutant (or of the original) did."""

    status: str  # passed | failed | timeout | budget
    seconds: float
    exit_code: int | None = None
    failing_test: str | None = None
    message: str = ""
    hung: bool = False
    passed: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""


class Tree:
    """The private copy of the repository that mutants are written into."""

    def __init__(self, root: Path, work: Path) -> None:
        self.root = root
        self.work = work  # scratch: reports, records, order files, logs

    def env(self) -> dict[str, str]:
        plugin_dir = self.work / "plugin"
        plugin_dir.mkdir(exist_ok=True)
        shutil.copy2(PLUGIN, plugin_dir / PLUGIN.name)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.root), str(plugin_dir), *inherited]),
            "MUTATION_BENCH_TREE": str(self.root),
        }

    @contextlib.contextmanager
    def mutated(self, mutant: Mutant) -> Iterator[None]:
        path = self.root / mutant.path
        original = path.read_bytes()
        try:
            _write_source(path, mutant.mutation.apply(original))
            yield
        finally:
            _write_source(path, original)


def build_tree(repo: Path, revision: str | None, dest: Path) -> Path:
    """Copy ``repo`` into ``dest``: its working tree (``None``: tracked and untracked files
    that git does not ignore, as they are now) or a committed ``revision``. Reads the
    repository only: no index, worktree list or ref is written."""
    dest.mkdir(parents=True)
    if revision is None:
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout
        for name in filter(None, listed.decode().split("\0")):
            source = repo / name
            if source.is_file():  # listed but deleted in the working tree: skip
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target, follow_symlinks=False)
        return dest
    archive = subprocess.Popen(
        ["git", "-C", str(repo), "archive", "--format=tar", revision], stdout=subprocess.PIPE
    )
    assert archive.stdout is not None
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        tar.extractall(dest, filter="data")
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {revision} failed")
    return dest


def verify_tree(tree: Tree, timeout: float = 300.0) -> None:
    """Fail unless the pytest process and a rank both import the copy's packages."""
    canary = tree.root / "mutation_canary" / "test_canary.py"
    canary.parent.mkdir(exist_ok=True)
    canary.write_text(_CANARY)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(canary), "-q", "-p", "no:cacheprovider"],
        cwd=tree.root,
        env=tree.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    shutil.rmtree(canary.parent)
    if done.returncode != 0 or "2 passed" not in done.stdout:
        raise RuntimeError(
            "the private tree is not what the tests import; the benchmark would measure the "
            f"checkout instead:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )


def stage_command(stage: str, tree: Tree, deadline_s: float) -> list[str]:
    """The conformance run of one stage, stopping at the first failure."""
    selection = ["--quick"] if stage == "quick" else ["-m", "slow"]
    return [
        sys.executable,
        "-m",
        "distconform",
        "conformance",
        "--impl",
        "reference",
        *selection,
        "--out",
        str(tree.work / "report"),
        "-x",
        "-p",
        PLUGIN.stem,
        "--dist-deadline",
        f"{deadline_s:.0f}",
    ]


def run_stage(
    tree: Tree,
    stage: str,
    *,
    timeout: float,
    deadline_s: float,
    order: Sequence[str] = (),
) -> StageResult:
    """One stage against whatever the tree holds now; ``timeout`` bounds its wall clock."""
    record = tree.work / "record.json"
    order_file = tree.work / "order.txt"
    record.unlink(missing_ok=True)
    order_file.write_text("\n".join(order) + "\n" if order else "")
    log = tree.work / f"{stage}.log"
    env = {
        **tree.env(),
        "MUTATION_BENCH_ORDER": str(order_file),
        "MUTATION_BENCH_RECORD": str(record),
    }
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            stage_command(stage, tree, deadline_s),
            cwd=tree.root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            exit_code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
            exit_code = None
        except BaseException:
            # Ctrl-C reaches only our session: the run's processes would outlive us.
            kill_tree(process.pid)
            raise
    seconds = time.monotonic() - started
    tail = _tail(log)
    if exit_code is None:
        return StageResult("timeout", seconds, log_tail=tail)
    data: dict[str, Any] = json.loads(record.read_text()) if record.exists() else {}
    failure = data.get("failure") or {}
    result = StageResult(
        "passed" if exit_code == 0 else "failed",
        seconds,
        exit_code=exit_code,
        failing_test=failure.get("nodeid"),
        message=failure.get("message", ""),
        passed=data.get("passed", 0),
        skipped=data.get("skipped", {}),
        durations=data.get("durations", {}),
        log_tail=tail,
    )
    if result.status == "failed":
        first_line = result.message.splitlines()[0] if result.message else ""
        result.hung = any(word in first_line for word in _HUNG_WORDS)
        if result.failing_test is None:
            # No test failed, yet the run did: an error outside the tests (collection,
            # an import of the mutated module at configure time).
            result.failing_test = "<session>"
            result.message = tail
    return result


def kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process below it (the fork server and ranks run in sessions
    of their own, so a process-group kill would miss them), by their ids."""
    try:
        parent = psutil.Process(pid)
        processes = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


def kill_order(history: list[dict[str, Any]], mutant: Mutant) -> list[str]:
    """The tests most likely to kill ``mutant`` first: those that killed earlier mutants of
    the same function, then of the same file, then any; each group by how many it killed."""
    same_function: Counter[str] = Counter()
    same_file: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for record in history:
        test = record.get("killed_by")
        if not test or test == "<session>":
            continue
        anywhere[test] += 1
        if record.get("file") == mutant.path:
            same_file[test] += 1
            if record.get("qualname") == mutant.qualname:
                same_function[test] += 1
    return sorted(anywhere, key=lambda t: (-same_function[t], -same_file[t], -anywhere[t], t))


def _write_source(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    cached = Path(importlib.util.cache_from_source(str(path)))
    for pyc in cached.parent.glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def _tail(log: Path, limit: int = 4000) -> str:
    data = log.read_bytes()[-limit:] if log.exists() else b""
    return data.decode(errors="replace")
