"""pytest side of ``--dist-adopt``: torch's distributed unittest classes as warm-pool items.

Registered by :mod:`distconform.harness.adopt.options` when ``--dist-adopt`` (or ini
``dist_adopt``) is set. A ``unittest.TestCase`` class of the ``MultiProcessTestCase``,
``MultiThreadedTestCase`` or ``MultiProcContinuousTest`` family
(:func:`~distconform.harness.adopt._torch_test_harness.family_of`) is collected by this plugin
instead of pytest's unittest plugin: one :class:`AdoptedMethod` item per test method, with the
node id pytest gives it anyway (``path::Class::test_method``), at the class's own
``world_size``. Running one sends :func:`distconform.harness.adopt.rank.run_adopted_method` to a
warm pool of that size: the session's launcher for the process family, rank threads on the
``threaded`` backend for a ``MultiThreadedTestCase`` on the CPU, as its own harness would run
it (its tests may share Python objects between ranks). On an accelerator, where rank threads
do not go, and under torchrun, it takes the session's ranks. Everything a distributed test
gets applies: rank-consistent skips, the per-rank report, hang stacks, the reproduce command.

The class's own harness decides some skips before any method runs: ``FSDPTest`` skips when
there are fewer accelerators than ranks, so on a CPU-only machine its methods are skipped
here too, with that reason
(:func:`~distconform.harness.adopt._torch_test_harness.own_precondition_skip`);
``--dist-adopt-fsdp-on-cpu`` runs them on CPU ranks instead.

unittest's own markers become pytest's: ``@unittest.skip`` / ``skipIf`` on the class or the
method is a skip at collection, ``@unittest.expectedFailure`` a strict xfail; pytest marks on
the class or the method (``deadline``, ``fresh_pool``, ``slow``...) apply as they would to a
``world_size`` test. A class whose test leaves a rank with state the hygiene check flags is
named in an :class:`AdoptedClassWarning`, and its later tests each get a fresh pool.

A ``MultiProcContinuousTest`` class keeps one world per class, as its own harness gives it:
its ``setUpClass`` and ``tearDownClass`` run here, its parent's skips apply at collection,
and after a failure its remaining tests are skipped (torch's ``poison_pill``).
"""

from __future__ import annotations

import inspect
import tempfile
import unittest
from pathlib import Path
from typing import Any

import pytest

from distconform.harness._pytest_private import skip_at_the_items_location
from distconform.harness.adopt import _torch_test_harness as torch_harness
from distconform.harness.adopt.options import start_fork_server_for
from distconform.harness.adopt.rank import run_adopted_method
from distconform.harness.controller.config import THREADED_BACKEND
from distconform.harness.controller.item_runner import (
    RUN_KEY,
    fork_server_requested,
    run_item_body,
    start_fork_server_soon,
)
from distconform.harness.controller.item_settings import PoolChoice, resolve_item_settings
from distconform.harness.controller.launcher_registry import PROCESS, THREAD, launcher_named
from distconform.harness.controller.session import ITEM_WORLD_SIZE_KEY, settings_of
from distconform.harness.shared.outcomes import RunResult

PLUGIN_NAME = "distconform-adopt-collection"
OPTION = "--dist-adopt"
#: Classes that broke the warm-pool contract in this session, and why.
_BROKE_CONTRACT_KEY = pytest.StashKey[dict[type, str]]()
#: The differences from their own harness already reported (each once a session).
_WARNED_KEY = pytest.StashKey[set[str]]()
#: Set on a method that stopped at an init the pool's group cannot serve: it runs again on
#: ranks of its own.
_OWN_WORLD_KEY = pytest.StashKey[str]()
#: The classes already named for initialising a world of their own (each once a session).
_OWN_WORLD_CLASSES_KEY = pytest.StashKey[set[type]]()
#: Continuous classes one of whose tests failed, and which: their later tests are skipped.
_POISONED_KEY = pytest.StashKey[dict[type, str]]()


class AdoptedClassWarning(pytest.PytestWarning):
    """An adopted class runs differently from its own harness (the pool's group serves its
    init_process_group) or from the other classes (a fresh pool per test)."""


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_BROKE_CONTRACT_KEY] = {}
    config.stash[_WARNED_KEY] = set()
    config.stash[_OWN_WORLD_CLASSES_KEY] = set()
    config.stash[_POISONED_KEY] = {}


def pytest_collectstart(collector: pytest.Collector) -> None:
    """A test module that names a class of torch's harness starts the rank fork server
    before it is imported (its torch import beside the module's own), unless the command
    line named it and the server started at configure. (Not at ``pytest_collect_file``,
    which also sees the files beside a file named on the command line.)"""
    if not isinstance(collector, pytest.Module) or fork_server_requested(collector.config):
        return
    try:
        source = collector.path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    start_fork_server_for(collector.config, source)


@pytest.hookimpl(tryfirst=True)  # before the harness's own start, which is not warm
def pytest_itemcollected(item: pytest.Item) -> None:
    # A class found through a base in another module: its ranks load the same.
    if isinstance(item, AdoptedMethod):
        start_fork_server_soon(item.config, warm=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(
    collector: pytest.Collector, name: str, obj: object
) -> pytest.Collector | None:
    if not (isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
        return None
    if torch_harness.family_of(obj) is None:
        return None
    if not unittest.TestLoader().getTestCaseNames(obj):
        return None  # a base class (FSDPTest itself, imported): pytest's plugin finds nothing
    return AdoptedClass.from_parent(collector, name=name, obj=obj)


def pytest_distconform_pool_choice(item: pytest.Item) -> PoolChoice | None:
    """A ``MultiThreadedTestCase`` class runs on rank threads; a class that broke the
    warm-pool contract earlier in the session, on a pool of its own; a class that creates
    its own world, on ranks of their own without the pool's group."""
    if not isinstance(item, AdoptedMethod):
        return None
    fresh = item.test_class in item.config.stash[_BROKE_CONTRACT_KEY]
    if item.on_rank_threads():
        return PoolChoice(launcher=THREAD, backend=THREADED_BACKEND, fresh=fresh)
    own_world = _OWN_WORLD_KEY in item.stash
    settings = settings_of(item.config)
    if item.continuous and settings.launcher == THREAD:
        # It keeps its rank in class attributes: one process per rank, on the device's
        # own backend (the rank threads' is in-process only).
        backend = launcher_named(PROCESS).backend_for(None, settings.device_type)
        return PoolChoice(launcher=PROCESS, backend=backend, fresh=fresh, own_world=own_world)
    return PoolChoice(fresh=fresh, own_world=own_world)


def pytest_distconform_reproducer_args(config: pytest.Config) -> list[str]:
    if config.getoption("dist_adopt_fsdp_on_cpu"):
        return [OPTION, "--dist-adopt-fsdp-on-cpu"]
    return [OPTION]


class AdoptedClass(pytest.Collector):
    def __init__(self, *, obj: type, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.obj = obj
        self.continuous = torch_harness.family_of(obj) == torch_harness.CONTINUOUS_FAMILY
        #: A continuous class's world, as its parent decides it before spawning.
        self.continuous_world = torch_harness.continuous_world(obj) if self.continuous else None
        _add_pytest_marks(self, obj)

    def collect(self) -> list[pytest.Item]:
        return [
            AdoptedMethod.from_parent(self, name=name)
            for name in unittest.TestLoader().getTestCaseNames(self.obj)
        ]

    def setup(self) -> None:
        """A continuous class's ``setUpClass`` runs in pytest's process before its first
        test, as in its own parent (which then spawns; here the pool's ranks serve)."""
        if self.continuous:
            try:
                self.obj.setUpClass()
            except unittest.SkipTest as skip:
                pytest.skip(str(skip))

    def teardown(self) -> None:
        if self.continuous:
            self.obj.tearDownClass()


class AdoptedMethod(pytest.Item):
    """One test method of an adopted class, run on the ranks of a warm pool."""

    parent: AdoptedClass

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        test_class = self.parent.obj
        self.test_class = test_class
        method = getattr(test_class, self.name)
        _add_pytest_marks(self, method)
        for holder in (test_class, method):
            if getattr(holder, "__unittest_skip__", False):
                self.add_marker(pytest.mark.skip(reason=holder.__unittest_skip_why__))
        if getattr(method, "__unittest_expecting_failure__", False):
            self.add_marker(pytest.mark.xfail(reason="unittest.expectedFailure", strict=True))
        self.continuous = self.parent.continuous
        world = self.parent.continuous_world
        if world is not None and world.skip_reason is not None:
            self.add_marker(pytest.mark.skip(reason=world.skip_reason))
        try:
            world_size = (
                world.world_size
                if world is not None
                else torch_harness.declared_world_size(test_class, self.name)
            )
        except Exception as exc:
            raise self.CollectError(
                f"{test_class.__qualname__}.world_size could not be read in pytest: {exc!r}"
            ) from None
        if world_size < 1:
            raise self.CollectError(
                f"{test_class.__qualname__}.world_size is {world_size}: an adopted class needs "
                f"at least one rank"
            )
        self.stash[ITEM_WORLD_SIZE_KEY] = world_size

    def runtest(self) -> None:
        if not self.continuous:
            self._runtest()
            return
        poisoned = self.config.stash[_POISONED_KEY]
        if self.test_class in poisoned:
            skip_at_the_items_location(
                f"{poisoned[self.test_class]} failed: a MultiProcContinuousTest class skips "
                f"its remaining tests after a failure, as under its own harness"
            )
        try:
            self._runtest()
        except pytest.skip.Exception:
            raise
        except BaseException:
            poisoned[self.test_class] = f"{self.test_class.__qualname__}.{self.name}"
            raise

    def _runtest(self) -> None:
        if not self.config.getoption("dist_adopt_fsdp_on_cpu"):
            reason = torch_harness.own_precondition_skip(
                self.test_class, self.stash[ITEM_WORLD_SIZE_KEY]
            )
            if reason is not None:
                skip_at_the_items_location(f"{reason}; --dist-adopt-fsdp-on-cpu runs it anyway")
        need = self._run_method()
        if need is None:
            return
        named = self.config.stash[_OWN_WORLD_CLASSES_KEY]
        if self.test_class not in named:
            named.add(self.test_class)
            self.warn(
                AdoptedClassWarning(
                    f"{need}: such a test runs on ranks of its own, without the pool's group, "
                    f"as under its own harness"
                )
            )
        self.stash[_OWN_WORLD_KEY] = need
        resolve_item_settings(self)  # the pool choice now gives ranks of their own
        need = self._run_method()
        if need is not None:
            # Its ranks still had the pool's group: a launcher that cannot start ranks
            # without one (torchrun's, the thread host's).
            pytest.fail(
                f"{need}; ranks without the pool's group need --launcher process", pytrace=False
            )

    def _run_method(self) -> str | None:
        """Run the method on its ranks; why it needs a world of its own when it stopped at
        its init for that, else None."""
        broke = self.config.stash[_BROKE_CONTRACT_KEY]
        with tempfile.TemporaryDirectory(prefix="distconform-adopt-") as directory:
            # The store file the class expects in self.file_name: shared by its ranks.
            store_file = Path(directory, "store")
            store_file.touch()
            args = (self.test_class, self.name, str(store_file), self.stash[ITEM_WORLD_SIZE_KEY])
            try:
                run_item_body(self, run_adopted_method, args, {})
            finally:
                run = self.stash.get(RUN_KEY, None)
                if run is not None:
                    self._report_differences(run)
                    self._note_contract(run, broke)
        needs = {v.needs_own_world for v in run.values if v is not None and v.needs_own_world}
        return min(needs) if needs else None

    def on_rank_threads(self) -> bool:
        if torch_harness.family_of(self.test_class) != torch_harness.THREAD_FAMILY:
            return False
        settings = settings_of(self.config)
        return settings.device_type == "cpu" and launcher_named(settings.launcher).starts_ranks

    def _report_differences(self, run: RunResult) -> None:
        """How the class ran differently from its own harness, once per session."""
        warned = self.config.stash[_WARNED_KEY]
        for value in run.values:
            for difference in value.differences if value is not None else ():
                if difference not in warned:
                    warned.add(difference)
                    self.warn(AdoptedClassWarning(difference))

    def _note_contract(self, run: RunResult, broke: dict[type, str]) -> None:
        if not run.hygiene_violations or self.test_class in broke:
            return
        reason = sorted({v for found in run.hygiene_violations.values() for v in found})[0]
        broke[self.test_class] = reason
        self.warn(
            AdoptedClassWarning(
                f"{self.test_class.__qualname__} leaves its ranks changed ({reason}): its "
                f"other tests in this session run on a fresh pool each"
            )
        )

    def reportinfo(self) -> tuple[Path, int | None, str]:
        try:
            line = inspect.getsourcelines(getattr(self.test_class, self.name))[1] - 1
        except (OSError, TypeError):
            line = None
        return self.path, line, f"{self.test_class.__qualname__}.{self.name}"


def _add_pytest_marks(node: pytest.Node, holder: object) -> None:
    """pytest marks put on the class or the method (``@pytest.mark.deadline(60)``,
    ``fresh_pool``, ``slow``): they apply as to any distributed test."""
    for mark in getattr(holder, "pytestmark", None) or ():
        decorator = getattr(pytest.mark, mark.name).with_args(*mark.args, **mark.kwargs)
        node.add_marker(decorator, append=True)
