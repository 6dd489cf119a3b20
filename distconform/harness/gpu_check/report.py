"""The GPU check's report: ``gpu-check.json`` (everything) and ``gpu-check.md`` (the table)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from distconform.harness.gpu_check.runner import StepResult
from distconform.harness.gpu_check.steps import PASS, SKIPPED

SCHEMA = "distconform-gpu-check"
SCHEMA_VERSION = 1


def as_document(
    results: list[StepResult], started: datetime.datetime, wall_s: float, plan: dict[str, Any]
) -> dict[str, Any]:
    environment = next((r.verdict.details for r in results if r.step.name == "environment"), {})
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(wall_s, 1),
        "plan": plan,
        "environment": environment,
        "ok": all(r.verdict.status in (PASS, SKIPPED) for r in results)
        and any(r.verdict.status == PASS for r in results),
        "steps": [
            {
                "name": r.step.name,
                "title": r.step.title,
                "status": r.verdict.status,
                "wall_s": round(r.wall_s, 1),
                "limit_s": round(r.limit_s, 1),
                "exit_status": r.returncode,
                "summary": r.verdict.summary,
                "command": list(r.step.argv),
                "details": r.verdict.details if r.step.name != "environment" else {},
            }
            for r in results
        ],
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def as_markdown(document: dict[str, Any]) -> str:
    env = document["environment"]
    card = ", ".join(str(d.get("name", "?")) for d in env.get("devices", []) if isinstance(d, dict))
    verdict = "every step passed" if document["ok"] else "NOT every step passed"
    lines = [
        f"## GPU check, {document['date']} ({card or document['plan']['device']})",
        "",
        f"torch {env.get('torch', '?')}, Python {env.get('python', '?')}, "
        f"CUDA {env.get('cuda', '-')}, NCCL {env.get('nccl', '-')}, "
        f"pytest {env.get('pytest', '?')}; whole check {document['wall_s']} s; {verdict}.",
        "",
        "| step | status | time | limit | result |",
        "|---|---|---:|---:|---|",
    ]
    for step in document["steps"]:
        lines.append(
            f"| {step['name']} | {step['status'].upper()} | {step['wall_s']:.1f} s "
            f"| {step['limit_s']:.0f} s | {_cell(step['summary'])} |"
        )
    failures = [
        (step["name"], f)
        for step in document["steps"]
        for f in step["details"].get("failures", [])
        if isinstance(f, dict)
    ]
    if failures:
        lines += ["", "Conformance failures:", ""]
        lines += [f"- {name}: `{f['test']}`: {_cell(f['message'])[:300]}" for name, f in failures]
    return "\n".join(lines) + "\n"


def write(document: dict[str, Any], out: Path) -> tuple[Path, Path]:
    json_path, md_path = out / "gpu-check.json", out / "gpu-check.md"
    json_path.write_text(json.dumps(document, indent=1) + "\n")
    md_path.write_text(as_markdown(document))
    return json_path, md_path
