"""``python -m harness conformance``: run the suites in-process and print the report.

Everything after the known options goes to pytest unchanged (``-k``, ``-x``, paths...).
Without paths it runs one bundled suite: ``--suite fsdp`` (the default: ``suites/`` without
``suites/backend``, against ``--impl``) or ``--suite backend`` (``suites/backend``, against
``--backend``). Without ``--quick`` it runs every case, the ``slow`` ones included;
``--quick`` keeps the project's default selection.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import backend_plugins

DEFAULT_OUT = "conformance-report"
SUITES = ("fsdp", "backend")
BACKEND_SUITE_DIR = "backend"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness conformance",
        description="Run the conformance suites against an implementation and report "
        "PASS / FAIL / XFAIL / XPASS / UNSUPPORTED / SKIP per feature and world size. "
        "Unknown arguments are passed to pytest.",
    )
    parser.add_argument(
        "--suite",
        choices=SUITES,
        default="fsdp",
        help="fsdp: the sharding implementation (--impl) (default); backend: the "
        "communication backend (--backend)",
    )
    parser.add_argument("--impl", help="reference, torch or package.module[:factory]")
    parser.add_argument("--backend", help="process-group backend (default: the device's)")
    parser.add_argument("--device", help="device type (default: cpu)")
    parser.add_argument("--launcher", help="process (default), thread or external")
    parser.add_argument("--world-sizes", metavar="N[,N...]", help="run only these world sizes")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"report directory (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--expectations", metavar="FILE", help="expectations file (TOML)")
    backend_plugins.add_argument(parser)
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
    return parser


def pytest_args(argv: list[str]) -> list[str]:
    """The pytest command line a conformance invocation stands for."""
    options, rest = build_parser().parse_known_args(argv)
    # ``python -m harness`` imported the harness before pytest could rewrite its asserts;
    # the harness's own asserts are not test assertions, so the warning is noise.
    args = [
        "-W",
        "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning",
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
    args += ["--junitxml", str(Path(options.out) / "conformance.junit.xml")]
    if not options.quick:
        args += ["-m", "slow or not slow"]
    if not any(not arg.startswith("-") and Path(arg.split("::")[0]).exists() for arg in rest):
        suites_dir = _suites_dir()
        if options.suite == "backend":
            args.append(str(suites_dir / BACKEND_SUITE_DIR))
        else:
            args += [str(suites_dir), "--ignore", str(suites_dir / BACKEND_SUITE_DIR)]
    return args + rest


def _suites_dir() -> Path:
    import suites  # imports torch: only for a run, never for --help

    return Path(suites.__file__).parent


def main(argv: list[str]) -> int:
    import pytest  # as in _suites_dir: --help answers before pytest and its plugins load

    from conformance.report import writable_directory

    options, _ = build_parser().parse_known_args(argv)
    try:  # in the user's words (--out), before pytest and every test
        writable_directory(Path(options.out), "--out")
    except pytest.UsageError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return int(pytest.ExitCode.USAGE_ERROR)
    return int(pytest.main(pytest_args(argv)))
