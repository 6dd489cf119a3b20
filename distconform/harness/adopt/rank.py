"""What each rank runs for an adopted test method.

The rank already holds the harness's default process group, so the class's own calls to
``init_process_group`` and ``destroy_process_group`` are served from it while the method
runs (:func:`serving_the_default_group`): an init that asks for nothing but this world
returns at once, a destroy of the default group is left to the pool, and every such
difference goes back to pytest, which warns once per class. An init that asks for another
world size or rank fails the test with both numbers: the pool would otherwise run the
method on a world it was not written for. An init that brings what the pool's group cannot
stand in for (another backend, its own store, init method or group options) is never
served: the method stops there and tells pytest, which runs it again on ranks without a
default group, where its own init creates its own world, as under torch's harness. The two
functions are replaced when this module is imported (in the parent too, where they only
ever defer to torch's).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from distconform.harness.adopt import _torch_test_harness as torch_harness
from distconform.harness.shared.rank_context import get_rank_context


class AdoptionError(AssertionError):
    """An adopted method asked for a world the pool does not have."""


class OwnWorldNeeded(Exception):
    """The method's own init asked for a world the pool's group cannot stand in for."""


@dataclass
class MethodOutcome:
    """What pytest learns from a rank besides pass or fail."""

    #: How the run differed from the class's own harness.
    differences: list[str] = field(default_factory=list)
    #: Why the method needs a world of its own (it stopped at its init); None: it ran.
    needs_own_world: str | None = None


def run_adopted_method(
    test_class: type, method_name: str, file_name: str, world_size: int
) -> MethodOutcome:
    """Build the rank's instance of ``test_class`` and run ``method_name`` on it."""
    if torch_harness.family_of(test_class) == torch_harness.CONTINUOUS_FAMILY:
        return _run_continuous_method(test_class, method_name, file_name, world_size)
    rank = get_rank_context().rank
    instance = torch_harness.build_instance(test_class, method_name, rank, file_name)
    declared = int(instance.world_size)
    if declared != world_size:
        raise AdoptionError(
            f"{test_class.__qualname__}.world_size is {declared} on this rank but the pool has "
            f"{world_size} ranks: the property must give the same value in pytest and in "
            f"the ranks"
        )
    instance.subTest = functools.partial(_naming_the_subtest, instance.subTest)
    if torch_harness.is_dtensor_test(test_class):
        # with_comms creates and destroys the group around each method: the pool's serves.
        instance.init_pg = lambda *args, **kwargs: None
        instance.destroy_pg = lambda *args, **kwargs: dist.barrier()

    def body() -> None:
        _run_body(test_class, instance, method_name)

    with serving_the_default_group(test_class.__qualname__) as differences:
        try:
            if torch_harness.family_of(test_class) == torch_harness.THREAD_FAMILY:
                torch_harness.run_per_thread_hooks(instance, body)
            else:
                body()
        except OwnWorldNeeded as need:
            return MethodOutcome(differences, needs_own_world=str(need))
    return MethodOutcome(differences)


def _run_continuous_method(
    test_class: type, method_name: str, file_name: str, world_size: int
) -> MethodOutcome:
    """A ``MultiProcContinuousTest`` method, as the class's worker runs it: the class joins
    its world once per rank process (its ``_init_pg``, whose init the pool's group serves),
    then each test gets a new instance, torch's seed and the method, without ``setUp``.

    Its ``_init_pg`` sets ``LOCAL_RANK``, which the class's tests may read: it is set while
    each of them runs and put back after, so that the rank is unchanged between tests.
    """
    rank = get_rank_context().rank
    with (
        _local_rank_variable(rank),
        serving_the_default_group(test_class.__qualname__, store_is_rendezvous=True) as differences,
    ):
        try:
            if _continuous_classes.get(test_class, _NOT_JOINED) is not _default_group():
                torch_harness.join_continuous_world(test_class, rank, world_size, file_name)
                _continuous_classes[test_class] = _default_group()
            instance = torch_harness.build_continuous_instance(test_class, method_name)
            instance.subTest = functools.partial(_naming_the_subtest, instance.subTest)
            torch_harness.seed_like_torch()
            torch_harness.call_test_method(instance, method_name)
        except OwnWorldNeeded as need:
            return MethodOutcome(differences, needs_own_world=str(need))
    return MethodOutcome(differences)


#: The continuous classes that joined their world in this process, and the default group
#: they joined (ranks of their own create a new one for each test: the class joins again).
_continuous_classes: dict[type, Any] = {}
_NOT_JOINED = object()


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


@contextmanager
def _local_rank_variable(rank: int) -> Iterator[None]:
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


@contextmanager
def _naming_the_subtest(subtest: Callable[..., Any], *args: Any, **params: Any) -> Iterator[None]:
    """``self.subTest`` (and FSDPTest's ``run_subtests``, which uses it) outside a unittest
    result: the first failure ends the method, as in torch's own children, and the report
    names the subtest it failed in."""
    try:
        with subtest(*args, **params):
            yield
    except Exception as error:
        described = [repr(arg) for arg in args] + [f"{k}={v!r}" for k, v in params.items()]
        error.add_note(f"in subTest({', '.join(described)})")
        raise


def _run_body(test_class: type, instance: Any, method_name: str) -> None:
    if torch_harness.is_fsdp_test(test_class):
        # FSDPTest's own child: a barrier and a compiler reset on each side of the body.
        dist.barrier()
        torch.compiler.reset()
        torch_harness.seed_like_torch()
        torch_harness.call_test_method(instance, method_name)
        torch.compiler.reset()
        dist.barrier()
    else:
        torch_harness.seed_like_torch()
        torch_harness.call_test_method(instance, method_name)


# --- the class's own init_process_group / destroy_process_group ----------------------------

_serving = threading.local()  # per rank thread: the class being served, and its differences
_installed = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}


@contextmanager
def serving_the_default_group(
    class_name: str, store_is_rendezvous: bool = False
) -> Iterator[list[str]]:
    """While the block runs on this thread, serve init/destroy of the default group from
    the pool's group; yields the differences it noted (each once). On ranks without a
    group of the pool's, the class's own calls go to torch's, as under its own harness.

    ``store_is_rendezvous``: a store the init brings is its harness's rendezvous, which the
    pool's group stands in for (``MultiProcContinuousTest._init_pg``'s ``FileStore``)."""
    _install()
    differences: list[str] = []
    state = _ServedClass(class_name, differences, store_is_rendezvous)
    _serving.state = state if dist.is_initialized() else None
    try:
        yield differences
    finally:
        _serving.state = None


def _install() -> None:
    """Replace the two functions once per process; they defer to torch's own on any thread
    not running an adopted method, so a rank that runs other tests sees no change. Done when
    this module is imported, which the rank does before the test's module
    (``distconform.harness.shared.task.ensure_modules``), so that ``from torch.distributed import
    init_process_group`` in a test module binds the served function."""
    with _installed:
        if _originals:
            return
        for name, served in (
            ("init_process_group", _served_init),
            ("destroy_process_group", _served_destroy),
        ):
            _originals[name] = getattr(distributed_c10d, name)
            for module in (dist, distributed_c10d):
                setattr(module, name, served)


@dataclass(frozen=True)
class _ServedClass:
    name: str
    differences: list[str]
    #: Whether a store passed to its init is only its harness's rendezvous.
    store_is_rendezvous: bool = False


def _state() -> _ServedClass | None:
    return getattr(_serving, "state", None)


def _note(differences: list[str], text: str) -> None:
    if text not in differences:
        differences.append(text)


def _served_init(*args: Any, **kwargs: Any) -> None:
    state = _state()
    if state is None:
        return _originals["init_process_group"](*args, **kwargs)
    class_name = state.name
    asked = inspect.signature(_originals["init_process_group"]).bind_partial(*args, **kwargs)
    asked = dict(asked.arguments)
    if state.store_is_rendezvous:
        asked.pop("store", None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    asked_size, asked_rank = asked.get("world_size", -1), asked.get("rank", -1)
    if asked_size not in (-1, None, world_size) or asked_rank not in (-1, None, rank):
        raise AdoptionError(
            f"{class_name} calls init_process_group(world_size={asked_size}, rank={asked_rank}) "
            f"on rank {rank} of a pool of {world_size}: run it at its own world size"
        )
    own = _what_the_pool_lacks(asked, dist.get_backend())
    if own:
        raise OwnWorldNeeded(f"{class_name} initialises its world with {' and '.join(own)}")
    return None


def _what_the_pool_lacks(asked: dict[str, Any], pool_backend: str) -> list[str]:
    """What an init asks for that the pool's group cannot stand in for."""
    lacks = []
    backend = asked.get("backend")
    if backend is not None and not _same_backend(str(backend), pool_backend):
        lacks.append(f"its own {backend!r} backend (the pool's is {pool_backend!r})")
    for name, what in (
        ("store", "its own store"),
        ("init_method", "its own init_method"),
        ("pg_options", "its own group options"),
    ):
        if asked.get(name) is not None:
            lacks.append(what)
    return lacks


def _same_backend(asked: str, pool_backend: str) -> bool:
    """``gloo`` is the pool's ``gloo``; ``cpu:gloo,cuda:nccl`` is served when the pool's
    backend is one of those it names."""
    asked = asked.lower()
    return asked == pool_backend or pool_backend in {
        part.partition(":")[2] or part for part in asked.split(",")
    }


def _served_destroy(group: Any = None, *args: Any, **kwargs: Any) -> None:
    state = _state()
    if state is None or (group is not None and group is not dist.group.WORLD):
        return _originals["destroy_process_group"](group, *args, **kwargs)
    _note(
        state.differences,
        f"{state.name}: destroy_process_group() of the default group is left to the pool",
    )
    return None


_install()
