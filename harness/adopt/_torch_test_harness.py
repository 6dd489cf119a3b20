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
- Classes that never spawn (``LocalDTensorTestBase``, ``LocalDTensorOpTestBase``: they run in
  the calling process on a fake backend) and ``MultiProcContinuousTest`` (its own warm
  workers, class-level rank) are not adopted: pytest runs them as it always did.

Every function checks the installed torch version first (``harness._torch_private``) and
refuses another one with the message that says what to re-audit. The private modules are
read from ``sys.modules`` where the question is only "is this one of theirs": a test module
that subclasses them has imported them already, and a session that adopts nothing never pays
for importing torch's test package.
"""

from __future__ import annotations

import sys
import threading
import unittest
from typing import Any

from harness._torch_private import require_audited_torch

_AUDITED_FILE = "harness/adopt/_torch_test_harness.py"
_COMMON_DISTRIBUTED = "torch.testing._internal.common_distributed"
_COMMON_FSDP = "torch.testing._internal.common_fsdp"
_COMMON_DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
_COMMON_UTILS = "torch.testing._internal.common_utils"

PROCESS_FAMILY = "process"
THREAD_FAMILY = "thread"
#: Bases that look like the family but run in the calling process: never adopted.
_NOT_ADOPTED = ("LocalDTensorTestBase", "LocalDTensorOpTestBase", "MultiProcContinuousTest")


def _loaded(module: str, accessor: str) -> Any | None:
    found = sys.modules.get(module)
    if found is not None:
        require_audited_torch(accessor, _AUDITED_FILE)
    return found


def family_of(cls: type) -> str | None:
    """``"process"`` for a ``MultiProcessTestCase`` subclass, ``"thread"`` for a
    ``MultiThreadedTestCase`` one, None for anything else (and for the classes above)."""
    common = _loaded(_COMMON_DISTRIBUTED, "family_of")
    if common is None or not isinstance(cls, type):
        return None
    if any(base.__name__ in _NOT_ADOPTED for base in cls.__mro__):
        return None
    if issubclass(cls, common.MultiThreadedTestCase):
        return THREAD_FAMILY
    if issubclass(cls, common.MultiProcessTestCase):
        return PROCESS_FAMILY
    return None


def is_fsdp_test(cls: type) -> bool:
    common_fsdp = _loaded(_COMMON_FSDP, "is_fsdp_test")
    return common_fsdp is not None and issubclass(cls, common_fsdp.FSDPTest)


def is_dtensor_test(cls: type) -> bool:
    common_dtensor = _loaded(_COMMON_DTENSOR, "is_dtensor_test")
    return common_dtensor is not None and issubclass(cls, common_dtensor.DTensorTestBase)


def own_precondition_skip(cls: type, world_size: int) -> str | None:
    """Why the class's own child would skip before the method runs, or None.

    ``FSDPTest._run`` (``common_fsdp.py`` 1564) exits with the ``multi-gpu-N`` skip when
    fewer accelerators than ``world_size`` are present, on CPU runs too (its mixin's
    ``_run`` exempts CPU; this override does not), so torch's harness skips every
    ``FSDPTest`` method on a CPU-only machine."""
    require_audited_torch("own_precondition_skip", _AUDITED_FILE)
    if not is_fsdp_test(cls):
        return None
    import torch

    if torch.accelerator.device_count() >= world_size:
        return None
    common = sys.modules[_COMMON_DISTRIBUTED]
    skip = common.TEST_SKIPS.get(f"multi-gpu-{world_size}")
    message = skip.message if skip else f"Need at least {world_size} accelerators"
    return f"{message} (FSDPTest's own check before the method runs)"


def declared_world_size(cls: type, method_name: str) -> int:
    """The class's ``world_size`` as its own harness would read it (on an instance)."""
    require_audited_torch("declared_world_size", _AUDITED_FILE)
    return int(cls(method_name).world_size)


def build_instance(cls: type, method_name: str, rank: int, file_name: str) -> Any:
    """An instance of ``cls`` for one rank, set up as torch's child sets it up, minus the
    ``setUp`` that would start processes or threads."""
    require_audited_torch("build_instance", _AUDITED_FILE)
    instance = cls(method_name)
    instance.rank = rank
    instance.file_name = file_name
    if hasattr(instance, "_tls"):  # TestCase's assertEqual tolerances are per thread
        utils = sys.modules[_COMMON_UTILS]
        instance._tls = threading.local()
        instance._tls.precision = utils.TestCase._precision
        instance._tls.rel_tol = utils.TestCase._rel_tol
    return instance


def seed_like_torch() -> None:
    """What torch's child does before every test body: ``set_rng_seed()`` (seed 1234)."""
    require_audited_torch("seed_like_torch", _AUDITED_FILE)
    sys.modules[_COMMON_UTILS].set_rng_seed()


def skip_reason(exit_code: object) -> str | None:
    """The message of a ``TEST_SKIPS`` exit code, None for any other code."""
    common = _loaded(_COMMON_DISTRIBUTED, "skip_reason")
    if common is None:
        return None
    for skip in common.TEST_SKIPS.values():
        if skip.exit_code == exit_code:
            return f"{skip.message} (exit code {exit_code})"
    return None


def call_test_method(instance: Any, method_name: str) -> None:
    """The raw method's body; a ``TEST_SKIPS`` exit becomes SkipTest.

    The class's function, not the instance's attribute: ``__init__`` wraps the latter in the
    parent/child switch and in ``TestCase``'s policies, one of which prints torch's own
    reproduce command on failure (``python test_x.py Class.method``), which would sit next
    to the harness's and not reproduce the adopted run."""
    try:
        getattr(type(instance), method_name)(instance)
    except SystemExit as exc:
        reason = skip_reason(exc.code)
        if reason is None:
            raise
        raise unittest.SkipTest(reason) from None


def run_per_thread_hooks(instance: Any, body: Any) -> None:
    """``perThreadSetUp``, the body, ``perThreadTearDown`` (a MultiThreadedTestCase)."""
    require_audited_torch("run_per_thread_hooks", _AUDITED_FILE)
    instance.perThreadSetUp()
    try:
        body()
    finally:
        instance.perThreadTearDown()
