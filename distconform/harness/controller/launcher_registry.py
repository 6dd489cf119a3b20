"""Launchers: how ranks come to exist. One protocol, one registry, and no launcher's name
compared anywhere else.

A launcher is an object with the :class:`Launcher` attributes, registered under its name:
distconform's own are ``process`` (:mod:`distconform.harness.controller.process.launcher`),
``thread`` (:mod:`distconform.harness.controller.thread_host.launcher`) and ``external``
(:mod:`distconform.harness.controller.external.launcher`), imported only when named, since a
launcher's module may pull in what its ranks need. Another launcher is one module that calls
:func:`register_launcher` at import (load it with ``-p MODULE`` or ``--backend-plugin``-style
imports before the session configures) or an entry point of the ``distconform.launchers`` group.
Callers ask the launcher what they need to know (does it start ranks, can it limit their memory...)
instead of testing its name.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from distconform.harness import entry_points
from distconform.harness.controller.config import ConfigError

if TYPE_CHECKING:
    from distconform.harness.controller.pools import PoolKey, RankPool

Echo = Callable[[str], None] | None

LAUNCHERS_GROUP = "distconform.launchers"
#: distconform's own launchers' names, for callers that choose one (never to compare).
PROCESS, THREAD, EXTERNAL = "process", "thread", "external"
#: distconform's own launchers: name -> module whose ``LAUNCHER`` it is.
BUILT_IN_LAUNCHERS = {
    PROCESS: "distconform.harness.controller.process.launcher",
    THREAD: "distconform.harness.controller.thread_host.launcher",
    EXTERNAL: "distconform.harness.controller.external.launcher",
}
DEFAULT = PROCESS


class Launcher(Protocol):
    """How ranks come to exist for a run: what a launcher must answer. Register one with
    :func:`register_launcher`; callers ask it instead of comparing its name."""

    #: The ``--launcher`` value.
    name: str
    #: ``False`` when the ranks exist already (torchrun, srun) and this process is one.
    starts_ranks: bool
    #: Whether a per-rank memory limit can be enforced (ranks are processes of their own).
    limits_memory: bool
    #: Whether each rank has a warnings state of its own for the test's filters.
    isolates_warnings: bool

    def backend_for(self, backend: str | None, device_type: str) -> str:
        """The backend a run uses (``backend`` as named, ``None`` or ``"auto"`` for the
        default), or :class:`~distconform.harness.controller.config.ConfigError` when this
        launcher cannot."""
        ...

    def make_pool(self, key: PoolKey, echo: Echo) -> RankPool:
        """A new, not yet started pool of ranks for ``key`` (launchers that start ranks)."""
        ...

    def join_world(self, backend: str, device_type: str) -> object | None:
        """For a launcher whose ranks exist already: join their world and return it (this
        process's place in it); ``None`` for one that starts its own."""
        ...

    def reproduce_prefix(self, world_size: int) -> list[str]:
        """What runs ``python -m pytest ...`` again the way this launcher did."""
        ...


_REGISTERED: dict[str, Launcher] = {}


def register_launcher(launcher: Launcher) -> Launcher:
    """Make ``launcher`` available as ``--launcher <its name>``; returns it."""
    existing = _REGISTERED.get(launcher.name)
    if existing is not None and existing is not launcher:
        raise ConfigError(f"a launcher named {launcher.name!r} is registered already")
    _REGISTERED[launcher.name] = launcher
    return launcher


def names() -> tuple[str, ...]:
    """Every launcher that can be named: distconform's own first."""
    return tuple(
        dict.fromkeys([*BUILT_IN_LAUNCHERS, *entry_points.installed(LAUNCHERS_GROUP), *_REGISTERED])
    )


def launcher_named(name: str) -> Launcher:
    """The launcher called ``name``, loading it on first use."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in BUILT_IN_LAUNCHERS:
        return register_launcher(importlib.import_module(BUILT_IN_LAUNCHERS[name]).LAUNCHER)
    installed = entry_points.installed(LAUNCHERS_GROUP)
    if name in installed:
        return register_launcher(installed[name].load())
    raise ConfigError(f"unknown launcher {name!r}: choose one of {', '.join(names())}")


def this_python() -> list[str]:
    """The reproduce prefix of launchers whose ranks this pytest starts: the interpreter."""
    return [sys.executable.rsplit("/", 1)[-1]]


def resolve_backend(launcher: str, backend: str | None, device_type: str) -> str:
    """The backend a run with ``launcher`` uses: ``backend`` if it can, else the default."""
    return launcher_named(launcher).backend_for(backend, device_type)
