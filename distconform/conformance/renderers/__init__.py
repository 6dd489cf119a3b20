"""The conformance report's formats: one report model, one module per format.

Every format renders a :class:`distconform.conformance.report.ConformanceReport` through the same
interface, a :class:`~distconform.conformance.renderers.format.Format`: a name, the file it is
written to under ``--conformance-out`` (none for the terminal) and ``render(report) -> str``.
The report is the same type whether the run just built it or it was read back from its
``conformance.json``, so every format renders both alike.

Reading order: :mod:`.format` (the interface, and writing the files), :mod:`.text` (the
lines that Markdown and the terminal share), then one module per format: :mod:`.json_document`,
:mod:`.markdown`, :mod:`.html`, :mod:`.junit`, :mod:`.terminal`. A new format is one more
module and its entry in :data:`FILE_FORMATS`.
"""

from __future__ import annotations

from distconform.conformance.renderers import html, json_document, junit, markdown
from distconform.conformance.renderers.format import Format

#: The files a run writes under ``--conformance-out``, in the order they are written.
FILE_FORMATS: tuple[Format, ...] = (
    json_document.FORMAT,
    markdown.FORMAT,
    html.FORMAT,
    junit.FORMAT,
)
