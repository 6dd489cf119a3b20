"""``python -m distconform gpu-check --out DIR``: run every step, write the report, say what failed.

Made for a machine lent for minutes: it runs from a plain copy of the tree on the machine's
own Python and torch, needs nothing installed, keeps each step to its own limit and the
whole check to ``--budget`` seconds, and writes ``DIR/gpu-check.json`` and
``DIR/gpu-check.md`` (each step's log and artifacts in ``DIR/STEP/``) whatever happens.
Exit status 0 when every step that ran passed, 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from distconform.harness import entry_points
from distconform.harness.gpu_check.report import as_document, write
from distconform.harness.gpu_check.runner import run_all
from distconform.harness.gpu_check.steps import Plan, build_steps

#: The tree this package belongs to: the steps run its tests and benchmarks.
TREE = Path(__file__).resolve().parents[3]
DEFAULT_BUDGET_S = 480.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{entry_points.program()} gpu-check",
        description="Check distconform on one accelerator, step by step, within a time budget; "
        "write DIR/gpu-check.json and DIR/gpu-check.md.",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="report directory")
    parser.add_argument("--device", default="cuda", help="device type (default: cuda)")
    parser.add_argument(
        "--backend", help="the device's own backend (default: the device's default, e.g. nccl)"
    )
    parser.add_argument(
        "--shared-backend",
        default="staged_gloo",
        help="backend for ranks sharing one device (default: staged_gloo)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help=f"the whole check's time (default: {DEFAULT_BUDGET_S:g})",
    )
    parser.add_argument(
        "--only", metavar="STEP[,STEP...]", help="run only these steps (names in the report)"
    )
    return parser


def main(argv: list[str]) -> int:
    options = build_parser().parse_args(argv)
    out = Path(options.out).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"gpu-check: --out {options.out}: {exc}", file=sys.stderr)
        return 2
    plan = Plan(
        python=sys.executable,
        device=options.device,
        backend=options.backend,
        shared_backend=options.shared_backend,
    )
    steps = build_steps(plan, out)
    if options.only:
        wanted = [name.strip() for name in options.only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {step.name for step in steps})
        if unknown:
            names = ", ".join(step.name for step in steps)
            print(
                f"gpu-check: unknown step(s) {', '.join(unknown)}; steps: {names}", file=sys.stderr
            )
            return 2
        steps = [step for step in steps if step.name in wanted]
    started = datetime.datetime.now(datetime.UTC)
    clock = time.monotonic()
    results = run_all(steps, out, TREE, options.budget)
    document = as_document(
        results,
        started,
        time.monotonic() - clock,
        {
            "device": plan.device,
            "backend": plan.backend,
            "shared_backend": plan.shared_backend,
            "budget_s": options.budget,
        },
    )
    json_path, md_path = write(document, out)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0 if document["ok"] else 1
