"""distconform's extension API: what a launcher, a device or backend plug-in, an
implementation adapter or a report format imports.

- Launchers (how ranks come to exist): the :class:`Launcher` protocol, with the
  :class:`RankPool` a launcher that starts ranks returns for a :class:`PoolKey`;
  :func:`register_launcher` at import, or an entry point of :data:`LAUNCHERS_GROUP`;
  :func:`device_backend` is the backend choice the bundled launchers make.
- Devices: one registry, :func:`register_device` with a :class:`DeviceType` (visibility
  variable, default backend, device count, the module that loads it, the cases it skips);
  importing it loads neither torch nor the pytest side, so a plug-in loaded in every rank
  stays light.
- Implementations: subclass :class:`Implementation`, declare :class:`Capability` names,
  register a factory under :data:`IMPLEMENTATIONS_GROUP` (``--impl NAME``), or pass
  ``--impl package.module:factory``; :func:`load_implementation` resolves either.
- Cases: :func:`conformance` ties a suite's test to its row of the case table
  (``suites/cases.toml``), which decides its skips, capabilities and selection; :func:`grid`
  parametrizes it over named values.
- Report formats: a :class:`Format` (a name, a file name, ``render(report) -> str``) named by
  an entry point of :data:`REPORT_FORMATS_GROUP`; every conformance run writes it beside
  the bundled formats.
- Backends: a backend plug-in registers itself with ``torch.distributed`` (public API) and
  ships a declaration of what it supports, read with :func:`load_declaration` into a
  :class:`BackendDeclaration` (schema: ``suites/backend/declaration.py``).

Every name is imported on first use. Anything not named here, or in :mod:`distconform.api`,
is private and may change without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distconform._lazy import lazy_exports

if TYPE_CHECKING:
    from distconform.conformance.renderers.format import (
        Format,
    )
    from distconform.conformance.renderers.third_party import (
        REPORT_FORMATS_GROUP,
        installed_formats,
    )
    from distconform.harness.comm.flight_files import (
        FLIGHT_ENV,
    )
    from distconform.harness.controller.config import (
        DistSettings,
        available_cores,
        check_device_type,
        device_backend,
        device_count,
        sharing_refusal,
    )
    from distconform.harness.controller.launcher_registry import (
        BUILT_IN_LAUNCHERS,
        LAUNCHERS_GROUP,
        Echo,
        Launcher,
        register_launcher,
        resolve_backend,
        this_python,
    )
    from distconform.harness.controller.pools import (
        PoolKey,
        RankPool,
    )
    from distconform.harness.controller.session import (
        INFRASTRUCTURE_RETRY_PROPERTY,
        RANK_OUTCOMES_PROPERTY,
        REPRODUCE_PROPERTY,
        SETTINGS_KEY,
        prints_the_report,
        requested_launcher,
        settings_of,
        world_size_of,
    )
    from distconform.harness.devices import (
        StreamChecker,
        current_stream_set,
        stream_checker,
    )
    from distconform.harness.entry_points import (
        IMPLEMENTATIONS_GROUP,
        implementations,
        program,
        pytest_plugin_args,
    )
    from distconform.harness.shared.backend_plugins import (
        ENV_VAR as BACKEND_PLUGINS_ENV,
    )
    from distconform.harness.shared.backend_plugins import (
        BackendPluginError,
    )
    from distconform.harness.shared.backend_plugins import (
        activate as activate_backend_plugins,
    )
    from distconform.harness.shared.backend_plugins import (
        add_argument as add_backend_plugin_argument,
    )
    from distconform.harness.shared.device_registry import (
        DeviceRegistryError,
        DeviceType,
        device_type,
        register_device,
    )
    from distconform.harness.shared.outcomes import (
        INFRASTRUCTURE_HEADLINE,
        STREAM_SAFETY_HEADLINE,
    )
    from distconform.harness.torch_window import (
        SUPPORTED_TORCH,
        installed_torch_version,
    )
    from distconform.harness.torch_window import (
        Version as TorchVersion,
    )
    from distconform.impl.api import (
        KNOWN_CAPABILITIES,
        Capability,
        Implementation,
        load_implementation,
    )
    from distconform.suites.backend.declaration import (
        BackendDeclaration,
        DeclarationError,
        load_declaration,
        parse_declaration,
    )
    from distconform.suites.cases import (
        conformance,
        grid,
    )

_LAUNCHERS = "distconform.harness.controller.launcher_registry"
_DEVICES = "distconform.harness.shared.device_registry"
_IMPL = "distconform.impl.api"
_DECLARATION = "distconform.suites.backend.declaration"
_SESSION = "distconform.harness.controller.session"
_CONFIG = "distconform.harness.controller.config"
_ENTRY_POINTS = "distconform.harness.entry_points"
_BACKEND_PLUGINS = "distconform.harness.shared.backend_plugins"
_TORCH_WINDOW = "distconform.harness.torch_window"

_HOMES = {
    # launchers
    "Launcher": _LAUNCHERS,
    "register_launcher": _LAUNCHERS,
    "LAUNCHERS_GROUP": _LAUNCHERS,
    "this_python": _LAUNCHERS,
    "BUILT_IN_LAUNCHERS": _LAUNCHERS,
    "Echo": _LAUNCHERS,
    "device_backend": _CONFIG,
    "PoolKey": "distconform.harness.controller.pools",
    "RankPool": "distconform.harness.controller.pools",
    # devices
    "DeviceType": _DEVICES,
    "DeviceRegistryError": _DEVICES,
    "register_device": _DEVICES,
    "device_type": _DEVICES,
    # implementations
    "Implementation": _IMPL,
    "Capability": _IMPL,
    "KNOWN_CAPABILITIES": _IMPL,
    "IMPLEMENTATIONS_GROUP": _ENTRY_POINTS,
    "load_implementation": _IMPL,
    # conformance cases: the decorator that ties a suite test to its row of the case table
    "conformance": "distconform.suites.cases",
    "grid": "distconform.suites.cases",
    # report formats
    "Format": "distconform.conformance.renderers.format",
    "REPORT_FORMATS_GROUP": "distconform.conformance.renderers.third_party",
    "installed_formats": "distconform.conformance.renderers.third_party",
    # a command or pytest plugin of its own, built on the harness's
    "DistSettings": "distconform.harness.controller.config",
    "settings_of": _SESSION,
    "world_size_of": _SESSION,
    "requested_launcher": _SESSION,
    "prints_the_report": _SESSION,
    "SETTINGS_KEY": _SESSION,
    "REPRODUCE_PROPERTY": _SESSION,
    "RANK_OUTCOMES_PROPERTY": _SESSION,
    "INFRASTRUCTURE_RETRY_PROPERTY": _SESSION,
    "INFRASTRUCTURE_HEADLINE": "distconform.harness.shared.outcomes",
    "check_device_type": _CONFIG,
    "device_count": _CONFIG,
    "sharing_refusal": _CONFIG,
    "available_cores": _CONFIG,
    "resolve_backend": _LAUNCHERS,
    "program": _ENTRY_POINTS,
    "pytest_plugin_args": _ENTRY_POINTS,
    "implementations": _ENTRY_POINTS,
    "add_backend_plugin_argument": _BACKEND_PLUGINS + ":add_argument",
    "activate_backend_plugins": _BACKEND_PLUGINS + ":activate",
    "BackendPluginError": _BACKEND_PLUGINS,
    "BACKEND_PLUGINS_ENV": _BACKEND_PLUGINS + ":ENV_VAR",
    "installed_torch_version": _TORCH_WINDOW,
    "SUPPORTED_TORCH": _TORCH_WINDOW,
    "TorchVersion": _TORCH_WINDOW + ":Version",
    "StreamChecker": "distconform.harness.devices",
    "stream_checker": "distconform.harness.devices",
    "current_stream_set": "distconform.harness.devices",
    "STREAM_SAFETY_HEADLINE": "distconform.harness.shared.outcomes",
    "FLIGHT_ENV": "distconform.harness.comm.flight_files",
    # backends
    "BackendDeclaration": _DECLARATION,
    "DeclarationError": _DECLARATION,
    "load_declaration": _DECLARATION,
    "parse_declaration": _DECLARATION,
}

__all__ = [
    "BACKEND_PLUGINS_ENV",
    "BUILT_IN_LAUNCHERS",
    "FLIGHT_ENV",
    "IMPLEMENTATIONS_GROUP",
    "INFRASTRUCTURE_HEADLINE",
    "INFRASTRUCTURE_RETRY_PROPERTY",
    "KNOWN_CAPABILITIES",
    "LAUNCHERS_GROUP",
    "RANK_OUTCOMES_PROPERTY",
    "REPORT_FORMATS_GROUP",
    "REPRODUCE_PROPERTY",
    "SETTINGS_KEY",
    "STREAM_SAFETY_HEADLINE",
    "SUPPORTED_TORCH",
    "BackendDeclaration",
    "BackendPluginError",
    "Capability",
    "DeclarationError",
    "DeviceRegistryError",
    "DeviceType",
    "DistSettings",
    "Echo",
    "Format",
    "Implementation",
    "Launcher",
    "PoolKey",
    "RankPool",
    "StreamChecker",
    "TorchVersion",
    "activate_backend_plugins",
    "add_backend_plugin_argument",
    "available_cores",
    "check_device_type",
    "conformance",
    "current_stream_set",
    "device_backend",
    "device_count",
    "device_type",
    "grid",
    "implementations",
    "installed_formats",
    "installed_torch_version",
    "load_declaration",
    "load_implementation",
    "parse_declaration",
    "prints_the_report",
    "program",
    "pytest_plugin_args",
    "register_device",
    "register_launcher",
    "requested_launcher",
    "resolve_backend",
    "settings_of",
    "sharing_refusal",
    "stream_checker",
    "this_python",
    "world_size_of",
]
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
