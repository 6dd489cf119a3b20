"""Seeing every collective a rank issues, through public interception points only.

Three paths feed one chain of interceptors (tracers, recorders, injectors):

- the public collectives of ``torch.distributed`` (``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ``broadcast``, ``send``, ``barrier``...) are wrapped, in
  ``torch.distributed`` and in ``torch.distributed.distributed_c10d`` (whose functions
  call each other), while any interceptor is active: reference counted, restored when
  the last one exits. This path sees calls from forward, from autograd hooks during
  backward and from the optimizer, at no cost to other torch calls;
- a ``torch.overrides.TorchFunctionMode`` (thread-local) for interceptors that ask for
  it (``functional=True``): it sees functional collectives (``_c10d_functional`` ops,
  what DTensor's redistribute and ``full_tensor`` issue), ``isend``/``irecv`` and
  collectives called through a reference taken before the wrapping. The autograd engine
  does not carry torch function modes into backward hooks, so this path is blind during
  backward; it also costs a few microseconds per torch call while active;
- on the thread launcher, the threaded backend's listener (harness/threads/observe.py)
  reports what the backend executes, backward included.

A call is handled once: while one path handles it (``_state.handling``), the others pass
it through untouched. Interceptors entered on a thread-launcher rank thread see only
that thread's calls (the wrappers are process-global, so they look the rank up);
interceptors entered anywhere else see every thread of the process, so that autograd's
device threads are covered on process ranks.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

from harness.comm.records import (
    DIST_FUNCTIONS,
    THREADED_OPS,
    WRAPPED_FUNCTIONS,
    RawCall,
    bind_dist_call,
    bind_functional_call,
    dtype_name,
    functional_op_name,
    site_and_phase,
)

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
    from harness.threads.world import current_rank

    return current_rank() is not None


def _interceptors_here() -> list[Interceptor] | tuple[Interceptor, ...]:
    return _state.interceptors or _process_interceptors


class Interceptor:
    """Sees, and may wrap, every collective issued while it is entered.

    Subclasses implement :meth:`handle`: called before the collective is issued, it must
    call ``proceed()`` exactly once and return its value. ``functional`` adds the torch
    function mode path (see the module docstring).
    """

    functional = True

    def handle(self, raw: RawCall, proceed: Proceed) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Interceptor:
        global _process_interceptors
        self._thread_local = _on_thread_launcher_rank()
        if self._thread_local:
            _state.interceptors.append(self)
        else:
            with _registry_lock:
                _process_interceptors = (*_process_interceptors, self)
        _acquire_wrappers()
        self._mode = _CollectiveMode() if self.functional else None
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        global _process_interceptors
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            if self._thread_local:
                if self in _state.interceptors:
                    _state.interceptors.remove(self)
            else:
                with _registry_lock:
                    _process_interceptors = tuple(i for i in _process_interceptors if i is not self)
            _release_wrappers()


def _run_chain(raw: RawCall, final: Proceed) -> Any:
    """Every interceptor here, innermost first, around ``final``.

    Built from partials rather than nested functions: a failing collective's traceback
    then shows one frame per interceptor, not three.
    """
    proceed = final
    for interceptor in _interceptors_here():
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


def _classify(func: Any) -> tuple[str, bool] | None:
    """(name, is_functional) of a collective, None for anything else (cached per function)."""
    try:
        found = _classified.get(func, _MISSING)
    except TypeError:  # an unhashable callable is no collective we know
        return None
    if found is _MISSING:
        name = _dist_function_names.get(getattr(func, _WRAPPER_MARK, func))
        if name is not None:
            found = (name, False)
        else:
            op = functional_op_name(func)
            found = (op, True) if op is not None else None
        _classified[func] = found
    return found  # type: ignore[return-value]


class _CollectiveMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = _classify(func) if not _state.handling else None
        if found is None or not _interceptors_here():
            return func(*args, **kwargs)
        name, functional = found
        if functional:
            raw = bind_functional_call(name, args, kwargs)
        else:
            raw = bind_dist_call(name, func, args, kwargs)
        return _run_chain(raw, functools.partial(func, *args, **kwargs))


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


_wrapper_cache: dict[tuple[str, Any], Callable[..., Any]] = {}


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


def _acquire_wrappers() -> None:
    global _hooks_users, _listener_handle
    with _hooks_lock:
        _hooks_users += 1
        if _hooks_users > 1:
            return
        wrappers = {name: _wrapper_of(name, getattr(c10d, name)) for name in WRAPPED_FUNCTIONS}
        for module in _PATCHED_MODULES:
            for name, wrapper in wrappers.items():
                _originals[(module, name)] = getattr(module, name)
                _wrappers[(module, name)] = wrapper
                setattr(module, name, wrapper)
        from harness.threads.observe import add_collective_listener

        _listener_handle = add_collective_listener(_on_threaded_collective)


def _release_wrappers() -> None:
    global _hooks_users, _listener_handle
    with _hooks_lock:
        _hooks_users -= 1
        if _hooks_users > 0:
            return
        for (module, name), original in _originals.items():
            # Restore only our own wrapper: a patch someone put over it stays theirs.
            if getattr(module, name) is _wrappers[(module, name)]:
                setattr(module, name, original)
        _originals.clear()
        _wrappers.clear()
        if _listener_handle is not None:
            _listener_handle.remove()
            _listener_handle = None


def leftover_patches() -> list[str]:
    """Names of torch.distributed functions still wrapped by this package (for tests)."""
    return [
        f"{module.__name__}.{name}"
        for module in _PATCHED_MODULES
        for name in WRAPPED_FUNCTIONS
        if hasattr(getattr(module, name), _WRAPPER_MARK)
    ]


def active_users() -> int:
    return _hooks_users
