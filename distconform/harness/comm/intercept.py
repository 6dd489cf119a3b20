"""Seeing every collective a rank issues, through public interception points only.

Four paths feed one chain of interceptors (tracers, recorders, injectors):

- the public collectives of ``torch.distributed`` (``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ``broadcast``, ``send``, ``barrier``...) are wrapped, in
  ``torch.distributed`` and in ``torch.distributed.distributed_c10d`` (whose functions
  call each other), while any interceptor is active: reference counted, restored when
  the last one exits. ``ProcessGroup.send``/``recv``/``recv_anysource`` are wrapped the
  same way, which is where ``isend``/``irecv`` and ``batch_isend_irecv`` end up (the
  functions themselves are not wrapped: ``P2POp`` checks their identity);
- the functional collective ops' packets on their ``torch.ops`` namespaces are replaced
  the same way (harness/_torch_private.py): DTensor's redistribute and ``full_tensor``,
  the funcol API and FSDP call them through the namespace. These two paths see calls
  from forward, from autograd hooks and custom ``Function.backward`` on any thread, and
  from the optimizer, and cost nothing to other torch calls: the always-on flight
  recorder uses only them;
- interceptors that ask for it (``dispatch=True``) also push a ``TorchDispatchMode``,
  which sees a functional collective however it was called (an overload such as
  ``.default`` held by C++ or traced code). Unlike a torch function mode, a dispatch mode
  stays active inside the autograd engine, device threads included. It is opt-in: it
  costs a few microseconds per torch op.
  Interceptors with ``functional=True`` (the tracer's default) push a
  ``torch.overrides.TorchFunctionMode``, for ``torch.distributed`` functions called
  through a reference taken before the wrapping;
- on the thread launcher, the threaded backend's listener (harness/threads/observe.py)
  reports what the backend executes, backward included.

A call is handled once, by the outermost path that sees it: while one path handles it
(``_state.handling``), the others pass it through untouched. Interceptors entered on a
thread-launcher rank thread see only that thread's calls (the wrappers are
process-global, so they look the rank up); interceptors entered anywhere else see every
thread of the process, so that autograd's device threads are covered on process ranks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from distconform.harness import _torch_private
from distconform.harness.comm.records import (
    DIST_FUNCTIONS,
    FUNCTIONAL_NAMESPACES,
    FUNCTIONAL_OPS,
    RECV,
    SEND,
    THREADED_OPS,
    WRAPPED_FUNCTIONS,
    RawCall,
    bind_dist_call,
    bind_functional_call,
    dtype_name,
    functional_op_name,
    site_and_phase,
)
from distconform.harness.threads.observe import add_collective_listener
from distconform.harness.threads.world import current_rank as thread_rank

Proceed = Callable[[], Any]
_WRAPPER_MARK = "_distconform_comm_original"


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.interceptors: list[Interceptor] = []
        self.handling = 0  # > 0 while an interceptor chain is handling a call


_state = _ThreadState()
_process_interceptors: tuple[Interceptor, ...] = ()  # replaced, never mutated
_registry_lock = threading.Lock()


def _on_thread_launcher_rank() -> bool:
    return thread_rank() is not None


def _interceptors_here() -> list[Interceptor] | tuple[Interceptor, ...]:
    return _state.interceptors or _process_interceptors


class Interceptor:
    """Sees, and may wrap, every collective issued while it is entered.

    Subclasses implement :meth:`handle`: called before the collective is issued, it must
    call ``proceed()`` exactly once and return its value. ``functional`` adds the torch
    function mode path, ``dispatch`` the dispatch mode path (see the module docstring).
    """

    functional = True
    dispatch = False
    _released = True  # until entered

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Interceptor:
        global _process_interceptors
        self._released = False
        self._thread_local = _on_thread_launcher_rank()
        if self._thread_local:
            _state.interceptors.append(self)
        else:
            with _registry_lock:
                _process_interceptors = (*_process_interceptors, self)
        _acquire_wrappers()
        self._modes = ((_CollectiveMode(),) if self.functional else ()) + (
            (_dispatch_mode(),) if self.dispatch else ()
        )
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        global _process_interceptors
        try:
            for mode in reversed(self._modes):
                mode.__exit__(*exc)
        finally:
            if self._thread_local:
                if self in _state.interceptors:
                    _state.interceptors.remove(self)
            else:
                with _registry_lock:
                    _process_interceptors = tuple(i for i in _process_interceptors if i is not self)
            self._release()

    def abandon(self) -> None:
        """Give up an interceptor whose thread will never exit it (a hung rank thread).

        Called from another thread: the wrappers are released as if it had exited, and it
        sees no further call. Its thread's modes cannot be popped from here; they pass
        every call through.
        """
        self._release()

    def _release(self) -> None:
        with _registry_lock:
            if self._released:
                return
            self._released = True
        _release_wrappers()


def _run_chain(raw: RawCall, final: Proceed) -> Any:
    """Every interceptor here, innermost first, around ``final``.

    Built from partials rather than nested functions: a failing collective's traceback
    then shows one frame per interceptor, not three.
    """
    proceed = final
    for interceptor in _interceptors_here():
        if not interceptor._released:
            proceed = functools.partial(interceptor.handle, raw, proceed)
    _state.handling += 1
    try:
        return proceed()
    finally:
        _state.handling -= 1


# --- the torch function mode ---------------------------------------------------------------

_MISSING = object()
_classified: dict[Any, tuple[str, bool] | None] = {}
_dist_function_names = {getattr(c10d, name): name for name in DIST_FUNCTIONS}


def _classify(func: Any) -> str | None:
    """The ``torch.distributed`` name of a collective function, None for anything else.

    Functional collectives are left to the op packets and the dispatch mode, which see
    them in backward too. Cached per function.
    """
    try:
        found = _classified.get(func, _MISSING)
    except TypeError:  # an unhashable callable is no collective we know
        return None
    if found is _MISSING:
        found = _classified[func] = _dist_function_names.get(getattr(func, _WRAPPER_MARK, func))
    return found  # type: ignore[return-value]


class _CollectiveMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _classify(func) if not _state.handling else None
        if name is None or not _interceptors_here():
            return func(*args, **kwargs)
        raw = bind_dist_call(name, func, args, kwargs)
        return _run_chain(raw, functools.partial(func, *args, **kwargs))


_dispatch_mode_class: type | None = None
_functional_ops_seen: dict[Any, str | None] = {}


def _functional_name(func: Any) -> str | None:
    found = _functional_ops_seen.get(func, _MISSING)
    if found is _MISSING:
        found = _functional_ops_seen[func] = functional_op_name(func)
    return found  # type: ignore[return-value]


def _dispatch_mode() -> Any:
    """A fresh dispatch mode that hands functional collectives to the chain."""
    global _dispatch_mode_class
    if _dispatch_mode_class is None:
        base = _torch_private.torch_dispatch_mode_class()

        def torch_dispatch(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                # Let DTensor run first, with this mode still active, so the collectives
                # its redistribution issues come back through here. (Other types, plain
                # tensors included, are run as they are.)
                return NotImplemented
            # Higher-order operators arrive here too; no functional name, so they run as is.
            name = _functional_name(func) if not _state.handling else None
            if name is None or not _interceptors_here():
                return func(*args, **kwargs)
            raw = bind_functional_call(name, args, kwargs)
            return _run_chain(raw, functools.partial(func, *args, **kwargs))

        _dispatch_mode_class = type(
            "_CollectiveDispatchMode",
            (base,),
            {"__torch_dispatch__": torch_dispatch, "supports_higher_order_operators": True},
        )
    return _dispatch_mode_class()


# --- process-wide hooks: the wrapped functions and the threaded listener --------------------

_hooks_lock = threading.Lock()
_hooks_users = 0
_originals: dict[tuple[Any, str], Callable[..., Any]] = {}
_wrappers: dict[tuple[Any, str], Callable[..., Any]] = {}
_listener_handle: Any = None
_PATCHED_MODULES = (dist, c10d)


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def seen_by_interceptors(*args: Any, **kwargs: Any) -> Any:
        if _state.handling or not _interceptors_here():
            return original(*args, **kwargs)
        raw = bind_dist_call(name, original, args, kwargs)
        return _run_chain(raw, functools.partial(original, *args, **kwargs))

    setattr(seen_by_interceptors, _WRAPPER_MARK, original)
    return seen_by_interceptors


_wrapper_cache: dict[Any, Any] = {}


def _wrapper_of(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    # Built once per function: every test on a process rank installs the wrappers anew.
    key = (name, original)
    if key not in _wrapper_cache:
        _wrapper_cache[key] = _wrap(name, original)
    return _wrapper_cache[key]


def _on_threaded_collective(record: Any) -> None:
    if _state.handling or not _interceptors_here():
        return
    site, phase = site_and_phase()
    raw = RawCall(
        kind=THREADED_OPS.get(record.op, record.op),
        api=f"threaded.{record.op}",
        group=record.group_name,
        inputs=(),
        out_numel=record.out_numel,
        out_nbytes=record.out_nbytes,
        site=site,
        auto_phase=phase,
        group_ranks=record.group_ranks,
        shapes=record.shapes,
        dtypes=tuple(dtype_name(d) for d in record.dtypes),
        numel=record.numel,
        nbytes=record.nbytes,
    )
    _run_chain(raw, lambda: None)


class _SeenFunctionalOp:
    """Stands in for one functional collective's op packet on its ``torch.ops`` namespace.

    Calls go through the interceptor chain; every attribute (``.default``, the schema)
    is the packet's own, so code that inspects the op sees the real one.
    """

    def __init__(self, name: str, packet: Any) -> None:
        self._name = name
        self._packet = packet
        setattr(self, _WRAPPER_MARK, packet)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # While torch.compile traces, the op must reach the graph as itself.
        if torch.compiler.is_compiling() or _state.handling or not _interceptors_here():
            return self._packet(*args, **kwargs)
        raw = bind_functional_call(self._name, args, kwargs)
        return _run_chain(raw, functools.partial(self._packet, *args, **kwargs))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._packet, attr)

    # Code that collects packets from the namespace while this stands in (CommDebugMode's
    # registry) must still find the real packet an op reports as its ``_overloadpacket``.
    def __eq__(self, other: object) -> bool:
        return other is self or other is self._packet

    def __hash__(self) -> int:
        return hash(self._packet)

    def __repr__(self) -> str:
        return repr(self._packet)

    def __str__(self) -> str:
        return str(self._packet)


def _point_to_point(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``ProcessGroup`` send/recv method that reports the call (peer as a global rank)."""
    kind = SEND if method == "send" else RECV

    def seen_by_interceptors(group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if _state.handling or not _interceptors_here():
            return original(group, tensors, *args, **kwargs)
        tensors = list(tensors)
        group_peer = None if method == "recv_anysource" else (args[0] if args else None)
        peer = None if group_peer is None else _global_rank(group, group_peer)
        site, phase = site_and_phase()
        raw = RawCall(
            kind=kind,
            api=f"ProcessGroup.{method}",
            group=group,
            inputs=tensors if kind == SEND else [],
            out_numel=0 if kind == SEND else sum(t.numel() for t in tensors),
            out_nbytes=0 if kind == SEND else sum(t.numel() * t.element_size() for t in tensors),
            site=site,
            auto_phase=phase,
            peer=peer,
        )
        return _run_chain(raw, functools.partial(original, group, tensors, *args, **kwargs))

    functools.update_wrapper(seen_by_interceptors, original)
    setattr(seen_by_interceptors, _WRAPPER_MARK, original)
    return seen_by_interceptors


_POINT_TO_POINT_METHODS = ("send", "recv", "recv_anysource")


def _global_rank(group: Any, group_rank: int) -> int:
    try:
        return dist.get_global_rank(group, group_rank)
    except (ValueError, RuntimeError):  # a group c10d does not know: keep its own numbering
        return group_rank


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for everything wrapped while an interceptor is active."""
    patches: list[tuple[Any, str, Any]] = []
    wrappers = {name: _wrapper_of(name, getattr(c10d, name)) for name in WRAPPED_FUNCTIONS}
    for module in _PATCHED_MODULES:
        patches.extend((module, name, wrapper) for name, wrapper in wrappers.items())
    for method in _POINT_TO_POINT_METHODS:
        # The class's own attribute (pybind's method descriptor) is what gets restored;
        # the callable it gives is what the wrapper calls.
        original = getattr(dist.ProcessGroup, method)
        # By identity: before torch 2.13 pybind gives an unhashable ``instancemethod``; the
        # wrapper keeps the original alive, so its id is not reused while cached.
        wrapper = _cached(("pg", method, id(original)), _point_to_point, method, original)
        patches.append((dist.ProcessGroup, method, wrapper))
    for namespace, name, packet in _torch_private.functional_collective_packets(
        FUNCTIONAL_NAMESPACES, tuple(FUNCTIONAL_OPS)
    ):
        if isinstance(packet, _SeenFunctionalOp):
            continue  # still ours from an earlier activation someone else did not restore
        patches.append((namespace, name, _cached(("op", packet), _SeenFunctionalOp, name, packet)))
    return patches


def _cached(key: Any, build: Callable[..., Any], *args: Any) -> Any:
    # Built once per target: every test on a process rank installs the wrappers anew, and
    # a reference a test module kept must stay the same object.
    if key not in _wrapper_cache:
        _wrapper_cache[key] = build(*args)
    return _wrapper_cache[key]


def _acquire_wrappers() -> None:
    global _hooks_users, _listener_handle
    with _hooks_lock:
        _hooks_users += 1
        if _hooks_users > 1:
            return
        for owner, name, replacement in _patches():
            _originals[(owner, name)] = vars(owner).get(name, _ABSENT)
            _wrappers[(owner, name)] = replacement
            setattr(owner, name, replacement)
        _listener_handle = add_collective_listener(_on_threaded_collective)


_ABSENT = object()


def _release_wrappers() -> None:
    global _hooks_users, _listener_handle
    with _hooks_lock:
        _hooks_users -= 1
        if _hooks_users > 0:
            return
        for (owner, name), original in _originals.items():
            # Restore only our own wrapper: a patch someone put over it stays theirs.
            if vars(owner).get(name) is _wrappers[(owner, name)]:
                if original is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
        _originals.clear()
        _wrappers.clear()
        if _listener_handle is not None:
            _listener_handle.remove()
            _listener_handle = None


def leftover_patches() -> list[str]:
    """Names of everything this package wrapped that is still wrapped (for tests)."""
    left = [
        f"{module.__name__}.{name}"
        for module in _PATCHED_MODULES
        for name in WRAPPED_FUNCTIONS
        if hasattr(getattr(module, name), _WRAPPER_MARK)
    ]
    left += [
        f"ProcessGroup.{method}"
        for method in _POINT_TO_POINT_METHODS
        if hasattr(vars(dist.ProcessGroup).get(method), _WRAPPER_MARK)
    ]
    left += [
        f"torch.ops.{namespace_name}.{name}"
        for namespace_name in FUNCTIONAL_NAMESPACES
        for name, value in vars(getattr(torch.ops, namespace_name)).items()
        if isinstance(value, _SeenFunctionalOp)
    ]
    return left


def hold_wrappers() -> None:
    """Keep the wrappers installed for the rest of this process's life.

    For rank processes and thread hosts, which enter and leave a flight recorder around
    every task: without the hold each task would install and restore every wrapper (65
    attributes, about a tenth of a millisecond). While no interceptor is entered, the
    wrappers pass each call straight through.
    """
    _acquire_wrappers()


def active_users() -> int:
    return _hooks_users
