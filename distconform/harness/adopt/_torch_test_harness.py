"""The one audited place that knows torch's private test-harness protocol.

Tests written for ``torch.testing._internal.common_distributed`` (``MultiProcessTestCase``,
``MultiThreadedTestCase`` and their subclasses ``FSDPTest``, ``DTensorTestBase``,
``FSDPTestMultiThread``, ``DTensorOpTestBase``) are adopted by running each method's body on
a warm rank the way torch's own child process would run it, without torch's parent. What
that takes, audited on torch 2.13 (``common_distributed.py`` line numbers):

- An instance is built with ``cls(method_name)``: construction spawns nothing (``__init__``,
  913, only wraps the method so that it runs when ``self.rank`` is not the parent's -1);
  ``setUp`` is where processes or threads start (``FSDPTest.setUp``, ``DTensorTestBase.setUp``,
  ``_spawn_threads``), so it is never called. The child sets ``rank`` and ``file_name``
  (``_run``, 1030) and seeds with ``common_utils.set_rng_seed()`` (``run_test``, 1053).
- ``world_size`` is a read-only property evaluated on an instance (896): the pool's size.
- ``FSDPTest._run`` (``common_fsdp.py`` 1557) puts a barrier, ``torch._dynamo.reset()`` and
  the seed before the body and a reset and a barrier after it; its body expects the default
  group to exist.
- ``DTensorTestBase``'s ``with_comms`` calls ``self.init_pg`` / ``self.destroy_pg`` around the
  body (``common_dtensor.py`` 878): the instance gets versions that use the existing group.
- A skip inside a child is ``sys.exit(code)`` with a code of ``TEST_SKIPS`` (161), or
  ``unittest.SkipTest``; torch's parent turns rank 0's code back into ``SkipTest`` (1240).
- ``MultiThreadedTestCase`` runs ``perThreadSetUp`` / ``perThreadTearDown`` around the body on
  each rank thread (1556) and gives each thread torch's precision settings (``_tls``, 1547).
- ``MultiProcContinuousTest`` (``DTensorContinuousTestBase``) keeps one world per class: its
  parent spawns ``world_size`` workers at the class's first test (``_ensure_processes_spawned``,
  2042: the class's device type, ``_get_world_size``, a skip when its backend is missing);
  each worker sets the class's ``rank`` and ``world_size``, runs the class's ``_init_pg``
  (1859: ``LOCAL_RANK``, a ``FileStore``, ``init_process_group`` with ``backend_str()``,
  ``opts()``, ``timeout``; ``cls.pg``) once, then per test builds ``cls(name)``, sets the
  instance's ``rank`` and ``world_size``, seeds with ``set_rng_seed()`` and calls the method
  (``_run_test_given_id``, 1879), without ``setUp``. After a failure the parent skips the
  class's remaining tests (``poison_pill``, 2165).
- Classes that never spawn (``LocalDTensorTestBase``, ``LocalDTensorOpTestBase``,
  ``LocalDTensorContinuousTestBase``: they run in the calling process on a fake backend) are
  not adopted: pytest runs them as it always did.

The line numbers above are torch 2.13's; ``AUDITS`` says, per accessor, what each release of
the window (``harness/torch_window.py``) has. Each function calls :func:`require_audited_torch`
before it reads a private name, which refuses a torch outside the window with the window named.
The private modules are read from ``sys.modules`` where the question is only "is this one of
theirs": a test module that subclasses them has imported them already, and a session that
adopts nothing never pays for importing torch's test package.
"""

from __future__ import annotations

import ast
import sys
import threading
import unittest
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from distconform.harness import torch_window
from distconform.harness.torch_window import V2_11, V2_12, V2_13, V2_14, V2_15, Audit, Version
from distconform.harness.torch_window import PrivateTorchAccessError as PrivateTorchAccessError

MODULE = "harness/adopt/_torch_test_harness.py"
_COMMON_DISTRIBUTED = "torch.testing._internal.common_distributed"
_COMMON_FSDP = "torch.testing._internal.common_fsdp"
_COMMON_DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
_COMMON_UTILS = "torch.testing._internal.common_utils"

PROCESS_FAMILY = "process"
THREAD_FAMILY = "thread"
CONTINUOUS_FAMILY = "continuous"
#: Bases that look like the family but run in the calling process: never adopted.
_NOT_ADOPTED = ("LocalDTensorTestBase", "LocalDTensorOpTestBase", "LocalDTensorContinuousTestBase")

#: The classes of torch's harness a test module subclasses, by name: a module whose text
#: names none of them has nothing to adopt, unless it subclasses them through another module.
FAMILY_BASE_NAMES = (
    "MultiProcessTestCase",
    "MultiThreadedTestCase",
    "MultiProcContinuousTest",
    "FSDPTest",
    "FSDPTestMultiThread",
    "DTensorTestBase",
    "DTensorOpTestBase",
    "DTensorContinuousTestBase",
)


#: One audit per accessor (``file:line`` are in that release's ``torch/testing/_internal``).
AUDITS: dict[str, Audit] = {}


def require_audited_torch(accessor: str) -> None:
    """Refuse ``accessor`` unless the installed torch is in the window and in its audit."""
    torch_window.require_audited(AUDITS, accessor, MODULE)


def _loaded(module: str, accessor: str) -> Any | None:
    found = sys.modules.get(module)
    if found is not None:
        require_audited_torch(accessor)
    return found


#: torch's test package, whose modules a rank imports with an adopted test module.
_TEST_PACKAGE = "torch.testing._internal"


AUDITS["test_package_imports"] = Audit(
    reads="the package torch.testing._internal and its module common_distributed, where the "
    "three families are defined (names only: the fork server imports them).",
    versions={
        V2_11: "same: common_distributed.py:758/:1317/:1690",
        V2_12: "same: :787/:1346/:1719",
        V2_13: "same: :874/:1443/:1816 (baseline)",
        V2_14: "same: :898/:1467/:1840",
        V2_15: "same: :930/:1500/:1884",
    },
)


def test_package_imports(source: str) -> tuple[str, ...]:
    """The modules of torch's test package that a test file's source imports, the family's
    home first: what its ranks will load, for the fork server to load once before forking
    them. Read from the source (never imported here); an unparsable file names none."""
    require_audited_torch("test_package_imports")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    # Where every family lives: 4 to 5 s of import on 2 cores (dynamo, the package's utils).
    names = [_COMMON_DISTRIBUTED]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates = [node.module]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        names += [name for name in candidates if name.startswith(f"{_TEST_PACKAGE}.")]
    return tuple(dict.fromkeys(names))


AUDITS["family_of"] = Audit(
    reads="common_distributed.MultiThreadedTestCase, MultiProcessTestCase and "
    "MultiProcContinuousTest, and the class names LocalDTensorTestBase, LocalDTensorOpTestBase, "
    "LocalDTensorContinuousTestBase in the MRO.",
    versions={
        V2_11: "same: common_distributed.py:758/:1317/:1690; common_dtensor.py:757/:819 "
        "(DTensorTestBase subclasses MultiProcessTestCase directly)",
        V2_12: "same: :787/:1346/:1719; common_dtensor.py:1102/:1164",
        V2_13: "same: :874/:1443/:1816; common_dtensor.py:1102/:1164 (baseline)",
        V2_14: "same: :898/:1467/:1840; same set of derived torch test classes",
        V2_15: "same: :930/:1500/:1884; common_dtensor.py:1111/:1173",
    },
)


def family_of(cls: type) -> str | None:
    """``"process"`` for a ``MultiProcessTestCase`` subclass, ``"thread"`` for a
    ``MultiThreadedTestCase`` one, ``"continuous"`` for a ``MultiProcContinuousTest`` one, None
    for anything else (and for the classes above)."""
    common = _loaded(_COMMON_DISTRIBUTED, "family_of")
    if common is None or not isinstance(cls, type):
        return None
    if any(base.__name__ in _NOT_ADOPTED for base in cls.__mro__):
        return None
    if issubclass(cls, common.MultiThreadedTestCase):
        return THREAD_FAMILY
    if issubclass(cls, common.MultiProcessTestCase):
        return PROCESS_FAMILY
    if issubclass(cls, common.MultiProcContinuousTest):
        return CONTINUOUS_FAMILY
    return None


AUDITS["is_fsdp_test"] = Audit(
    reads="common_fsdp.FSDPTest (a MultiProcessTestCase whose _run needs the default group).",
    versions={
        V2_11: "same: common_fsdp.py:1530",
        V2_12: "same: :1530",
        V2_13: "same: :1530 (baseline)",
        V2_14: "same: :1528",
        V2_15: "same: :1528",
    },
)


def is_fsdp_test(cls: type) -> bool:
    common_fsdp = _loaded(_COMMON_FSDP, "is_fsdp_test")
    return common_fsdp is not None and issubclass(cls, common_fsdp.FSDPTest)


AUDITS["is_dtensor_test"] = Audit(
    reads="common_dtensor.DTensorTestBase (its with_comms calls self.init_pg/destroy_pg).",
    versions={
        V2_11: "same: common_dtensor.py:395",
        V2_12: "same: :787",
        V2_13: "same: :787 (baseline)",
        V2_14: "same: :787",
        V2_15: "same: :795",
    },
)


def is_dtensor_test(cls: type) -> bool:
    common_dtensor = _loaded(_COMMON_DTENSOR, "is_dtensor_test")
    return common_dtensor is not None and issubclass(cls, common_dtensor.DTensorTestBase)


# The TEST_SKIPS key FSDPTest._run exits with when too few accelerators are present.
_TOO_FEW_DEVICES_SKIP: dict[Version, str] = {
    V2_11: "multi-gpu-{}",
    V2_12: "multi-gpu-{}",
    V2_13: "multi-gpu-{}",
    V2_14: "multi-gpu-{}",
    V2_15: "multi-device-{}",
}

AUDITS["own_precondition_skip"] = Audit(
    reads="torch.accelerator.device_count() and common_distributed.TEST_SKIPS[key].message; "
    "relies on FSDPTest._run exiting with that skip when device_count < world_size, on CPU "
    "runs too.",
    versions={
        V2_11: "same: TEST_SKIPS :74-97 and FSDPTest._run common_fsdp.py:1556 identical to "
        "2.13's; key multi-gpu-N",
        V2_12: "same: same lines; key multi-gpu-N",
        V2_13: "same: TEST_SKIPS :161, key multi-gpu-N (baseline)",
        V2_14: "same: TEST_SKIPS :161-184, _run :1554-1607 identical; key multi-gpu-N",
        V2_15: "differs: the key is multi-device-N (common_distributed.py:168-175, "
        "common_fsdp.py:1563), 'accelerator device(s)' wording, same exit codes; looked up "
        "under that key",
    },
)


def own_precondition_skip(cls: type, world_size: int) -> str | None:
    """Why the class's own child would skip before the method runs, or None.

    ``FSDPTest._run`` (``common_fsdp.py`` 1564) exits with the ``multi-gpu-N`` skip
    (``multi-device-N`` from torch 2.15 on) when fewer accelerators than ``world_size`` are
    present, on CPU runs too (its mixin's ``_run`` exempts CPU; this override does not), so
    torch's harness skips every ``FSDPTest`` method on a CPU-only machine."""
    require_audited_torch("own_precondition_skip")
    if not is_fsdp_test(cls):
        return None
    import torch

    if torch.accelerator.device_count() >= world_size:
        return None
    common = sys.modules[_COMMON_DISTRIBUTED]
    key = _TOO_FEW_DEVICES_SKIP[torch_window.installed_torch_version()].format(world_size)
    skip = common.TEST_SKIPS.get(key)  # torch has keys for N up to 8 only
    message = skip.message if skip else f"Need at least {world_size} accelerators"
    return f"{message} (FSDPTest's own check before the method runs)"


AUDITS["declared_world_size"] = Audit(
    reads="cls(method_name), whose __init__ only wraps the method, and the instance's "
    "world_size property.",
    versions={
        V2_11: "same: MultiProcessTestCase.__init__ :797-814 and world_size :779, "
        "MultiThreadedTestCase :1346/:1533, FSDPTest/DTensorTestBase world_size identical",
        V2_12: "same: all identical (__init__ :826, TestCase.__init__ common_utils.py:3289)",
        V2_13: "same: __init__ :913, world_size :896 (baseline)",
        V2_14: "same: :937, :919, :1496, :1683; TestCase.__init__ :3663",
        V2_15: "same: :969, :951, :1529, :1716; TestCase.__init__ :3826",
    },
)


def declared_world_size(cls: type, method_name: str) -> int:
    """The class's ``world_size`` as its own harness would read it (on an instance)."""
    require_audited_torch("declared_world_size")
    return int(cls(method_name).world_size)


AUDITS["build_instance"] = Audit(
    reads="cls(method_name), then rank and file_name set as MultiProcessTestCase._run sets "
    "them, and _tls.precision/rel_tol from common_utils.TestCase._precision/_rel_tol as the "
    "per-thread runner sets them.",
    versions={
        V2_11: "same: _run :913-920 identical; _tls block :1423-1426; common_utils.py:3159",
        V2_12: "same: :942-949; :1452-1455; common_utils.py:3239",
        V2_13: "same: _run :1030; _tls :1547 (baseline)",
        V2_14: "same: :1053-1060; :1573-1576; common_utils.py:3610",
        V2_15: "same: :1085-1092; :1606-1609; common_utils.py:3767",
    },
)


def build_instance(cls: type, method_name: str, rank: int, file_name: str) -> Any:
    """An instance of ``cls`` for one rank, set up as torch's child sets it up, minus the
    ``setUp`` that would start processes or threads."""
    require_audited_torch("build_instance")
    instance = cls(method_name)
    instance.rank = rank
    instance.file_name = file_name
    if hasattr(instance, "_tls"):  # TestCase's assertEqual tolerances are per thread
        utils = sys.modules[_COMMON_UTILS]
        instance._tls = threading.local()
        instance._tls.precision = utils.TestCase._precision
        instance._tls.rel_tol = utils.TestCase._rel_tol
    return instance


AUDITS["seed_like_torch"] = Audit(
    reads="common_utils.set_rng_seed(): seeds torch, random and numpy with SEED = 1234, as "
    "torch's child does before each test.",
    versions={
        V2_11: "same: set_rng_seed :2527-2533 identical, SEED :104, called by run_test :937",
        V2_12: "same: :2607; run_test :966",
        V2_13: "same: :2705, SEED :104 (baseline)",
        V2_14: "same: :2935; run_test :1077",
        V2_15: "same: :3092, SEED :105; run_test :1109",
    },
)


def seed_like_torch() -> None:
    """What torch's child does before every test body: ``set_rng_seed()`` (seed 1234)."""
    require_audited_torch("seed_like_torch")
    sys.modules[_COMMON_UTILS].set_rng_seed()


AUDITS["skip_reason"] = Audit(
    reads="common_distributed.TEST_SKIPS.values() and each TestSkip's exit_code and message.",
    versions={
        V2_11: "same: TEST_SKIPS :74-97, TestSkip namedtuple identical",
        V2_12: "same",
        V2_13: "same: :161 (baseline)",
        V2_14: "same: :161-184",
        V2_15: "same exit codes; messages say 'accelerator device(s)' where 2.13 says 'CUDA "
        "device(s)', and the reason carries torch's text as is",
    },
)


def skip_reason(exit_code: object) -> str | None:
    """The message of a ``TEST_SKIPS`` exit code, None for any other code."""
    common = _loaded(_COMMON_DISTRIBUTED, "skip_reason")
    if common is None:
        return None
    for skip in common.TEST_SKIPS.values():
        if skip.exit_code == exit_code:
            return f"{skip.message} (exit code {exit_code})"
    return None


AUDITS["call_test_method"] = Audit(
    reads="no torch name itself: calls the class's function, relying on __init__ wrapping "
    "only the instance attribute (join_or_run) and on TEST_SKIPS exits (see skip_reason).",
    versions={
        V2_11: "same: join_or_run :783-791 (processes), :1336-1344 (threads) identical",
        V2_12: "same: :812, :1365",
        V2_13: "same (baseline)",
        V2_14: "same: :923, :1486",
        V2_15: "same: :955, :1519",
    },
)


def call_test_method(instance: Any, method_name: str) -> None:
    """The raw method's body; a ``TEST_SKIPS`` exit becomes SkipTest.

    The class's function, not the instance's attribute: ``__init__`` wraps the latter in the
    parent/child switch and in ``TestCase``'s policies, one of which prints torch's own
    reproduce command on failure (``python test_x.py Class.method``), which would sit next
    to the harness's and not reproduce the adopted run."""
    require_audited_torch("call_test_method")
    with _test_skips_as_skiptest():
        getattr(type(instance), method_name)(instance)


@contextmanager
def _test_skips_as_skiptest() -> Iterator[None]:
    """A ``sys.exit`` with a ``TEST_SKIPS`` code (torch's children skip that way) becomes
    ``unittest.SkipTest``; any other exit goes on."""
    try:
        yield
    except SystemExit as exc:
        reason = skip_reason(exc.code)
        if reason is None:
            raise
        raise unittest.SkipTest(reason) from None


AUDITS["run_per_thread_hooks"] = Audit(
    reads="perThreadSetUp/perThreadTearDown, which torch's per-thread runner calls around "
    "the body on each rank thread.",
    versions={
        V2_11: "same: MultiThreadedTestCase :1365-1370, FSDPTestMultiThread :1188-1192 "
        "identical; run_test_with_threaded_pg :1430-1451",
        V2_12: "same: :1394-1399, :1459-1480",
        V2_13: "same: :1556 (baseline)",
        V2_14: "same: :1515-1520, :1580-1601",
        V2_15: "same: :1548-1553, :1613-1634",
    },
)


def run_per_thread_hooks(instance: Any, body: Any) -> None:
    """``perThreadSetUp``, the body, ``perThreadTearDown`` (a MultiThreadedTestCase)."""
    require_audited_torch("run_per_thread_hooks")
    instance.perThreadSetUp()
    try:
        body()
    finally:
        instance.perThreadTearDown()


# --- MultiProcContinuousTest: one world per class ---------------------------------------------


@dataclass(frozen=True)
class ContinuousWorld:
    """What a continuous class's parent decides before its first test: its world size, and
    why none of its tests can run here (its own harness's skip), if so."""

    world_size: int
    skip_reason: str | None = None


AUDITS["continuous_world"] = Audit(
    reads="MultiProcContinuousTest._ensure_processes_spawned's choice of the device type (the "
    "class's own device_type: a classmethod, a property read on the class, a callable or a "
    "string), its _get_world_size(device_type) (a property read on a bare instance; -2: the "
    "device count, SkipTest without devices), backend_str() and the c10d is_*_available "
    "check that skips the class, all before it spawns.",
    versions={
        V2_11: "same: _get_world_size :1883, _ensure_processes_spawned :1916 (same order and "
        "checks as 2.13's)",
        V2_12: "same: :1912, :1945",
        V2_13: "same: _get_world_size :2009, _ensure_processes_spawned :2042-2087 (baseline)",
        V2_14: "same: :2036, :2069; a torchcomms subclass's backend_str reads device_type (:2257)",
        V2_15: "same: :2085, :2118",
    },
)

_BACKEND_AVAILABLE = {
    "nccl": "is_nccl_available",
    "gloo": "is_gloo_available",
    "mpi": "is_mpi_available",
    "ucc": "is_ucc_available",
    "xccl": "is_xccl_available",
}


def continuous_world(cls: type) -> ContinuousWorld:
    """The class's world as its parent would spawn it, without spawning."""
    require_audited_torch("continuous_world")
    import torch.distributed as dist

    attribute = cls.__dict__.get("device_type", cls.device_type)
    if isinstance(attribute, classmethod):
        device_type = attribute.__func__(cls)
    elif isinstance(attribute, property):
        device_type = attribute.fget(cls)
    elif callable(attribute):
        device_type = attribute()
    else:
        device_type = attribute
    try:
        world_size = int(cls._get_world_size(device_type))
    except unittest.SkipTest as skip:
        return ContinuousWorld(world_size=1, skip_reason=str(skip))
    backend = cls.backend_str() if callable(cls.backend_str) else cls.backend_str
    check = getattr(dist, _BACKEND_AVAILABLE.get(str(backend), ""), None)
    if check is not None and not check():
        return ContinuousWorld(world_size, f"Backend '{backend}' is not available")
    return ContinuousWorld(world_size)


AUDITS["join_continuous_world"] = Audit(
    reads="cls.rank / cls.world_size (class attributes its worker sets), cls._init_pg(rank, "
    "world_size, rdvz_file) (LOCAL_RANK, a FileStore, init_process_group, cls.pg), and the "
    "TEST_SKIPS exit a _init_pg may end with (a skip of every test of the class).",
    versions={
        V2_11: "same: _worker_loop :1769 sets rank and world_size, then _init_pg :1733",
        V2_12: "same: :1798, :1762",
        V2_13: "same: _worker_loop :1895, _init_pg :1859 (baseline)",
        V2_14: "same: :1919, :1883",
        V2_15: "same: :1963, :1927",
    },
)


def join_continuous_world(cls: type, rank: int, world_size: int, rendezvous_file: str) -> None:
    """What the class's worker does once before its first test: the class's rank and world
    size, and its ``_init_pg``; a ``TEST_SKIPS`` exit becomes SkipTest."""
    require_audited_torch("join_continuous_world")
    cls.rank = rank
    cls.world_size = world_size
    with _test_skips_as_skiptest():
        cls._init_pg(rank, world_size, rendezvous_file)


AUDITS["build_continuous_instance"] = Audit(
    reads="cls(method_name), then the instance's rank and world_size from the class's, as "
    "_run_test_given_id does.",
    versions={
        V2_11: "same: _run_test_given_id :1753-1767",
        V2_12: "same: :1782-1796",
        V2_13: "same: :1879-1893 (baseline)",
        V2_14: "same: :1903-1917",
        V2_15: "same: :1947-1961",
    },
)


def build_continuous_instance(cls: type, method_name: str) -> Any:
    """The instance a continuous class's worker builds for one test."""
    require_audited_torch("build_continuous_instance")
    instance = cls(method_name)
    instance.rank = cls.rank
    instance.world_size = cls.world_size
    return instance
