"""Per-rank capture of what rank threads print.

Rank threads share ``sys.stdout``/``sys.stderr``. During a run with capture on, both are
replaced by a router: a write from a rank thread goes to that rank's buffer (stdout and
stderr merged in order, as a rank process's pipe would), a write from any other thread
goes to the stream that was there before. Loggers that kept a reference to the original
stream (c10d's own warnings) are not routed.
"""

from __future__ import annotations

import io
import sys
from typing import Any, TextIO

from distconform.harness.threads.world import current_rank


class _RankRouter(io.TextIOBase):
    def __init__(self, fallback: TextIO, buffers: list[io.StringIO]) -> None:
        self._fallback = fallback
        self._buffers = buffers

    def write(self, text: str) -> int:
        here = current_rank()
        if here is None:
            return self._fallback.write(text)
        return self._buffers[here[1]].write(text)

    def flush(self) -> None:
        if current_rank() is None:
            self._fallback.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._fallback, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)


class RankOutputCapture:
    """Context manager: route rank threads' prints into ``outputs[rank]``."""

    def __init__(self, world_size: int) -> None:
        self._buffers = [io.StringIO() for _ in range(world_size)]
        self._saved: tuple[TextIO, TextIO] | None = None
        self._routers: tuple[_RankRouter, _RankRouter] | None = None

    def __enter__(self) -> RankOutputCapture:
        self._saved = (sys.stdout, sys.stderr)
        self._routers = (
            _RankRouter(sys.stdout, self._buffers),
            _RankRouter(sys.stderr, self._buffers),
        )
        sys.stdout, sys.stderr = self._routers  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None and self._routers is not None
        # Put the old streams back only where ours are still installed: someone who
        # replaced them meanwhile (pytest's capture) keeps theirs.
        if sys.stdout is self._routers[0]:
            sys.stdout = self._saved[0]
        if sys.stderr is self._routers[1]:
            sys.stderr = self._saved[1]

    def output(self, rank: int) -> str:
        return self._buffers[rank].getvalue()
