"""Which rank thread ended the thread host process, when one of them calls ``os._exit``.

Rank threads share the host process, so a rank that exits it takes every rank with it, and
the exit status alone cannot say whose call it was. The host wraps ``os._exit`` to write the
calling rank into a note beside its stack file before exiting; the parent reads the note
after the host died. A death that leaves no note (a signal, an exit from a thread that is
no rank's) is reported as the host's, with its culprit unknown, never pinned on a rank.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from distconform.harness.shared.rank_context import get_rank_context

NOTE_NAME = "host-exit.txt"


def note_path(stack_path: str | Path) -> Path:
    return Path(stack_path).with_name(NOTE_NAME)


def record_rank_exits(path: Path) -> None:
    """In the host: make ``os._exit`` note which rank called it (before exiting as asked)."""
    real_exit = os._exit

    def exit_noting_the_rank(status: int) -> None:
        try:
            rank = get_rank_context().rank
        except RuntimeError:  # not a rank thread: the culprit stays unknown
            rank = None
        if rank is not None:
            with contextlib.suppress(OSError):  # exiting matters more than the note
                path.write_text(f"{rank} {status}\n")
        real_exit(status)

    os._exit = exit_noting_the_rank


def read_exit_note(path: Path) -> tuple[int, int] | None:
    """In the parent, after the host died: (rank, status) when a rank called ``os._exit``."""
    try:
        rank, status = path.read_text().split()
        return int(rank), int(status)
    except (OSError, ValueError):
        return None
