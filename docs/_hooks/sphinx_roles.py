"""MkDocs hook: the docstrings are written with Sphinx roles (``:func:`run_on_ranks```), which
mkdocstrings renders as they are. Drop the role and keep the code span, as Sphinx would show
it: ``:class:`~a.b.C``` becomes ``C``, ``:func:`a.b``` stays ``a.b``."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|const):(<code>)(~?)([^<]*)(</code>)")


def _shown(match: re.Match[str]) -> str:
    target = match[3].rsplit(".", 1)[-1] if match[2] else match[3]
    return f"{match[1]}{target}{match[4]}"


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub(_shown, html)
