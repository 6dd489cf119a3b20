"""``python -m distconform.harness.gpu_check.environment DEVICE [--json FILE]``: the machine,
as JSON.

The first step of the GPU check, in a process of its own: torch, CUDA, NCCL and driver
versions, and each visible device's name and memory. Anything a machine cannot say is
recorded as an error string in its place, never a crash: the step exists to describe a
machine that may be broken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distconform.harness.shared import backend_plugins

_NVIDIA_SMI_FIELDS = "name,memory.total,driver_version"


def _guarded(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception as exc:  # a machine that cannot answer one question still answers the rest
        return f"unavailable: {type(exc).__name__}: {exc}"


def _nvidia_smi() -> list[dict[str, str]] | str:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "nvidia-smi not found"
    completed = subprocess.run(
        [tool, f"--query-gpu={_NVIDIA_SMI_FIELDS}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    rows = []
    for line in completed.stdout.strip().splitlines():
        name, memory, driver = (part.strip() for part in line.split(","))
        rows.append({"name": name, "memory": memory, "driver": driver})
    return rows


def describe(device_type: str) -> dict[str, Any]:
    backend_plugins.activate((), None, device_type)  # a bundled device (fakeaccel) loads here

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "pytest": pytest.__version__,
        "device_type": device_type,
        "accelerator": _guarded(lambda: str(torch.accelerator.current_accelerator())),
        "device_count": _guarded(torch.accelerator.device_count),
    }
    if device_type == "cuda":
        facts["cuda"] = torch.version.cuda
        facts["nccl"] = _guarded(lambda: ".".join(map(str, torch.cuda.nccl.version())))
        facts["nvidia_smi"] = _guarded(_nvidia_smi)
        facts["devices"] = _guarded(
            lambda: [
                {
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                }
                for props in (
                    torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())
                )
            ]
        )
    elif device_type == "cpu":  # the check's own dry run: the host is the one device
        facts["devices"] = [
            {"name": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        ]
    else:
        facts["devices"] = _guarded(
            lambda: [
                {"name": f"{device_type}:{i}", "memory": torch.accelerator.get_memory_info(i)}
                for i in range(torch.accelerator.device_count())
            ]
        )
    facts["backends"] = {
        name: _guarded(getattr(dist, f"is_{name}_available"))
        for name in ("nccl", "gloo", "mpi", "ucc", "xccl")
        if hasattr(dist, f"is_{name}_available")
    }
    return facts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m distconform.harness.gpu_check.environment")
    parser.add_argument("device", nargs="?", default="cuda")
    parser.add_argument("--json", metavar="FILE", help="also write the facts here")
    options = parser.parse_args(argv)
    text = json.dumps(describe(options.device), indent=1)
    print(text)
    if options.json:
        Path(options.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
