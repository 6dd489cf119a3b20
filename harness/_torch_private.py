"""The one audited place where the harness touches private PyTorch names.

Every accessor here exists because torch 2.13 has no public API for what the harness
needs. Each one checks the installed torch version first and refuses to run on a
version it was not audited for, with a message that says what to re-audit; a test in
``tests/harness/test_torch_private.py`` exercises every accessor and the refusal.

Nothing else in ``harness/`` may import a private torch module or touch an
underscore attribute of torch. torch's internal testing package is never imported here:
only ``harness/adopt/_torch_test_harness.py`` reads it, to run tests written for it
(``--dist-adopt``), with this module's version check.
The private modules are imported inside the accessors, after the version check, so that
another torch version gets the audit's message instead of an ImportError.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

AUDITED_TORCH = ((2, 13),)


class PrivateTorchAccessError(RuntimeError):
    """A private torch name is used on a torch version nobody audited it on."""


def installed_torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def require_audited_torch(accessor: str, module: str = "harness/_torch_private.py") -> None:
    """Refuse a private access on a torch version it was not audited for; ``module`` is the
    audited file that asks (``suites/_torch_private.py`` shares this check)."""
    version = installed_torch_version()
    if version not in AUDITED_TORCH:
        audited = ", ".join(f"{a}.{b}" for a, b in AUDITED_TORCH)
        raise PrivateTorchAccessError(
            f"{module}:{accessor} reaches a private torch name audited for "
            f"torch {audited}, but torch {torch.__version__} is installed. Check that the name "
            f"still means the same thing in this version, then add it to AUDITED_TORCH."
        )


# --- process-group bookkeeping (no public API lists the live groups) -----------------


def live_process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process's c10d world knows, the default group included."""
    require_audited_torch("live_process_groups")
    from torch.distributed import distributed_c10d  # after the version check

    return list(distributed_c10d._world.pg_map.keys())


def registered_group_name(group: torch.distributed.ProcessGroup) -> str:
    """The name c10d registered ``group`` under.

    A Python ``ProcessGroup`` that a vendor's backend creator returns is used by c10d as the
    group itself, and its ``group_name`` property raises ("ProcessGroup name not set"); the
    name c10d gave it is only in its registry.
    """
    require_audited_torch("registered_group_name")
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.pg_names[group]


def iter_non_default_groups() -> Iterator[torch.distributed.ProcessGroup]:
    """Groups created after init_process_group (subgroups, DeviceMesh dims)."""
    default = torch.distributed.group.WORLD
    for group in live_process_groups():
        if group is not default:
            yield group


# --- thread ranks: a thread-local c10d world and thread-isolation mode (harness/threads) ---
#
# c10d keeps its process-group bookkeeping in one module-level object,
# ``distributed_c10d._world`` (an instance of the private ``_World``), and the C++ group
# registry that functional collectives resolve group names through is process-wide. N rank
# threads in one process therefore overwrite each other's default group unless (1) the
# Python world becomes per-thread and (2) the C++ registry is switched to per-thread
# ("thread isolation mode"). Both are private; this section is the only place that touches
# them. The replacement world falls back to the original one for every thread that is not
# bound to a private world, so the main thread (and any non-rank thread) keeps seeing the
# ordinary process-wide c10d state while it is installed.

# The properties of torch 2.13's ``_World``. If torch adds or removes one, the per-thread
# world below would silently share (or miss) state: refuse instead.
_AUDITED_C10D_WORLD_PROPERTIES = frozenset(
    {
        "default_pg",
        "pg_map",
        "pg_names",
        "pg_group_ranks",
        "pg_backend_config",
        "group_count",
        "tags_to_pg",
        "pg_to_tag",
        "pg_coalesce_state",
        "comms",
        "pg_config_info",
    }
)
# Stored per thread; ``pg_config_info`` is derived from them by ``_World`` itself.
_PER_THREAD_WORLD_FIELDS = tuple(sorted(_AUDITED_C10D_WORLD_PROPERTIES - {"pg_config_info"}))
_WRITABLE_WORLD_FIELDS = ("default_pg", "group_count")


class _RankC10dState:
    """One rank thread's c10d bookkeeping: the fields a fresh ``_World`` would hold."""

    def __init__(self) -> None:
        self.default_pg = None
        self.pg_map: dict = {}
        self.pg_names: dict = {}
        self.pg_group_ranks: dict = {}
        self.pg_backend_config: dict = {}
        self.group_count = 0
        self.tags_to_pg: dict = {}
        self.pg_to_tag: dict = {}
        self.pg_coalesce_state: dict = {}
        self.comms: list = []


_thread_world_lock = threading.Lock()
_installed_thread_world: object | None = None
_replaced_c10d_world: object | None = None
_thread_world_installs = 0
_autograd_multithreading_before = True


def _thread_local_world_class() -> type:
    from torch.distributed import distributed_c10d  # after the version check

    base = distributed_c10d._World
    found = {name for name, value in vars(base).items() if isinstance(value, property)}
    if found != _AUDITED_C10D_WORLD_PROPERTIES:
        raise PrivateTorchAccessError(
            "harness/_torch_private.py:install_thread_local_c10d_world: torch's c10d _World "
            f"now has properties {sorted(found)}, audited were "
            f"{sorted(_AUDITED_C10D_WORLD_PROPERTIES)}; re-audit the per-thread world."
        )

    def field(name: str) -> property:
        def get(self: Any) -> Any:
            return getattr(self._target(), name)

        def set_(self: Any, value: Any) -> None:
            setattr(self._target(), name, value)

        return property(get, set_ if name in _WRITABLE_WORLD_FIELDS else None)

    def init(self: Any, fallback: object) -> None:
        # ``_World.__init__`` is deliberately not called: all state lives in the targets.
        self._fallback = fallback
        self._local = threading.local()

    def target(self: Any) -> Any:
        return getattr(self._local, "state", None) or self._fallback

    namespace: dict = {"__init__": init, "_target": target}
    namespace.update({name: field(name) for name in _PER_THREAD_WORLD_FIELDS})
    return type("_ThreadLocalC10dWorld", (base,), namespace)


def install_thread_local_c10d_world() -> None:
    """Make c10d's world per-thread for bound threads (reference counted; see uninstall).

    Also disables autograd's device threads (a public switch) so that backward hooks that
    issue collectives run on the rank thread that owns the graph.
    """
    global _installed_thread_world, _replaced_c10d_world, _thread_world_installs
    global _autograd_multithreading_before
    require_audited_torch("install_thread_local_c10d_world")
    from torch.distributed import distributed_c10d  # after the version check

    with _thread_world_lock:
        if _thread_world_installs == 0:
            world = _thread_local_world_class()(distributed_c10d._world)
            _replaced_c10d_world = distributed_c10d._world
            distributed_c10d._world = world
            _installed_thread_world = world
            torch._C._distributed_c10d._set_thread_isolation_mode(True)
            _mirror_groups_into_thread_registry(_replaced_c10d_world)
            _autograd_multithreading_before = torch.autograd.is_multithreading_enabled()
            torch.autograd.set_multithreading_enabled(False)
        _thread_world_installs += 1


def uninstall_thread_local_c10d_world() -> None:
    """Undo one install; the last one restores c10d's world, isolation mode and autograd."""
    global _installed_thread_world, _replaced_c10d_world, _thread_world_installs
    require_audited_torch("uninstall_thread_local_c10d_world")
    from torch.distributed import distributed_c10d  # after the version check

    with _thread_world_lock:
        if _thread_world_installs == 0:
            raise RuntimeError("uninstall_thread_local_c10d_world without a matching install")
        _thread_world_installs -= 1
        if _thread_world_installs == 0:
            if distributed_c10d._world is not _installed_thread_world:
                # Someone replaced the world after us; restoring ours would clobber theirs.
                raise RuntimeError(
                    "c10d's world was replaced while the thread-local one was installed"
                )
            distributed_c10d._world = _replaced_c10d_world
            _installed_thread_world = _replaced_c10d_world = None
            _drop_mirrored_groups()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            torch.autograd.set_multithreading_enabled(_autograd_multithreading_before)


# Groups the installing thread already had, re-registered in its per-thread registry.
_mirrored: tuple[int, list[str]] | None = None


def _mirror_groups_into_thread_registry(world: Any) -> None:
    """Keep the installing thread's existing groups resolvable by name.

    In isolation mode each thread sees only its own registry, so a thread that created
    groups before the install (a main-thread gloo group used by DTensor) could no longer
    resolve them through functional collectives while the thread world is installed.
    """
    global _mirrored
    from torch.distributed import distributed_c10d  # after the version check

    names = []
    for group, name in list(world.pg_names.items()):
        distributed_c10d._register_process_group(name, group)
        names.append(name)
    _mirrored = (threading.get_ident(), names)


def _drop_mirrored_groups() -> None:
    # Still in isolation mode: only the installing thread's registry can be cleaned, and
    # only from that thread; elsewhere the entries are left (unused once isolation is off).
    global _mirrored
    from torch.distributed import distributed_c10d  # after the version check

    if _mirrored is not None and _mirrored[0] == threading.get_ident():
        for name in _mirrored[1]:
            distributed_c10d._unregister_process_group(name)
    _mirrored = None


def thread_local_c10d_world_installed() -> bool:
    require_audited_torch("thread_local_c10d_world_installed")
    from torch.distributed import distributed_c10d  # after the version check

    return _thread_world_installs > 0 and distributed_c10d._world is _installed_thread_world


def bind_thread_to_fresh_c10d_world() -> None:
    """Give the calling thread its own empty c10d world (needs the thread-local world)."""
    require_audited_torch("bind_thread_to_fresh_c10d_world")
    world = _installed_thread_world
    if world is None:
        raise RuntimeError("bind_thread_to_fresh_c10d_world needs install_thread_local_c10d_world")
    world._local.state = _RankC10dState()  # type: ignore[attr-defined]


def unbind_thread_c10d_world() -> None:
    """Drop the calling thread's private world; it sees the process-wide one again."""
    require_audited_torch("unbind_thread_c10d_world")
    world = _installed_thread_world
    if world is not None:
        world._local.state = None  # type: ignore[attr-defined]


# --- torch._dynamo, imported by DTensor's first call (harness/process/zygote.py) ----------------


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now, in the fork server, so that ranks forked later do not pay.

    DTensor's entry points (``distribute_tensor``, ``DTensor.from_local``, ...) are wrapped
    by torch's private ``_disable_dynamo``, which imports ``torch._dynamo`` at their first
    call: 0.6 s of CPU in every rank of every new pool [measured 2026-11-24], 2.5 s of wall
    for a pool of 8 ranks on 2 cores. The import starts no thread.
    """
    require_audited_torch("import_dynamo")
    import torch._dynamo  # noqa: F401  (after the version check)


# --- DTensor caches that outlive the process groups they name (harness/rank/hygiene.py) ----------
#
# DeviceMesh compares and hashes by value (ranks, layout, device type, dim names), not by
# the process groups behind it. DTensor's sharding propagation caches its results keyed by
# the input specs, meshes included, and a cached result carries the *mesh object* it was
# computed with. After the harness destroys the groups a test created, the next test on
# the same warm rank builds an equal mesh with new groups, hits the cache, and gets back a
# DTensor on the old mesh, whose group names no longer resolve ("Could not resolve the
# process group registered under the name 3"). The cache that does this is the C++ fast
# path's, and it is per thread: it must be cleared on the thread that ran the test, and on
# the autograd engine's device threads, which run backward for accelerator tensors.


def forget_dtensor_caches(device_type: str = "cpu") -> bool:
    """Drop every DTensor cache that can hold a mesh; False if DTensor was never imported.

    Clears the calling thread's fast-path cache and the process-wide Python caches; with an
    accelerator ``device_type`` also the fast-path cache of the autograd device thread
    that runs backward on this rank's device.
    """
    require_audited_torch("forget_dtensor_caches")
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute  # as above

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    if device_type != "cpu" and torch.autograd.is_multithreading_enabled():
        _clear_fast_path_cache_on_device_thread(device_type)
    return True


class _ClearFastPathCacheInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch._C._clear_DTensor_sharding_propagator_cache()
        return grad


def _clear_fast_path_cache_on_device_thread(device_type: str) -> None:
    # The engine runs a node on the worker thread of its gradient's device, so a backward
    # through one element on this rank's current device reaches that thread's cache.
    if not torch.accelerator.is_available():
        return
    device = torch.device(device_type, torch.accelerator.current_device_index())
    leaf = torch.zeros(1, device=device, requires_grad=True)
    _ClearFastPathCacheInBackward.apply(leaf).sum().backward()


def dtensor_fast_path_cache_stats() -> tuple[int, int]:
    """(hits, misses) of the calling thread's DTensor fast-path sharding cache (for tests)."""
    require_audited_torch("dtensor_fast_path_cache_stats")
    return tuple(torch._C._get_DTensor_sharding_propagator_cache_stats())  # type: ignore[return-value]


# --- functional collectives (harness/comm/intercept.py) ---------------------------------------
#
# Functional collectives are ops in the ``_c10d_functional`` family of ``torch.ops``
# namespaces. Python callers (DTensor's redistribute, the funcol API, FSDP) call them through
# the namespace's op packets, looked up on every call, so replacing a packet on its
# namespace sees those calls from any thread, backward hooks included. Calls that bypass
# the packets (an overload such as ``.default`` held by C++ or by traced code) are seen only
# at the dispatcher, by a ``TorchDispatchMode``: torch keeps that class in a private module.


def torch_dispatch_mode_class() -> type:
    """torch's ``TorchDispatchMode`` base class (no public import path in 2.13)."""
    require_audited_torch("torch_dispatch_mode_class")
    from torch.utils._python_dispatch import TorchDispatchMode  # after the version check

    return TorchDispatchMode


def functional_collective_packets(
    namespaces: tuple[str, ...], names: tuple[str, ...]
) -> list[tuple[Any, str, Any]]:
    """(namespace object, op name, op packet) for every functional collective that exists.

    The packet is read from the namespace's own ``__dict__`` when there, so a replacement
    installed earlier is returned as it is rather than looked through.
    """
    require_audited_torch("functional_collective_packets")
    found = []
    for namespace_name in namespaces:
        namespace = getattr(torch.ops, namespace_name)
        for name in names:
            packet = vars(namespace).get(name)
            if packet is None:
                try:
                    packet = getattr(namespace, name)
                except (AttributeError, RuntimeError):
                    continue  # not registered in this namespace
            found.append((namespace, name, packet))
    return found
