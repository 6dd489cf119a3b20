"""A CPU-side check that a rank's test body says which device every new tensor belongs on.

On a CPU run, ``torch.randn(4, 8)`` and ``torch.randn(4, 8, device=rank_ctx.device)`` are
the same tensor; on ``--device cuda`` the first one lands on the CPU and the test breaks on
the multi-GPU runners it was written for. :class:`DeviceAudit` is a ``TorchFunctionMode``
that, while a test body runs, sees every tensor *factory* call (``torch.empty``, ``zeros``,
``randn``, ``tensor``, ..., see :data:`FACTORY_FUNCTIONS`) and fails the test with a
:class:`DeviceAuditError` naming the line when a factory is called with no ``device``.
The ``*_like`` functions and ``Tensor.new_*`` are not audited: they follow an existing
tensor's device.

Who is blamed. The call is reported at the first frame of the caller's own code: the first
frame outside torch, this harness, the standard library and site-packages (a test file,
or repository code such as ``suites/`` or ``impl/``). A factory called *directly* by such
library code counts only if the library forwarded ``device=None`` (``nn.Linear(4, 4)``
passes its unset ``device`` on to ``torch.empty``, so the test's line is reported); a
library call with no ``device`` keyword at all is that library's own deliberate choice
(a CPU scalar, say) that the test could not change, and is left alone, as is a call whose
stack holds no frame of the caller's own code at all.

What counts as a device:

- ``device=...`` (anything but ``None``), or ``out=`` (the result lives in ``out``).
- ``with torch.device(rank_ctx.device):`` entered inside the test. torch pushes the
  ``DeviceContext`` that statement creates on *top* of the mode stack, above this mode, so
  it fills in ``device`` before this mode sees the call (``tests/harness/test_device_audit.py``
  checks that order, which is why no private torch name is needed here).
- Data that already is a tensor (``torch.tensor(t)``, ``torch.as_tensor(t)``), and
  ``torch.normal`` with tensor ``mean``/``std``: the result follows that tensor.

``torch.set_default_device`` does *not* count. It installs its ``DeviceContext`` at the
*bottom* of the calling thread's mode stack, below this mode, so a device-less call arrives
here unfilled, and on a CPU run a default device of ``cpu`` cannot be told from no default
at all with public APIs. It is also a per-thread global that outlives the test: on a warm
rank, the next test would inherit it, and the audit's verdict would depend on test order.
So a device-less factory is reported whatever the default device is (the message says so
when a non-CPU default is set).

Not audited, because torch does not route them through torch-function modes:
``torch.from_numpy``, ``torch.frombuffer`` and the legacy constructors (``torch.Tensor(3)``,
``torch.FloatTensor(...)``). ``torch.as_tensor(array)`` is audited (it creates a CPU tensor
from non-tensor data); ``torch.as_tensor(array, device=rank_ctx.device)`` is the fix for both.

Threads. torch keeps the torch-function mode stack per thread, so the mode is active only
on the thread that entered it: each rank thread of ``--launcher thread`` enters its own
audit, and rank threads never see each other's (both checked by the tests). Threads a test
starts itself are not audited.

Under ``torch.compile`` dynamo traces this mode; a device-less factory in compiled code
makes it fall back to running that code eagerly at the stack walk (with a warning that it
cannot trace ``sys._getframe``), and the call is reported as in eager code.

Cost: about 3.2 us per torch call made while the mode is active, no more than any
pass-through ``TorchFunctionMode`` (the fast path is one set-membership test and then
``func(*args, **kwargs)``; the stack is walked only for a device-less factory call).
Measured with ``python -m distconform.harness.rank.device_audit`` (interleaved runs, 10th
percentile) on this project's shared 2-core CPU machine, torch 2.13, one thread: a forward +
backward + SGD step of a 3-layer MLP of width 64 on a batch of 32 makes 57 torch calls and took 0.45
ms bare, 0.66-0.68 ms under a pass-through mode and 0.62-0.64 ms under the audit (3.1-3.2 us per
call in three runs; 4.7 us in a fourth while the machine was busy). A test that spends its time in
collectives or in larger ops pays proportionally less.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Functions that create a tensor from nothing: without ``device`` it lands on the CPU.
FACTORY_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.empty_permuted,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.normal,
        torch.arange,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.scalar_tensor,
        torch.tril_indices,
        torch.triu_indices,
        torch.tensor,
        torch.as_tensor,
        torch.asarray,
        torch.bartlett_window,
        torch.blackman_window,
        torch.hamming_window,
        torch.hann_window,
        torch.kaiser_window,
    }
)

# Factories whose first argument may already be a tensor, which the result then follows.
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_DATA_KEYWORDS = ("data", "obj")

_FIX = 'Pass device=rank_ctx.device or build it inside "with torch.device(rank_ctx.device):"'


class DeviceAuditError(AssertionError):
    """A test body created a tensor without saying which device it belongs on.

    An ``AssertionError`` so that pytest reports it as a test failure, not an error.
    """


class DeviceAudit(TorchFunctionMode):
    """Fail any device-less tensor factory call made by the caller's own code.

    ``device`` is the device the code is meant to use (the rank's); it only appears in
    the message. Use as ``with DeviceAudit(rank_ctx.device): ...`` on the thread to audit.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        # The fast path for every other torch call: one set-membership test.
        if func in FACTORY_FUNCTIONS and kwargs.get("device") is None:
            self._audit(func, args, kwargs)
        return func(*args, **kwargs)

    def _audit(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> None:
        if kwargs.get("out") is not None or _follows_a_tensor(func, args, kwargs):
            return
        caller = _factory_caller(sys._getframe(0))
        if caller is None:
            return
        culprit = caller
        if _is_library(caller):
            if "device" not in kwargs:
                return  # the library's own choice, not something the test could pass
            while culprit is not None and _is_library(culprit):
                culprit = culprit.f_back
            if culprit is None:
                return  # no code of the caller's on this thread's stack
        raise DeviceAuditError(self._message(func, culprit, caller))

    def _message(self, func: Callable[..., Any], culprit: FrameType, caller: FrameType) -> str:
        where = f"{_display_path(culprit.f_code.co_filename)}:{culprit.f_lineno}"
        name = f"torch.{func.__name__}"
        if caller is not culprit:
            name += f" (via {caller.f_globals.get('__name__', '?')}.{caller.f_code.co_qualname})"
        device = self.device if self.device is not None else torch.device("cpu")
        if device.type == "cpu":
            landing = "on an accelerator run it would land on the CPU"
        else:
            landing = "it lands on the CPU"
        default = torch.get_default_device()
        if default.type != "cpu":
            landing = (
                f"torch.set_default_device({default}) does not count (a per-thread global that "
                f"outlives the test), and without it the tensor lands on the CPU"
            )
        return (
            f"{where} created a tensor with {name} and no device: {landing}, not on this "
            f"rank's device ({device}). {_FIX}"
        )


@contextmanager
def device_audit(enabled: bool, device: torch.device | str | None = None) -> Iterator[None]:
    """``DeviceAudit(device)`` on the calling thread if ``enabled``, else nothing."""
    if not enabled:
        yield
        return
    with DeviceAudit(device):
        yield


def _factory_caller(audit_frame: FrameType) -> FrameType | None:
    """The frame that called the factory: the first one above this module's own frames."""
    own_file = audit_frame.f_code.co_filename
    frame: FrameType | None = audit_frame
    while frame is not None and frame.f_code.co_filename == own_file:
        frame = frame.f_back
    return frame


def _follows_a_tensor(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> bool:
    if func in _FROM_DATA:
        data = args[0] if args else next((kwargs[k] for k in _DATA_KEYWORDS if k in kwargs), None)
        return isinstance(data, torch.Tensor)
    if func is torch.normal:
        # normal(mean, std) with a tensor among them samples on that tensor's device.
        return any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values()))
    return False


# --- which frames belong to the caller's own code ---------------------------------------


def _library_roots() -> tuple[str, ...]:
    roots = {
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.abspath(__file__)),  # the harness package
    }
    paths = sysconfig.get_paths()
    roots.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    roots.update(getattr(site, "getsitepackages", list)())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(root) + os.sep for root in roots if root}))


_LIBRARY_ROOTS = _library_roots()
_LIBRARY_DIR_NAMES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# Filename -> is it library code; filled on the slow path only.
_library_files: dict[str, bool] = {}


def _is_library(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    known = _library_files.get(filename)
    if known is None:
        if filename.startswith("<"):
            # Frozen stdlib modules and generated code (torch.fx, dataclasses): no line of
            # the caller's to point at.
            known = True
        else:
            path = os.path.realpath(filename)
            known = path.startswith(_LIBRARY_ROOTS) or any(d in path for d in _LIBRARY_DIR_NAMES)
        _library_files[filename] = known
    return known


def _display_path(filename: str) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith(os.pardir) else relative


# --- the overhead measurement quoted in the module docstring -----------------------------


def _measure(repeats: int = 500) -> dict[str, float]:
    """Time forward + backward + SGD step of a small MLP: bare, under a pass-through mode,
    and under the audit (milliseconds per step, a low percentile: the machine is shared)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, device="cpu"),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64, device="cpu"),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8, device="cpu"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(32, 64, device="cpu")

    def step() -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    class _PassThrough(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            _PassThrough.calls += 1
            return func(*args, **(kwargs or {}))

    with _PassThrough():
        step()
    calls = _PassThrough.calls

    modes = {"plain": nullcontext, "pass_through": _PassThrough, "audited": DeviceAudit}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(repeats):
        # Interleaved, so that load from elsewhere on a shared machine hits every variant.
        for name, mode in modes.items():
            with mode():
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
    # A low percentile (ms): the fastest steps are the ones nothing else interrupted.
    result = {name: sorted(t)[len(t) // 10] * 1e3 for name, t in times.items()}
    result["calls_per_step"] = calls
    result["audit_us_per_call"] = (result["audited"] - result["plain"]) / calls * 1e3
    result["mode_us_per_call"] = (result["pass_through"] - result["plain"]) / calls * 1e3
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    for key, value in _measure().items():
        print(f"{key}: {value:.3f}")
