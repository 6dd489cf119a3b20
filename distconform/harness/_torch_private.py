"""The one audited place where the harness touches private PyTorch names.

Every accessor here exists because torch has no public API for what the harness needs.
Each one has an :class:`~distconform.harness.torch_window.Audit` in ``AUDITS``: what it reads, and
what reading each release of the supported window (``harness/torch_window.py``) found. It calls
:func:`require_audited_torch` first, which refuses a torch outside the window, or a release its
audit does not cover, with the window named; ``tests/harness/test_torch_private.py`` exercises every
accessor and the refusal.

Nothing else in ``harness/`` may import a private torch module or touch an
underscore attribute of torch. torch's internal testing package is never imported here:
only ``harness/adopt/_torch_test_harness.py`` reads it, to run tests written for it
(``--dist-adopt``), with its own audits.
The private modules are imported inside the accessors, after the version check, so that
another torch version gets the audit's message instead of an ImportError.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from distconform.harness import torch_window
from distconform.harness.torch_window import (
    V2_11,
    V2_12,
    V2_13,
    V2_14,
    V2_15,
    Audit,
    PrivateTorchAccessError,
    Version,
)

MODULE = "harness/_torch_private.py"

#: One audit per accessor (``file:line`` are in that release's ``torch/`` directory).
AUDITS: dict[str, Audit] = {}


def require_audited_torch(accessor: str) -> None:
    """Refuse ``accessor`` unless the installed torch is in the window and in its audit."""
    torch_window.require_audited(AUDITS, accessor, MODULE)


# --- process-group bookkeeping (no public API lists the live groups) -----------------


AUDITS["live_process_groups"] = Audit(
    reads="distributed_c10d._world (the module's one _World) and its pg_map property: a dict "
    "keyed by every live ProcessGroup of this process, the default group included.",
    versions={
        V2_11: "same: _World distributed_c10d.py:614-743 identical to 2.13's; pg_map :644",
        V2_12: "same: _World :629-758 identical; pg_map :659, _world :761",
        V2_13: "same: pg_map :703, _world :805 (the audited baseline)",
        V2_14: "same: _World :1222-1353 differs in annotations only; pg_map :1252",
        V2_15: "same: pg_map :1406, _world :1521 (a 12th property, see the thread world)",
    },
)


def live_process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process's c10d world knows, the default group included."""
    require_audited_torch("live_process_groups")
    from torch.distributed import distributed_c10d  # after the version check

    return list(distributed_c10d._world.pg_map.keys())


AUDITS["registered_group_name"] = Audit(
    reads="distributed_c10d._world.pg_names[group]: the name c10d registered the group under "
    "(a dict ProcessGroup -> group name).",
    versions={
        V2_11: "same: pg_names property :657",
        V2_12: "same: :672",
        V2_13: "same: :716 (baseline)",
        V2_14: "same: :1265",
        V2_15: "same: :1419",
    },
)


def registered_group_name(group: torch.distributed.ProcessGroup) -> str:
    """The name c10d registered ``group`` under.

    A Python ``ProcessGroup`` that a vendor's backend creator returns is used by c10d as the
    group itself, and its ``group_name`` property raises ("ProcessGroup name not set"); the
    name c10d gave it is only in its registry.
    """
    require_audited_torch("registered_group_name")
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.pg_names[group]


AUDITS["process_group_count"] = Audit(
    reads="distributed_c10d._world.group_count: the counter _process_group_name turns into the "
    "next numbered group's name (str(group_count)), the key prefix of that group's rendezvous "
    "in the default group's store.",
    versions={
        V2_11: "same: group_count property :687; incremented for numbered names only :5174",
        V2_12: "same: property :702; numbered names only :5374",
        V2_13: "same: property :746; numbered names only :5493 (baseline)",
        V2_14: "changed: property :1297; incremented for hashed names too :6527 (the hashed "
        "name's salt), so ranks that create a group by local synchronisation diverge",
        V2_15: "same as 2.14: property :1451; both paths :6770",
    },
)


def process_group_count() -> int:
    """How many groups this process's c10d world has numbered so far: the next numbered
    group is named after it, on every rank alike only while the counts are equal."""
    require_audited_torch("process_group_count")
    from torch.distributed import distributed_c10d

    return distributed_c10d._world.group_count


AUDITS["iter_non_default_groups"] = Audit(
    reads="public dist.group.WORLD, which _WorldMeta.WORLD reads from _world.default_pg, and "
    "live_process_groups; relies on WORLD being the same object as the default pg_map key.",
    versions={
        V2_11: "same: _WorldMeta :750-764 identical to 2.13's",
        V2_12: "same: :765-779",
        V2_13: "same (baseline)",
        V2_14: "same: :1360-1374, a '-> None' annotation added",
        V2_15: "same: :1525-1539",
    },
)


def iter_non_default_groups() -> Iterator[torch.distributed.ProcessGroup]:
    """Groups created after init_process_group (subgroups, DeviceMesh dims)."""
    require_audited_torch("iter_non_default_groups")  # now, not at the first next()
    default = torch.distributed.group.WORLD
    return iter([group for group in live_process_groups() if group is not default])


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

# The properties of c10d's ``_World`` in each audited release. If torch adds or removes one,
# the per-thread world below would silently share (or miss) state: refuse instead.
_C10D_WORLD_PROPERTIES_2_11_TO_2_14 = frozenset(
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
_AUDITED_C10D_WORLD_PROPERTIES: dict[Version, frozenset[str]] = {
    V2_11: _C10D_WORLD_PROPERTIES_2_11_TO_2_14,
    V2_12: _C10D_WORLD_PROPERTIES_2_11_TO_2_14,
    V2_13: _C10D_WORLD_PROPERTIES_2_11_TO_2_14,
    V2_14: _C10D_WORLD_PROPERTIES_2_11_TO_2_14,
    # torch 2.15 keeps each group's flight-recorder hook handle in the world and pops it on
    # every destroy, so a rank thread needs its own dict of them.
    V2_15: _C10D_WORLD_PROPERTIES_2_11_TO_2_14 | {"pg_flight_recorder_hooks"},
}
# Computed by ``_World`` itself from the other properties: never stored per thread.
_DERIVED_WORLD_PROPERTIES = frozenset({"pg_config_info"})
_WRITABLE_WORLD_FIELDS = ("default_pg", "group_count")
# The value a fresh ``_World`` starts each stored field with, in every audited release.
_FRESH_WORLD_FIELDS: dict[str, Callable[[], Any]] = {
    "default_pg": lambda: None,
    "pg_map": dict,
    "pg_names": dict,
    "pg_group_ranks": dict,
    "pg_backend_config": dict,
    "group_count": lambda: 0,
    "tags_to_pg": dict,
    "pg_to_tag": dict,
    "pg_coalesce_state": dict,
    "comms": list,
    "pg_flight_recorder_hooks": dict,
}


def _per_thread_world_fields(version: Version) -> tuple[str, ...]:
    """The ``_World`` properties a rank thread keeps its own value of, on torch ``version``."""
    return tuple(sorted(_AUDITED_C10D_WORLD_PROPERTIES[version] - _DERIVED_WORLD_PROPERTIES))


class _RankC10dState:
    """One rank thread's c10d bookkeeping: the fields a fresh ``_World`` would hold."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        for name in fields:
            setattr(self, name, _FRESH_WORLD_FIELDS[name]())


_thread_world_lock = threading.Lock()
_installed_thread_world: object | None = None
_replaced_c10d_world: object | None = None
_thread_world_installs = 0
_autograd_multithreading_before = True


def _thread_local_world_class() -> type:
    from torch.distributed import distributed_c10d  # after the version check

    version = torch_window.installed_torch_version()
    audited = _AUDITED_C10D_WORLD_PROPERTIES[version]
    base = distributed_c10d._World
    found = {name for name, value in vars(base).items() if isinstance(value, property)}
    if found != audited:
        raise PrivateTorchAccessError(
            f"{MODULE}:install_thread_local_c10d_world: torch {torch.__version__}'s c10d _World "
            f"has properties {sorted(found)}, audited for torch {version[0]}.{version[1]} were "
            f"{sorted(audited)}; re-audit the per-thread world."
        )
    fields = _per_thread_world_fields(version)

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

    namespace: dict = {"__init__": init, "_target": target, "_per_thread_fields": fields}
    namespace.update({name: field(name) for name in fields})
    return type("_ThreadLocalC10dWorld", (base,), namespace)


_THREAD_WORLD_READS = (
    "distributed_c10d._World (subclassed; its property set must be the audited one and its "
    "__init__ is not called) and _world (replaced); relies on torch reaching world state only "
    "through those properties, only default_pg and group_count being settable"
)

AUDITS["install_thread_local_c10d_world"] = Audit(
    reads=_THREAD_WORLD_READS + "; also _set_thread_isolation_mode(bool) and "
    "_register_process_group(name, group), C++ bindings, and _world.pg_names.",
    versions={
        V2_11: "same: _World and its 11 properties identical to 2.13's, setters :639/:696, "
        "no _world._x access in torch/; both bindings in the binary (_distributed_c10d.pyi:750)",
        V2_12: "same: _World identical; imports distributed_c10d.py:27/:30; isolation used by "
        "testing/_internal/common_distributed.py:1333",
        V2_13: "same: 11 properties, setters default_pg and group_count (baseline)",
        V2_14: "same: the 11 properties differ in annotations only; setters :1247/:1306",
        V2_15: "differs: a 12th property pg_flight_recorder_hooks (:1480), read and popped on "
        "every destroy (:3290, :3333); the thread world keeps a per-thread dict of it, as "
        "torch's own multi_threaded_pg.py:649 does",
    },
)


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


AUDITS["uninstall_thread_local_c10d_world"] = Audit(
    reads="distributed_c10d._world (restored), _set_thread_isolation_mode(False) and "
    "_unregister_process_group(name), a C++ binding re-exported by distributed_c10d.",
    versions={
        V2_11: "same: import distributed_c10d.py:30, stub _distributed_c10d.pyi:762",
        V2_12: "same: import :30",
        V2_13: "same: import :30 (baseline)",
        V2_14: "same: import :43",
        V2_15: "same: import :41",
    },
)


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


_THREAD_BINDING_VERSIONS = {
    V2_11: "same: only the identity of distributed_c10d._world is read",
    V2_12: "same",
    V2_13: "same (baseline)",
    V2_14: "same",
    V2_15: "same; a fresh rank state also holds pg_flight_recorder_hooks (see install)",
}

AUDITS["thread_local_c10d_world_installed"] = Audit(
    reads="the identity of distributed_c10d._world (is it the installed thread world?).",
    versions=_THREAD_BINDING_VERSIONS,
)


def thread_local_c10d_world_installed() -> bool:
    require_audited_torch("thread_local_c10d_world_installed")
    from torch.distributed import distributed_c10d  # after the version check

    return _thread_world_installs > 0 and distributed_c10d._world is _installed_thread_world


AUDITS["bind_thread_to_fresh_c10d_world"] = Audit(
    reads="no torch name itself: it gives the calling thread a fresh copy of the per-thread "
    "_World fields the installed torch's audit lists.",
    versions=_THREAD_BINDING_VERSIONS,
)


def bind_thread_to_fresh_c10d_world() -> None:
    """Give the calling thread its own empty c10d world (needs the thread-local world)."""
    require_audited_torch("bind_thread_to_fresh_c10d_world")
    world = _installed_thread_world
    if world is None:
        raise RuntimeError("bind_thread_to_fresh_c10d_world needs install_thread_local_c10d_world")
    world._local.state = _RankC10dState(world._per_thread_fields)  # type: ignore[attr-defined]


AUDITS["unbind_thread_c10d_world"] = Audit(
    reads="no torch name itself: the calling thread sees the process-wide _World again.",
    versions=_THREAD_BINDING_VERSIONS,
)


def unbind_thread_c10d_world() -> None:
    """Drop the calling thread's private world; it sees the process-wide one again."""
    require_audited_torch("unbind_thread_c10d_world")
    world = _installed_thread_world
    if world is not None:
        world._local.state = None  # type: ignore[attr-defined]


# --- the timeout of groups a test creates without one (harness/rank/execute.py) --------------
#
# The harness sets the per-test ``pg_timeout`` on the default group only. Every group a test
# (or the implementation under test, or DeviceMesh) creates without a timeout of its own gets
# c10d's module default instead: 30 minutes for gloo, 10 for NCCL. A rank stuck in such a
# group's rendezvous or collective then never raises before the parent's deadline, and its
# peers' errors (reactions, not causes) leave it running until it is killed (issue 52). No
# public API sets that default: ``distributed_c10d`` copies ``default_pg_timeout`` and
# ``default_pg_nccl_timeout`` from ``constants`` at import and reads its own copies.


AUDITS["bound_default_group_timeout"] = Audit(
    reads="distributed_c10d's module globals default_pg_timeout and default_pg_nccl_timeout "
    "(its own names, bound by 'from .constants import ...'), which _get_default_timeout(backend) "
    "reads at every call: the timeout of each group created with timeout=None, by "
    "_new_group_with_tag (new_group, new_subgroups*, DeviceMesh's dimension groups), "
    "split_group, init_process_group and monitored_barrier. Relies on no other reader: "
    "_create_process_group_wrapper's default argument is bound at import, and its callers "
    "pass the group's timeout.",
    versions={
        V2_11: "same: import :56, _get_default_timeout :777-790 identical to 2.13's; called by "
        "init_process_group :1788, monitored_barrier :5103, split_group :5296, "
        "_new_group_with_tag :5493; default argument only at :5127",
        V2_12: "same: import :56, _get_default_timeout :792-805 identical to 2.13's; calls "
        ":1805, :5303, :5504, :5718; default argument only at :5327",
        V2_13: "same: import :56, _get_default_timeout :836-849; calls :1849, :5422, :5665, "
        ":5983; default argument only at :5446 (baseline)",
        V2_14: "same: import :73, _get_default_timeout :1387-1400 (NCCL also matched as "
        "nccl-legacy, nccl2, nccl-lazy); calls :2502, :6445, :6732, :6955; default argument "
        "only at :6468",
        V2_15: "same as 2.14: import :73, _get_default_timeout :1552-1565; calls :2670, "
        ":6688, :6964, :7190; default argument only at :6711",
    },
)


class _BoundDefaultGroupTimeout:
    """Lowers c10d's default group timeouts to at most ``timeout`` until the block ends."""

    _NAMES = ("default_pg_timeout", "default_pg_nccl_timeout")

    def __init__(self, c10d: Any, timeout: timedelta) -> None:
        self._c10d = c10d
        self._timeout = timeout
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> None:
        for name in self._NAMES:
            value = getattr(self._c10d, name)
            self._saved[name] = value
            # default_pg_nccl_timeout is None in a build without NCCL: left as it is.
            if isinstance(value, timedelta) and value > self._timeout:
                setattr(self._c10d, name, self._timeout)

    def __exit__(self, *exc_info: object) -> None:
        for name, value in self._saved.items():
            setattr(self._c10d, name, value)
        self._saved.clear()


def bound_default_group_timeout(timeout: timedelta) -> contextlib.AbstractContextManager[None]:
    """A context in which a group created without a timeout gets at most ``timeout``.

    For a rank that owns its process (the process launcher's, torchrun's): the defaults are
    process-wide, so rank threads sharing a process must not each set and restore them.
    A timeout the caller passes explicitly is never changed.
    """
    require_audited_torch("bound_default_group_timeout")
    from torch.distributed import distributed_c10d  # after the version check

    return _BoundDefaultGroupTimeout(distributed_c10d, timeout)


# --- torch._dynamo, imported by DTensor's first call (harness/rank/zygote.py) ----------------


AUDITS["import_dynamo"] = Audit(
    reads="import torch._dynamo; relies on DTensor's constructor being wrapped by "
    "torch._disable_dynamo, which imports torch._dynamo lazily at its first call.",
    versions={
        V2_11: "same: _compile.py:17-60 identical to 2.13's; @torch._disable_dynamo on "
        "DTensor.__init__ at distributed/tensor/_api.py:316",
        V2_12: "same: _compile.py identical; _api.py:337",
        V2_13: "same: _compile.py:47 imports lazily; _api.py:337 (baseline)",
        V2_14: "same: _api.py:403",
        V2_15: "same: _api.py:403",
    },
)


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


AUDITS["forget_dtensor_caches"] = Audit(
    reads="the C++ _clear_DTensor_sharding_propagator_cache(), DTensor._op_dispatcher"
    ".sharding_propagator's propagate_op_sharding and _propagate_tensor_meta_cached lru "
    "caches, _redistribute._gen_transform_infos and clear_redistribute_planner_cache(), "
    "_collective_utils.MeshTopoInfo.build_from_mesh's cache; relies on these being every "
    "cache that can hold a mesh.",
    versions={
        V2_11: "same: _api.py:296, _dispatch.py:139, _sharding_prop.py:108-135/:370 and "
        "_redistribute.py:1435/:625 identical to 2.13's; binding in _C/__init__.pyi:12179",
        V2_12: "same: _sharding_prop.py:174/387/551, _redistribute.py:1488/653, "
        "_collective_utils.py:298; binding used by tensor/debug/__init__.py:47",
        V2_13: "same: the cache set found by grep of distributed/tensor (baseline)",
        V2_14: "same: _sharding_prop.py:172/385/579, _collective_utils.py:346; "
        "_gen_transform_infos :1575 rewrapped only",
        V2_15: "same as 2.14: _collective_utils.py:334; the grep finds the same cache set",
    },
)


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


AUDITS["dtensor_fast_path_cache_stats"] = Audit(
    reads="the C++ _get_DTensor_sharding_propagator_cache_stats(): (hits, misses) of the "
    "calling thread's DTensor fast-path sharding cache.",
    versions={
        V2_11: "same: _C/__init__.pyi:12178 returns tuple[int, int]",
        V2_12: "same: used by distributed/tensor/debug/__init__.py:29",
        V2_13: "same: debug/__init__.py:29 (baseline)",
        V2_14: "same: debug/__init__.py:29",
        V2_15: "same: debug/__init__.py:29",
    },
)


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


AUDITS["torch_dispatch_mode_class"] = Audit(
    reads="torch.utils._python_dispatch.TorchDispatchMode, subclassed with __torch_dispatch__"
    "(func, types, args, kwargs) and supports_higher_order_operators = True.",
    versions={
        V2_11: "same: class body _python_dispatch.py:70-265 identical to 2.13's; the flag is "
        "read at _ops.py:418",
        V2_12: "same: :70-265",
        V2_13: "same: class at _python_dispatch.py:72; flag read at _ops.py:428 (baseline)",
        V2_14: "same: :72-267; flag read at _ops.py:433",
        V2_15: "same: :72-267; still no public import path",
    },
)


def torch_dispatch_mode_class() -> type:
    """torch's ``TorchDispatchMode`` base class (no public import path in torch 2.11 to 2.15)."""
    require_audited_torch("torch_dispatch_mode_class")
    from torch.utils._python_dispatch import TorchDispatchMode  # after the version check

    return TorchDispatchMode


AUDITS["functional_collective_packets"] = Audit(
    reads="torch.ops._c10d_functional, _c10d_functional_autograd and c10d_functional "
    "namespaces and their instance __dict__, where _OpNamespace.__getattr__ caches packets; "
    "relies on callers looking the packet up on every call.",
    versions={
        V2_11: "differs, benign: isend/irecv are not registered, so they are skipped (20 "
        "packets, not 22) and 2.11 has no funcol API that issues them; group_name is typed str",
        V2_12: "same op set as 2.13: _functional_collectives_impl.py:121/125 call isend/irecv",
        V2_13: "same: _OpNamespace.__getattr__ (_ops.py:1377) caches in __dict__ (baseline)",
        V2_14: "same: op names as 2.13; _ops.py:1448-1482 identical",
        V2_15: "same names; funcol may now pass a ReduceOp as reduce_op "
        "(_functional_collectives.py:684), which records.reduce_op_name already maps",
    },
)


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


# --- device plug-ins (harness/devices) ---------------------------------------------------------


AUDITS["register_device_module"] = Audit(
    reads="torch._register_device_module(device_type, module): makes `module` torch's runtime "
    "module of a device type (torch.<type>, sys.modules['torch.<type>']), which "
    "torch.get_device_module, torch.accelerator and FSDP2's device handle look up; raises if "
    "one is registered already.",
    versions={
        V2_11: "same: torch/__init__.py:2767, the body identical to 2.13's",
        V2_12: "same: torch/__init__.py:2801, identical",
        V2_13: "same: torch/__init__.py:2848 (baseline)",
        V2_14: "same: torch/__init__.py:3292, type annotations added only",
        V2_15: "same: torch/__init__.py:3347, type annotations added only",
    },
)


def register_device_module(device_type: str, module: Any) -> None:
    """Register ``module`` as ``torch.<device_type>`` (a PrivateUse1 device's Python side);
    no public API does this, and a device that lacks it is unusable by FSDP2 and DeviceMesh."""
    require_audited_torch("register_device_module")
    if getattr(torch, device_type, None) is module:
        return  # this process registered it already
    torch._register_device_module(device_type, module)
