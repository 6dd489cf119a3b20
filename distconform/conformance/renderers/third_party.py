"""Report formats other packages add: entry points of :data:`REPORT_FORMATS_GROUP`.

A package that installs ``[project.entry-points."distconform.report_formats"]``
``sarif = "acme_reports:SARIF"`` (a :class:`~distconform.conformance.renderers.format.Format`)
gets ``sarif``'s file written by every conformance run with ``--conformance-out``, beside
the bundled formats. A format that names a bundled one's file, or fails to load, is an
error at configure, not a silent omission.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from distconform.conformance.renderers.format import Format

REPORT_FORMATS_GROUP = "distconform.report_formats"


class ReportFormatError(ValueError):
    """An installed report format that cannot be used."""


def installed_formats(bundled: tuple[Format, ...] = ()) -> tuple[Format, ...]:
    """The formats installed packages register, sorted by entry-point name.

    Raises:
        ReportFormatError: when an entry point does not load to a ``Format``, or its file
            name is one a bundled or another installed format writes.
    """
    taken = {fmt.file_name: fmt.name for fmt in bundled if fmt.file_name}
    found = []
    for entry in sorted(entry_points(group=REPORT_FORMATS_GROUP), key=lambda e: e.name):
        try:
            fmt = entry.load()
        except Exception as exc:  # a broken plug-in: say which, and why
            raise ReportFormatError(
                f"report format {entry.name!r} ({entry.value}) cannot be loaded: {exc}"
            ) from exc
        if not isinstance(fmt, Format):
            raise ReportFormatError(
                f"report format {entry.name!r} ({entry.value}) is a {type(fmt).__name__}, "
                f"not a distconform.extension.Format"
            )
        if fmt.file_name in taken:
            raise ReportFormatError(
                f"report format {entry.name!r} writes {fmt.file_name}, which the "
                f"{taken[fmt.file_name]!r} format writes"
            )
        if fmt.file_name:
            taken[fmt.file_name] = fmt.name
        found.append(fmt)
    return tuple(found)
