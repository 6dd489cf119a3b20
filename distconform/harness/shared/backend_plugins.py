"""``--backend-plugin MODULE``: a vendor's module that registers a c10d backend (or a device).

A device plug-in is the same kind of module: importing it loads the device, registers its
Python module and its backend (``harness/devices/fakeaccel`` is one). The harness's own
backend and device are imported by name: ``--backend staged_gloo`` and ``--device
fakeaccel`` need no ``--backend-plugin``.

The parent imports each module (so ``--backend NAME`` resolves) and records the list in
:data:`ENV_VAR`. Ranks inherit the environment, and every rank entry point calls
:func:`import_from_environment` before ``init_process_group``, so a module that calls
``torch.distributed.Backend.register_backend`` takes effect in each rank. Because the
variable is part of the environment, it is part of every pool key's fingerprint: a pool
started without the plug-in is never reused for a run that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from distconform.harness.shared.device_registry import plugin_module

ENV_VAR = "DISTCONFORM_BACKEND_PLUGINS"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend-plugin MODULE`` (repeatable) for a ``python -m distconform`` subcommand."""
    parser.add_argument(
        "--backend-plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="module that registers a c10d backend; imported in every rank (repeatable)",
    )


class BackendPluginError(ImportError):
    """A ``--backend-plugin`` module could not be imported."""


def import_plugins(modules: Iterable[str]) -> list[str]:
    """Import every module named; return their names. Raises BackendPluginError."""
    names = [name.strip() for name in modules if name and name.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise BackendPluginError(
                f"--backend-plugin {name}: cannot import it ({exc}); is it installed or on "
                f"PYTHONPATH?"
            ) from exc
    return names


#: Backends the harness bundles: ``--backend NAME`` imports the module, no plug-in flag
#: needed. A device's module (its registry entry's ``plugin``) is imported the same way, first:
#: it registers its backend.
BUNDLED_BACKENDS = {"staged_gloo": "distconform.harness.backends.staged_gloo"}


def activate(
    modules: Iterable[str], backend: str | None = None, device: str | None = None
) -> list[str]:
    """Import the plug-ins here and publish them to every rank started from now on.

    ``backend`` and ``device`` are the run's ``--backend`` and ``--device``: a bundled
    one's module is added.
    """
    wanted = []
    for bundled in (
        plugin_module(device) if device else None,
        BUNDLED_BACKENDS.get((backend or "").lower()),
    ):
        if bundled is not None:
            wanted.append(bundled)
    wanted += [module for module in modules if module not in wanted]
    names = import_plugins(wanted)
    if names:
        os.environ[ENV_VAR] = ",".join(names)
    return names


@contextmanager
def published(
    modules: Iterable[str], backend: str | None = None, device: str | None = None
) -> Iterator[list[str]]:
    """:func:`activate` for the block only: the environment's list is put back after it."""
    previous = os.environ.get(ENV_VAR)
    try:
        yield activate(modules, backend, device)
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def import_from_environment() -> list[str]:
    """In a rank, before the process group starts: import the parent's plug-ins."""
    return import_plugins(os.environ.get(ENV_VAR, "").split(","))
