"""The conformance surface: what suites may call on an implementation, and how one is chosen.

Suites receive an ``Implementation`` and never import an implementation module themselves.
It offers the FSDP2-style entry points (``fully_shard``, ``replicate``,
``register_fsdp_forward_method``), the policy types, the ``FSDPModule`` type (every managed
module also has FSDP2's methods: ``unshard``, ``reshard``, ``set_requires_gradient_sync``, ...),
a declared capability set, and introspection hooks so that suites never read torch internals.

``load_implementation(spec)`` picks one: a name registered in the ``distconform.implementations``
entry-point group (``reference`` and ``torch`` are distconform's own; an installed vendor
package adds its name the same way), or ``"package.module[:factory]"``. Either way a factory
(default name ``implementation``) is called with no arguments and returns an
``Implementation``. This module imports no implementation. An implementation pickles as its
spec, so a pytest parent can ship it to rank processes, which rebuild it by name.

This module knows nothing about pytest.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distconform.extension import IMPLEMENTATIONS_GROUP, implementations

if TYPE_CHECKING:  # the pytest process loads this with the conformance plugin, before torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

ENV_VAR = "DISTCONFORM_IMPL"
DEFAULT_SPEC = "reference"


class Capability:
    """The capability names, as constants: a case requires some (``suites/cases.toml``), an
    implementation declares the subset it supports (``Implementation.capabilities``)."""

    #: replicate(): DDP semantics on the FSDP machinery
    REPLICATE = "replicate"
    #: Shard(dim) other than 0 via shard_placement_fn
    SHARD_PLACEMENT_FN = "shard_placement_fn"
    #: reshard_after_forward=<int> accepted
    RESHARD_AFTER_FORWARD_INT = "reshard_after_forward_int"
    #: set_requires_gradient_sync / set_reshard_after_backward
    GRADIENT_ACCUMULATION = "gradient_accumulation"
    #: unshard(async_op=True) / set_unshard_async_op
    ASYNC_UNSHARD = "async_unshard"
    #: register_fsdp_forward_method
    FORWARD_METHOD = "forward_method"
    #: 2-D (replicate, shard) meshes
    HSDP = "hsdp"
    #: MixedPrecisionPolicy with dtypes
    MIXED_PRECISION = "mixed_precision"
    #: CPUOffloadPolicy
    CPU_OFFLOAD = "cpu_offload"
    #: set_modules_to_forward_prefetch / backward_prefetch
    PREFETCH = "prefetch"
    #: set_post_optim_event with real device events
    POST_OPTIM_EVENT = "post_optim_event"
    #: share_comm_ctx
    SHARE_COMM_CTX = "share_comm_ctx"
    #: composition with tensor parallel DTensor parameters
    TP = "tp"
    #: composition with pipeline schedules
    PP = "pp"
    #: distributed checkpoint state dicts
    DCP = "dcp"
    #: composition with activation checkpointing
    ACTIVATION_CHECKPOINTING = "activation_checkpointing"
    #: fully_shard(ignored_params=...): left unsharded and unsynchronized
    IGNORED_PARAMS = "ignored_params"
    #: FSDPModule.reset_iter_state() after an exception mid-step
    RESET_ITER_STATE = "reset_iter_state"
    #: FSDPModule.set_all_reduce_hook: a hook on each reduced gradient
    ALL_REDUCE_HOOK = "all_reduce_hook"
    #: FSDPModule.set_custom_all_gather / set_custom_reduce_scatter: a user's collectives
    CUSTOM_COMMS = "custom_comms"
    #: FSDPModule.set_separate_reduce_scatter_group: reduce-scatters on a group of their own
    SEPARATE_REDUCE_SCATTER_GROUP = "separate_reduce_scatter_group"
    #: FSDPModule.set_reduce_scatter_unused_params: zeros for parameters unused on a rank
    REDUCE_SCATTER_UNUSED_PARAMS = "reduce_scatter_unused_params"
    #: FSDPModule.set_reduce_scatter_max_input_buffers: reduce-scatter inputs in flight
    REDUCE_SCATTER_MAX_INPUT_BUFFERS = "reduce_scatter_max_input_buffers"
    #: fully_shard/replicate(dp_mesh_dims=DataParallelMeshDims(...)): a full SPMD mesh
    DP_MESH_DIMS = "dp_mesh_dims"
    #: FSDPModule.set_manual_backward_finalization / finalize_backward (torch 2.15)
    MANUAL_BACKWARD_FINALIZATION = "manual_backward_finalization"
    #: FSDPModule.set_keep_unsharded_storage: the same unsharded memory on every unshard
    KEEP_UNSHARDED_STORAGE = "keep_unsharded_storage"


#: Every capability name (:class:`Capability`'s values).
KNOWN_CAPABILITIES = frozenset(value for name, value in vars(Capability).items() if name.isupper())


class Implementation(ABC):
    """One FSDP2-semantics implementation, as the suites see it."""

    #: Short name used in reports.
    name: str
    #: What this implementation claims to support (a subset of ``KNOWN_CAPABILITIES``).
    capabilities: frozenset[str]
    #: Policy types, constructed by suites with FSDP2's field names.
    MixedPrecisionPolicy: type
    OffloadPolicy: type
    CPUOffloadPolicy: type
    #: FSDP2's ``DataParallelMeshDims`` (capability ``dp_mesh_dims``), built by suites with its
    #: field names; ``None`` where the implementation has none.
    DataParallelMeshDims: type | None = None
    #: ``isinstance(module, impl.FSDPModule)`` is true for every managed module.
    FSDPModule: type

    #: The registered implementation this one is built on (``"torch"`` for a wrapper of
    #: torch's FSDP2), or None. A conformance run inherits that implementation's recorded
    #: deviations (its expectations on the installed torch), each marked inherited in the
    #: report; this implementation's own expectations win where both list a test.
    built_on: str | None = None

    #: The spec this object was loaded from; set by ``load_implementation``.
    spec: str = ""

    def __reduce__(self) -> tuple[Callable[[str], Implementation], tuple[str]]:
        if not self.spec:
            raise TypeError(
                f"{type(self).__name__} was not created by load_implementation, so it cannot "
                f"be rebuilt by name in another process"
            )
        return (load_implementation, (self.spec,))

    def supports(self, *capabilities: str) -> bool:
        unknown = set(capabilities) - KNOWN_CAPABILITIES
        if unknown:
            raise ValueError(
                f"unknown capability name(s) {sorted(unknown)}; "
                "see distconform.impl.api.KNOWN_CAPABILITIES"
            )
        return set(capabilities) <= self.capabilities

    def __repr__(self) -> str:
        return f"<{self.name} implementation ({self.spec or 'unloaded'})>"

    # --- the FSDP2-style entry points ------------------------------------------------------

    @abstractmethod
    def fully_shard(
        self,
        module: nn.Module | list[nn.Module],
        *,
        mesh: DeviceMesh | None = None,
        reshard_after_forward: bool | int | None = None,
        shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
        mp_policy: Any = None,
        offload_policy: Any = None,
        ignored_params: set[nn.Parameter] | None = None,
        dp_mesh_dims: Any = None,
    ) -> Any:
        """Shard ``module`` (a list makes one group). ``None`` policies mean the defaults.

        ``ignored_params`` (capability ``ignored_params``) stay plain local parameters: not
        sharded, not gathered, their gradients not reduced. ``dp_mesh_dims`` (capability
        ``dp_mesh_dims``; suites pass it only then) names the data-parallel dims of ``mesh``,
        a full SPMD mesh whose ``DTensor`` parameters are ``Replicate()`` on those dims.
        """

    @abstractmethod
    def replicate(
        self,
        module: nn.Module | list[nn.Module],
        *,
        mesh: DeviceMesh | None = None,
        mp_policy: Any = None,
        offload_policy: Any = None,
        ignored_params: set[nn.Parameter] | None = None,
        dp_mesh_dims: Any = None,
    ) -> Any:
        """Replicate ``module`` with DDP semantics on the same machinery; ``ignored_params``
        and ``dp_mesh_dims`` (a replicate dim only) as for :meth:`fully_shard`."""

    @abstractmethod
    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        """Run the forward hooks around ``module.<method_name>`` too."""

    def share_comm_ctx(self, modules: list[nn.Module]) -> None:
        raise NotImplementedError(f"{self.name} does not implement share_comm_ctx")

    # --- introspection hooks ---------------------------------------------------------------

    def is_managed(self, module: nn.Module) -> bool:
        """Whether ``fully_shard`` or ``replicate`` was applied to ``module``."""
        return isinstance(module, self.FSDPModule)

    @abstractmethod
    def is_group_unsharded(self, module: nn.Module) -> bool:
        """Whether the parameter group of managed ``module`` holds unsharded parameters now."""

    @abstractmethod
    def modules_to_run_forward(self, module: nn.Module) -> set[nn.Module]:
        """Modules of ``module``'s group that have not run forward yet in the current pass."""

    @abstractmethod
    def set_unshard_async_op(self, module: nn.Module, async_op: bool) -> None:
        """Issue the implicit (hook-driven) all-gathers of ``module``'s group asynchronously."""


_LOADED: dict[str, Implementation] = {}


def default_spec() -> str:
    return os.environ.get(ENV_VAR) or DEFAULT_SPEC


def load_implementation(spec: str | None = None) -> Implementation:
    """The implementation named by ``spec`` (default: ``$DISTCONFORM_IMPL`` or ``reference``)."""
    spec = spec or default_spec()
    if spec not in _LOADED:
        impl = _build(spec)
        if not isinstance(impl, Implementation):
            raise TypeError(
                f"implementation spec {spec!r} produced a {type(impl).__name__}, not a "
                f"distconform.impl.api.Implementation"
            )
        unknown = impl.capabilities - KNOWN_CAPABILITIES
        if unknown:
            raise ValueError(
                f"implementation {spec!r} declares unknown capabilities {sorted(unknown)}"
            )
        impl.spec = spec
        _LOADED[spec] = impl
    return _LOADED[spec]


def _build(spec: str) -> Any:
    registered = implementations()
    if spec in registered:
        return _call(
            registered[spec].load(),
            f"{spec} ({registered[spec].value})",
            f"the entry point {spec!r} of {IMPLEMENTATIONS_GROUP!r}",
        )
    module_name, _, factory_name = spec.partition(":")
    expected = (
        f"expected a registered name ({', '.join(sorted(registered)) or 'none'}: the entry "
        f"points of {IMPLEMENTATIONS_GROUP!r}) or 'package.module[:factory]'"
    )
    if not module_name or any(not part.isidentifier() for part in module_name.split(".")):
        raise ValueError(f"bad implementation spec {spec!r}: {expected}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name.partition(".")[0]:
            raise  # the module exists and one of its own imports failed
        raise ValueError(f"unknown implementation {spec!r}: {expected}") from error
    factory_name = factory_name or "implementation"
    try:
        factory = getattr(module, factory_name)
    except AttributeError:
        raise ValueError(
            f"implementation module {module_name!r} has no factory {factory_name!r}"
        ) from None
    return _call(factory, f"{module_name}:{factory_name}", "the name after ':'")


def _call(factory: Any, where: str, naming: str) -> Any:
    if not callable(factory):
        raise TypeError(
            f"{where} is a {type(factory).__name__}, not a factory: {naming} must be a "
            f"function (or class) that returns a distconform.impl.api.Implementation"
        )
    return factory()
