"""The report's header (what ran, against what, where and when) and where a report may be
written, checked before the run."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any

import pytest

from distconform.conformance.expectations import Expectations
from distconform.extension import BACKEND_PLUGINS_ENV as BACKEND_PLUGINS_VAR
from distconform.extension import (
    SETTINGS_KEY,
)


def writable_directory(path: Path, option: str) -> Path:
    """Prove the report can be written at ``path`` before the run, without creating it (a
    refused run leaves nothing behind): a directory, or a path whose nearest existing folder
    this process may write into."""
    if path.exists() and not path.is_dir():
        raise pytest.UsageError(
            f"{option} {path} is a file, not a directory: name a directory for the report"
        )
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise pytest.UsageError(
            f"{option} {path}: {existing} is a file, not a directory: name a directory for "
            f"the report"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise pytest.UsageError(
            f"{option} {path}: cannot write the report there ({existing} is not writable); "
            f"name a directory you can write to"
        )
    return path


def environment_of(
    config: pytest.Config,
    spec: str | None,
    expectations: Expectations,
    backend_declaration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report's header: what ran, against what, where and when."""
    # Imported at the end of the run only: the report module loads with every session.
    import torch

    settings = config.stash.get(SETTINGS_KEY, None)
    plugins = [name for name in os.environ.get(BACKEND_PLUGINS_VAR, "").split(",") if name]
    return {
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "implementation": describe_implementation(spec),
        "backend_declaration": backend_declaration,
        "launcher": settings.launcher if settings else None,
        "backend": settings.backend if settings else None,
        "device": settings.device_type if settings else None,
        "world_sizes": list(settings.world_sizes) if settings and settings.world_sizes else None,
        "seed": settings.seed if settings else None,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend_plugins": plugins,
        "expectations": ", ".join(str(path) for path in expectations.sources) or None,
        "command": [sys.executable, "-m", "pytest", *config.invocation_params.args],
        "stream_check": stream_check_state(settings),
        # Set by the plugin to the JUnit file it writes beside the report (--conformance-out).
        "junit_xml": None,
    }


def stream_check_state(settings: Any) -> str | None:
    """``on``, ``off`` (--no-dist-stream-check) or ``unavailable`` (the device has no stream
    checker); None without distributed settings."""
    if settings is None:
        return None
    # Imported at the end of the run only, as torch is: the device module answers.
    from distconform.extension import stream_checker

    if stream_checker(settings.device_type) is None:
        return "unavailable"
    return "on" if settings.stream_check else "off"


def describe_implementation(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return {"name": None, "spec": None, "capabilities": []}
    # distconform.impl.api imports torch, like environment_of: only when the report is built.
    from distconform.impl.api import load_implementation

    try:
        impl = load_implementation(spec)
    except Exception as exc:  # the report still says what was asked for and why it failed
        return {"name": spec, "spec": spec, "capabilities": [], "error": repr(exc)}
    record = {
        "name": impl.name,
        "spec": spec,
        "class": f"{type(impl).__module__}.{type(impl).__qualname__}",
        "capabilities": sorted(impl.capabilities),
    }
    if impl.built_on is not None:
        record["built_on"] = impl.built_on
    return record
