"""What an adopted session's JUnit file says of each method: the tests' common reading."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path


def method_outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``Class::method`` -> (``passed``, ``failure``, ``error`` or ``skipped``, its message)."""
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[name] = (
            "passed" if child is None else child.tag,
            "" if child is None else (child.get("message") or ""),
        )
    return outcomes
