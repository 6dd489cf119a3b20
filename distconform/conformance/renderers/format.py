"""The one interface every format of the conformance report implements, and writing them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from distconform.conformance.report import ConformanceReport


@dataclass(frozen=True)
class Format:
    """One format of the conformance report: a name, the file it is written to under
    ``--conformance-out`` (None: printed, not written), and ``render(report) -> str``."""

    name: str
    #: The file it is written to under ``--conformance-out``; None: not written (terminal).
    file_name: str | None
    render: Callable[[ConformanceReport], str]


def write_files(report: ConformanceReport, out_dir: Path, formats: Iterable[Format]) -> None:
    """Write each format's file into ``out_dir``, each whole or not at all."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        if fmt.file_name is not None:
            replace_file(out_dir / fmt.file_name, fmt.render(report))


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: the report is rewritten during the
    run, and a run killed mid-write must leave the previous version, not half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
