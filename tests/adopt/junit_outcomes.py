"""What an adopted session's JUnit file says of each method: the tests' common reading."""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def method_outcomes(junit: Path, done: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
    """``Class::method`` -> (``passed``, ``failure``, ``error`` or ``skipped``, its message),
    from the JUnit file the session ``done`` wrote (its output, if it wrote none)."""
    assert junit.exists(), done.stdout + done.stderr
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[name] = (
            "passed" if child is None else child.tag,
            "" if child is None else (child.get("message") or ""),
        )
    return outcomes
