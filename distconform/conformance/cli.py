"""``python -m distconform conformance``: run the suites in-process and print the report.

Everything after the known options goes to pytest unchanged (``-k``, ``-x``, paths...).
Without paths it runs one bundled suite: ``--suite fsdp`` (the default: ``suites/`` without
``suites/backend``, against ``--impl``) or ``--suite backend`` (``suites/backend``, against
``--backend``). Without ``--quick`` it runs every case, the ``slow`` ones included;
``--quick`` keeps the default selection (``-m "not slow"``, spelled out: no ini file needed).

Two subcommands read saved reports instead of running anything:

- ``compare A.json B.json [C.json ...] [--html FILE]``: the tests whose outcome differs
  between the first run and each other one; exit status 1 on a new FAIL, for nightly gates.
- ``history DIR [--out FILE]``: a page of every report (and step benchmark) under ``DIR``
  over time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distconform.extension import add_backend_plugin_argument, program, pytest_plugin_args

DEFAULT_OUT = "conformance-report"
SUITES = ("fsdp", "backend")
BACKEND_SUITE_DIR = "backend"
#: distconform's own pytest settings for a run of its bundled suites.
PYTEST_INI = Path(__file__).resolve().parent / "pytest.ini"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{program()} conformance",
        description="Run the conformance suites against an implementation and report "
        "PASS / FAIL / XFAIL / XPASS / UNSUPPORTED / SKIP per feature and world size. "
        "Unknown arguments are passed to pytest.",
        epilog="Saved reports: 'python -m distconform conformance compare A.json B.json "
        "[--html FILE]' lists what changed (exit status 1 on a new FAIL); 'python -m distconform "
        "conformance history DIR' draws a page of the reports under DIR over time.",
    )
    parser.add_argument(
        "--suite",
        choices=SUITES,
        default="fsdp",
        help="fsdp: the sharding implementation (--impl) (default); backend: the "
        "communication backend (--backend)",
    )
    parser.add_argument(
        "--impl",
        help="reference, torch, an installed vendor's registered name, or package.module[:factory]",
    )
    parser.add_argument("--backend", help="process-group backend (default: the device's)")
    parser.add_argument("--device", help="device type (default: cpu)")
    parser.add_argument("--launcher", help="process (default), thread or external")
    parser.add_argument("--world-sizes", metavar="N[,N...]", help="run only these world sizes")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--expectations", metavar="FILE", help="expectations file (TOML)")
    add_backend_plugin_argument(parser)
    parser.add_argument(
        "--backend-declaration",
        metavar="FILE",
        help="what the backend supports (TOML, see suites/backend/declaration.py; default: "
        "the bundled declaration of --backend)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the default (non-slow) subset of the cases",
    )
    parser.add_argument(
        "--own-config",
        action="store_true",
        help="run the bundled suites under the pytest configuration (ini file, conftest.py) of "
        "the directory you start from, not distconform's; a run of your own test paths "
        "always uses yours",
    )
    return parser


def pytest_args(argv: list[str]) -> list[str]:
    """The pytest command line a conformance invocation stands for."""
    options, rest = build_parser().parse_known_args(argv)
    # ``python -m distconform`` imported the harness before pytest could rewrite its asserts;
    # the harness's own asserts are not test assertions, so the warning is noise.
    args = [
        "-W",
        "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning",
        *pytest_plugin_args(),  # a plain copy of the tree registers no plugin
    ]
    for name in (
        "impl",
        "backend",
        "backend_declaration",
        "device",
        "launcher",
        "world_sizes",
        "expectations",
    ):
        value = getattr(options, name)
        if value is not None:
            args += [f"--{name.replace('_', '-')}", value]
    for module in options.backend_plugin:
        args += ["--backend-plugin", module]
    args += ["--conformance-out", options.out]
    # The selection is spelled out, never left to an ini file: installed, distconform's
    # pyproject.toml (whose addopts hold -m "not slow") is not there.
    args += ["-m", "not slow" if options.quick else "slow or not slow"]
    own_paths = [arg for arg in rest if _is_path(arg)]
    bundled_ids = [arg for arg in rest if not _is_path(arg) and _bundled_path(arg) is not None]
    if not own_paths:
        suites_dir = _suites_dir()
        if not options.own_config:
            # distconform's settings and test ids (suites/...), whatever directory the run
            # starts from: a vendor's addopts or conftest.py must not change our verdict.
            args += ["-c", str(PYTEST_INI), "--rootdir", str(suites_dir.parent)]
        if bundled_ids:  # a reproducer's test id: that test alone
            rest = [_bundled_path(arg) if arg in bundled_ids else arg for arg in rest]
        elif options.suite == "backend":
            args.append(str(suites_dir / BACKEND_SUITE_DIR))
        else:
            args += [str(suites_dir), "--ignore", str(suites_dir / BACKEND_SUITE_DIR)]
    return args + rest


def _is_path(arg: str) -> bool:
    """Whether ``arg`` names a file or folder (with a test id) from the current directory."""
    return not arg.startswith("-") and Path(arg.split("::")[0]).exists()


def _bundled_path(arg: str) -> str | None:
    """``suites/test_x.py::test_y[ws2]``, a test id a bundled run printed, as the absolute id
    of that test in the installed package; None for anything else."""
    file_part, separator, rest = arg.partition("::")
    if arg.startswith("-") or not file_part.startswith("suites/"):
        return None
    path = _suites_dir().parent / file_part
    return str(path) + separator + rest if path.exists() else None


def _suites_dir() -> Path:
    from distconform import suites  # imports torch: only for a run, never for --help

    return Path(suites.__file__).parent


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    import pytest  # as in _suites_dir: --help answers before pytest and its plugins load

    from distconform.conformance.run_environment import writable_directory

    options, _ = build_parser().parse_known_args(argv)
    try:  # in the user's words (--out), before pytest and every test
        writable_directory(Path(options.out), "--out")
    except pytest.UsageError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return int(pytest.ExitCode.USAGE_ERROR)
    return int(pytest.main(pytest_args(argv)))


# --- reading saved reports ---------------------------------------------------------------

#: Exit status of a subcommand given a file or directory it cannot read (pytest's usage error).
USAGE_ERROR = 4


def compare_main(argv: list[str]) -> int:
    from distconform.conformance.compare import (
        command_line,
        compare_all,
        exit_status,
        terminal_lines,
    )
    from distconform.conformance.pages.compare import render_comparisons
    from distconform.conformance.report import ConformanceReport, UnreadableReportError

    parser = argparse.ArgumentParser(
        prog=f"{program()} conformance compare",
        description="List the tests whose outcome differs between the first report (the "
        "baseline) and each later one: new FAIL, fixed, newly UNSUPPORTED, stale "
        "expectations and the rest. Exit status 1 when a later run has a FAIL the baseline "
        "did not.",
    )
    parser.add_argument("reports", nargs="+", metavar="REPORT.json")
    parser.add_argument("--html", metavar="FILE", help="also write the changes as a page")
    options = parser.parse_args(argv)
    if len(options.reports) < 2:
        parser.error("give at least two reports: the baseline, then the runs to compare")
    try:
        runs = [ConformanceReport.load(path) for path in options.reports]
    except UnreadableReportError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return USAGE_ERROR
    comparisons = compare_all(runs)
    print("\n".join(terminal_lines(comparisons)))
    if options.html:
        page = render_comparisons(comparisons, command_line(options.reports))
        _write_page(Path(options.html), page)
        print(f"page: {options.html}")
    return exit_status(comparisons)


def history_main(argv: list[str]) -> int:
    from distconform.conformance.history import collect
    from distconform.conformance.pages.history import render_history
    from distconform.conformance.report import UnreadableReportError

    parser = argparse.ArgumentParser(
        prog=f"{program()} conformance history",
        description="Draw a page of every conformance report under DIR over time: pass "
        "rate per implementation and per feature, and the step benchmarks "
        "(benchmarks/impl_step.py --out) found alongside.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument(
        "--out", metavar="FILE", help="where to write the page (default: DIR/history.html)"
    )
    options = parser.parse_args(argv)
    try:
        history = collect(options.directory)
    except UnreadableReportError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return USAGE_ERROR
    out = Path(options.out) if options.out else Path(options.directory) / "history.html"
    _write_page(out, render_history(history, options.directory))
    for message in history.unreadable:
        print(f"not read: {message}", file=sys.stderr)
    print(
        f"{len(history.runs)} conformance runs ({', '.join(history.implementations()) or 'none'})"
        f" and {len(history.benchmarks)} step benchmarks: {out}"
    )
    return 0


def _write_page(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


SUBCOMMANDS = {"compare": compare_main, "history": history_main}
