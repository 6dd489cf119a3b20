"""A rank's memory limit: an allocation beyond it raises inside that rank.

``RLIMIT_AS`` bounds a process's address space, and a rank has already mapped a lot of
it (torch alone maps over a gigabyte of libraries), so the limit a test asks for is
added to what the rank has mapped when the test starts. Process ranks only: threads
share one address space.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator


def mapped_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmSize not found in /proc/self/status")


@contextlib.contextmanager
def limited_memory(limit: int | None) -> Iterator[None]:
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
