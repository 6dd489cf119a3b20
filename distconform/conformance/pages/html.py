"""The pieces every page is built from: escaping, status badges, the stylesheet, the frame.

Pages are strings built from these helpers; every piece of text from a report goes through
:func:`esc` (node ids, failure text and reasons contain ``<``, ``&`` and quotes).
Expanding a row is the browser's own ``<details>`` element, so a page needs no script and
works from a file, an artifact store or a mail attachment alike.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Mapping

from distconform.conformance.statuses import STATUSES

STYLE = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --bg-soft: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
       margin: 0 auto; padding: 24px; max-width: 1400px; }
h1 { font-size: 24px; margin: 0 0 8px; }
h2 { font-size: 18px; margin: 32px 0 8px; border-bottom: 1px solid var(--line);
     padding-bottom: 4px; }
h3 { font-size: 15px; margin: 20px 0 6px; }
code, pre { font: 12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: var(--bg-soft); border: 1px solid var(--line); border-radius: 6px;
      padding: 8px 10px; overflow-x: auto; white-space: pre-wrap; word-break: break-word; }
table { border-collapse: collapse; margin: 6px 0; max-width: 100%; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: left;
         vertical-align: top; overflow-wrap: anywhere; }
th { background: var(--bg-soft); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.muted { color: var(--muted); }
.banner { border-radius: 6px; padding: 8px 12px; margin: 8px 0; font-weight: 600; }
.banner.bad { background: #ffebe9; border: 1px solid #cf222e; color: #82071e; }
.banner.good { background: #dafbe1; border: 1px solid #1a7f37; color: #0b4a1f; }
.banner.neutral { background: #f6f8fa; border: 1px solid #d0d7de; color: #24292f; }
.verdicts { margin: 4px 0 8px; padding-left: 1.2em; }
.verdict.good { color: #1a7f37; font-weight: 600; }
.verdict.bad { color: #cf222e; font-weight: 600; }
.verdict.neutral { color: #57606a; }
.headline { display: flex; gap: 24px; align-items: baseline; flex-wrap: wrap; margin: 8px 0; }
.headline .rate { font-size: 34px; font-weight: 700; }
.badge { display: inline-block; min-width: 5.5em; text-align: center; border-radius: 4px;
         padding: 0 6px; font-size: 12px; font-weight: 600; }
.s-PASS { background: #dafbe1; color: #0b4a1f; }
.s-FAIL { background: #ffcecb; color: #82071e; }
.s-XFAIL { background: #ffe7c2; color: #7a4100; }
.s-XPASS { background: #fff8c5; color: #5c4a00; }
.s-UNSUPPORTED { background: #dde6ef; color: #2f4052; }
.s-SKIP { background: #eaeef2; color: #59636e; }
.s-none { background: #ffffff; color: #8c959f; }
table.matrix td.cell { text-align: center; min-width: 4.5em; font-variant-numeric: tabular-nums; }
table.matrix td.cell a { color: inherit; text-decoration: none; display: block; }
details.case { border: 1px solid var(--line); border-radius: 6px; margin: 3px 0; }
details.case > summary { cursor: pointer; padding: 3px 8px; list-style-position: inside; }
details.case > summary .nodeid { word-break: break-all; }
details.case > .body { padding: 4px 12px 10px; border-top: 1px solid var(--line); }
details.case[data-status="FAIL"] { border-color: #ff8182; }
.chips span { margin-right: 6px; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
"""


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def badge(status: str, text: str | None = None) -> str:
    return f'<span class="badge s-{esc(status)}">{esc(text or status)}</span>'


def slug(text: str) -> str:
    """An id attribute made of ``text`` (feature names hold slashes and dots)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "x"


def status_chips(counts: Mapping[str, int]) -> str:
    """Every status with a count, as badges in the report's order."""
    chips = [
        badge(status, f"{status} {counts[status]}") for status in STATUSES if counts.get(status)
    ]
    return f'<span class="chips">{"".join(chips) or badge("none", "no tests")}</span>'


def table(header: Iterable[str], rows: Iterable[Iterable[str]], *, cls: str = "") -> str:
    """A table of cells that are already HTML (escape text with :func:`esc` first)."""
    head = "".join(f"<th>{cell}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    attribute = f' class="{cls}"' if cls else ""
    return f"<table{attribute}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, body: str, *, generator: str) -> str:
    """A whole document: no external resource, so it renders offline and from a file."""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta name="generator" content="{esc(generator)}">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )
