"""One report from a torchrun or Slurm world: rank 0 prints it, the others say where theirs is.

Every rank runs the same pytest session, and every rank learns the same verdicts, so the
full report on each console would be the same story N times, interleaved. Before pytest
builds its terminal, a non-zero rank points ``sys.stdout`` at a file, which the terminal
keeps for the whole session (its pytest summary, its own failures' sections); once the
terminal exists, the real stdout comes back and the rank prints one line naming the file.
A JUnit file asked for with ``--junitxml`` is written by rank 0; the others write theirs
next to their report instead of over rank 0's.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TextIO

import pytest

from distconform.harness.controller.external.rank import ExternalRank

DIR_ENV = "DISTCONFORM_RANK_REPORT_DIR"


def report_file(me: ExternalRank) -> Path:
    """Where a non-zero rank's pytest report goes: ``$DISTCONFORM_RANK_REPORT_DIR`` or a
    per-job directory in the temp dir, one file per rank."""
    base = os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"distconform-{os.getuid()}"
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in me.run_id) or "run"
    return Path(base) / safe_id / f"rank{me.rank}.txt"


class ReportDiversion:
    """Sends a non-zero rank's pytest terminal to its file."""

    def __init__(self, me: ExternalRank) -> None:
        self.me = me
        self.path = report_file(me)
        self._console: TextIO | None = None

    def start(self) -> None:
        """Before pytest's terminal is built: it will write to the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._console = sys.stdout
        sys.stdout = open(self.path, "w", buffering=1)  # noqa: SIM115 - the session's file

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        if getattr(config.option, "xmlpath", None):
            config.option.xmlpath = str(self.path.with_suffix(".junit.xml"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.terminal_built()

    def terminal_built(self) -> None:
        """Give the console back and tell the user, in one line, where the report went."""
        if self._console is None:
            return
        sys.stdout, self._console = self._console, None
        print(
            f"distconform: rank {self.me.rank} of {self.me.world_size} ({self.me.starter}): "
            f"rank 0 prints the report; this rank's pytest output is in {self.path}",
            flush=True,
        )


def divert_unless_rank_0(config: pytest.Config, me: ExternalRank) -> ReportDiversion | None:
    """On a non-zero rank: send its report to its file, from now to the session's end."""
    if me.rank == 0:
        return None
    diversion = ReportDiversion(me)
    diversion.start()
    config.pluginmanager.register(diversion, "distconform-rank-report")
    return diversion
