"""The conformance report: one status per test, counted per feature and world size.

Statuses (a test has exactly one):

- ``PASS``: it ran and passed.
- ``FAIL``: it failed, or errored in setup or teardown.
- ``XFAIL``: it failed and the implementation's expectations file lists it.
- ``XPASS``: it is listed there but passed (the entry is out of date; it still counts as
  conformant).
- ``UNSUPPORTED``: it needs a capability the implementation does not declare (a skip whose
  reason starts with ``UNSUPPORTED:``); it never ran, so it is neither PASS nor FAIL.
- ``SKIP``: any other skip, e.g. ``CPU:`` for cases that cannot run on this device.

Conformance = (PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL): the share of the cases that
apply to this implementation on this device and that behave as specified. UNSUPPORTED and
SKIP are reported next to it, never hidden in it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.conformance.expectations import Entry, Expectations

SCHEMA = "distconform-conformance"
SCHEMA_VERSION = 1
STATUSES = ("PASS", "FAIL", "XFAIL", "XPASS", "UNSUPPORTED", "SKIP")
UNSUPPORTED_PREFIX = "UNSUPPORTED:"
_MAX_DETAIL_CHARS = 4000


@dataclass
class TestResult:
    nodeid: str
    feature: str
    world_size: int | None
    status: str = "PASS"
    when: str = "call"
    duration_s: float = 0.0
    reason: str = ""
    message: str = ""
    detail: str = ""
    category: str = ""
    link: str = ""


def feature_of(item: pytest.Item) -> str:
    """The ``feature`` marker, else the module path without its top directory and ``test_``."""
    marker = item.get_closest_marker("feature")
    if marker is not None and marker.args:
        return str(marker.args[0])
    return feature_from_nodeid(item.nodeid)


def feature_from_nodeid(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) > 1:
        parts = parts[1:]
    stem = parts[-1].removesuffix(".py")
    parts[-1] = stem.removeprefix("test_")
    return "/".join(parts)


_WORLD_SIZE_ID = re.compile(r"\[(?:[^\]]*-)?ws(\d+)(?:-|\])")


def world_size_from_nodeid(nodeid: str) -> int | None:
    """The ``wsN`` part of a parametrized id (for reports from pytest-xdist workers)."""
    found = _WORLD_SIZE_ID.search(nodeid)
    return int(found.group(1)) if found else None


def _world_size(item: pytest.Item) -> int | None:
    from harness.plugin import world_size_of

    return world_size_of(item)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr or "")
    return text.removeprefix("Skipped: ").strip()


def _crash_message(report: pytest.TestReport) -> str:
    """One line: the exception's message (a distributed failure's root-cause line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "").strip()
    if not text:  # a plain-text report (e.g. a pool that did not start): its first line
        lines = [line for line in report.longreprtext.splitlines() if line.strip()]
        text = lines[0].strip() if lines else ""
    return text.splitlines()[0] if text else ""


class Recorder:
    """Turns the stream of TestReports into one TestResult per test."""

    def __init__(self) -> None:
        self.results: dict[str, TestResult] = {}
        self._items: dict[str, tuple[str, int | None]] = {}
        self._expected: dict[str, Entry] = {}

    def describe_item(self, item: pytest.Item) -> None:
        self._items[item.nodeid] = (feature_of(item), _world_size(item))

    def expect(self, nodeid: str, entry: Entry) -> None:
        self._expected[nodeid] = entry

    def add(self, report: pytest.TestReport) -> None:
        if report.outcome not in ("passed", "failed", "skipped"):
            return  # e.g. "rerun": only the final attempt counts
        result = self.results.get(report.nodeid)
        if result is None:
            # Items collected elsewhere (pytest-xdist workers) are described from their id.
            feature, world_size = self._items.get(
                report.nodeid,
                (feature_from_nodeid(report.nodeid), world_size_from_nodeid(report.nodeid)),
            )
            result = self.results[report.nodeid] = TestResult(report.nodeid, feature, world_size)
        result.duration_s += report.duration
        if report.when == "teardown":
            if report.failed and result.status != "FAIL":
                self._fail(result, report)
            return
        if report.when == "setup" and report.passed:
            return
        result.when = report.when
        entry = self._expected.get(report.nodeid)
        wasxfail = getattr(report, "wasxfail", None)
        if entry is not None:
            result.category, result.link = entry.category, entry.link
            wasxfail = entry.reason if wasxfail is not None else None
        if report.failed:
            self._fail(result, report)
        elif report.passed:
            result.status = "XPASS" if wasxfail is not None else "PASS"
            result.reason = wasxfail or ""
        elif wasxfail is not None:
            result.status = "XFAIL"
            result.reason = wasxfail
            result.message = _crash_message(report)
            result.detail = report.longreprtext[-_MAX_DETAIL_CHARS:]
        else:
            result.reason = _skip_reason(report)
            unsupported = result.reason.startswith(UNSUPPORTED_PREFIX)
            result.status = "UNSUPPORTED" if unsupported else "SKIP"

    @staticmethod
    def _fail(result: TestResult, report: pytest.TestReport) -> None:
        result.status = "FAIL"
        result.when = report.when
        result.message = _crash_message(report)
        result.detail = report.longreprtext[-_MAX_DETAIL_CHARS:]

    def build(self, environment: dict[str, Any], stale: list[Entry]) -> ConformanceReport:
        return ConformanceReport(environment, list(self.results.values()), stale)


def conformance_percent(counts: Counter) -> float | None:
    good = counts["PASS"] + counts["XPASS"]
    applicable = good + counts["FAIL"] + counts["XFAIL"]
    return None if applicable == 0 else 100.0 * good / applicable


def _percent_text(value: float | None) -> str:
    if value is None:
        return "n/a"
    # Never round a run with a failure up to 100 %.
    text = f"{value:.1f} %"
    return "99.9 %" if text == "100.0 %" and value < 100.0 else text


@dataclass
class ConformanceReport:
    environment: dict[str, Any]
    tests: list[TestResult]
    stale: list[Entry] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(result.status for result in self.tests)

    def rows(self) -> list[tuple[str, int | None, Counter]]:
        grouped: dict[tuple[str, int | None], Counter] = defaultdict(Counter)
        for result in self.tests:
            grouped[(result.feature, result.world_size)][result.status] += 1
        keys = sorted(grouped, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
        return [(feature, ws, grouped[(feature, ws)]) for feature, ws in keys]

    def percent(self) -> float | None:
        return conformance_percent(self.counts())

    # --- JSON --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        counts = self.counts()
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "environment": self.environment,
            "summary": {
                "tests": len(self.tests),
                "counts": {status: counts[status] for status in STATUSES},
                "conformance_percent": self.percent(),
                "definition": "(PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL)",
            },
            "features": [
                {
                    "feature": feature,
                    "world_size": ws,
                    "counts": {status: row[status] for status in STATUSES},
                    "conformance_percent": conformance_percent(row),
                }
                for feature, ws, row in self.rows()
            ],
            "tests": [asdict(result) for result in self.tests],
            "stale_expectations": [
                {"id": e.pattern, "kind": e.kind, "file": str(e.source), "line": e.line}
                for e in self.stale
            ],
        }

    # --- Markdown ------------------------------------------------------------------------

    def table_lines(self) -> list[str]:
        header = ["feature", "ws", *STATUSES, "conformance"]
        body = []
        for feature, ws, row in self.rows():
            body.append(
                [
                    feature,
                    "-" if ws is None else str(ws),
                    *(str(row[s]) for s in STATUSES),
                    _percent_text(conformance_percent(row)),
                ]
            )
        total = self.counts()
        body.append(
            ["**total**", "", *(str(total[s]) for s in STATUSES), _percent_text(self.percent())]
        )
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            padded = [
                cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i])
                for i, cell in enumerate(cells)
            ]
            return "| " + " | ".join(padded) + " |"

        rule = (
            "|"
            + "|".join("-" * (w + 1) + ("-" if i < 2 else ":") for i, w in enumerate(widths))
            + "|"
        )
        return [line(header), rule, *(line(cells) for cells in body)]

    def header_lines(self) -> list[str]:
        env = self.environment
        impl = env.get("implementation", {})
        capabilities = ", ".join(impl.get("capabilities", [])) or "none declared"
        sizes = env.get("world_sizes") or "all"
        return [
            f"implementation: {impl.get('name', '?')} (spec {impl.get('spec', '?')}); "
            f"capabilities: {capabilities}",
            f"torch {env.get('torch_version')}, launcher {env.get('launcher')}, backend "
            f"{env.get('backend')}, device {env.get('device')}, world sizes {sizes}, "
            f"seed {env.get('seed')}, {env.get('date')}",
            f"expectations: {env.get('expectations') or 'none'}"
            + (
                f"; backend plug-ins: {', '.join(env['backend_plugins'])}"
                if env.get("backend_plugins")
                else ""
            ),
        ]

    def notable_lines(self) -> list[str]:
        lines: list[str] = []
        for status, label in (
            ("FAIL", "failed"),
            ("XPASS", "passed although expected to fail (update the expectations file)"),
            ("XFAIL", "expected failures"),
        ):
            found = [r for r in self.tests if r.status == status]
            if not found:
                continue
            lines.append(f"{status} — {label}:")
            for r in found:
                extra = f" [{r.category}]" if r.category else ""
                what = r.message or r.reason
                lines.append(f"- `{r.nodeid}`{extra}: {what}"[:400])
        unsupported = Counter(r.reason for r in self.tests if r.status == "UNSUPPORTED")
        if unsupported:
            lines.append("UNSUPPORTED:")
            lines += [f"- {n} x {reason}" for reason, n in unsupported.most_common()]
        for entry in self.stale:
            lines.append(f"stale expectation: {entry.describe()}")
        return lines

    def to_markdown(self) -> str:
        percent = _percent_text(self.percent())
        lines = [
            f"# Conformance report: {self.environment.get('implementation', {}).get('name')}",
            "",
            *(f"- {line}" for line in self.header_lines()),
            f"- conformance: **{percent}** = (PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL)",
            "",
            *self.table_lines(),
            "",
            *self.notable_lines(),
        ]
        return "\n".join(lines).rstrip() + "\n"

    def terminal_lines(self) -> list[str]:
        notable = self.notable_lines()
        return [
            *self.header_lines(),
            "",
            *self.table_lines(),
            *(["", *notable] if notable else []),
            "",
            f"conformance {_percent_text(self.percent())} "
            f"((PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL))",
        ]

    def write(self, out_dir: Path, junit_path: str | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        data = self.to_json()
        data["environment"]["junit_xml"] = junit_path
        (out_dir / "conformance.json").write_text(json.dumps(data, indent=2) + "\n")
        (out_dir / "conformance.md").write_text(self.to_markdown())


def environment_of(
    config: pytest.Config, spec: str | None, expectations: Expectations
) -> dict[str, Any]:
    """The report's header: what ran, against what, where and when."""
    import torch

    from harness.conformance.backend_plugins import ENV_VAR
    from harness.plugin import SETTINGS_KEY

    settings = config.stash.get(SETTINGS_KEY, None)
    plugins = [name for name in os.environ.get(ENV_VAR, "").split(",") if name]
    return {
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "implementation": describe_implementation(spec),
        "launcher": settings.launcher if settings else None,
        "backend": settings.backend if settings else None,
        "device": settings.device_type if settings else None,
        "world_sizes": list(settings.world_sizes) if settings and settings.world_sizes else None,
        "seed": settings.seed if settings else None,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend_plugins": plugins,
        "expectations": str(expectations.source) if expectations.source else None,
        "command": [sys.executable, "-m", "pytest", *config.invocation_params.args],
    }


def describe_implementation(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return {"name": None, "spec": None, "capabilities": []}
    try:
        from impl.api import load_implementation

        impl = load_implementation(spec)
    except Exception as exc:  # the report still says what was asked for and why it failed
        return {"name": spec, "spec": spec, "capabilities": [], "error": repr(exc)}
    return {
        "name": impl.name,
        "spec": spec,
        "class": f"{type(impl).__module__}.{type(impl).__qualname__}",
        "capabilities": sorted(impl.capabilities),
    }
