"""What one collective call looks like to the comm tools, and how a call is classified.

Every interception path (a ``torch.distributed`` function seen through a torch function
mode, a functional collective op, the wrapped barrier, the threaded backend's listener)
turns what it saw into a :class:`RawCall`; observers (the tracer, the flight recorder)
number it and label its group to make a :class:`CollectiveCall`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distconform.harness import _torch_private

# Canonical kinds: one name per collective whatever API issued it.
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"
ALL_TO_ALL = "all_to_all"
REDUCE = "reduce"
GATHER = "gather"
SCATTER = "scatter"
SEND = "send"
RECV = "recv"
BARRIER = "barrier"

POINT_TO_POINT = frozenset({SEND, RECV})

# torch.distributed collectives: name -> (kind, parameters holding the inputs, parameters
# holding the outputs, the peer parameter of point-to-point calls). ``all_gather_single`` and
# ``reduce_scatter_single`` are 2.13's names; an older torch has only the ``*_tensor`` forms.
_KNOWN_DIST_FUNCTIONS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], str | None]] = {
    "all_gather_into_tensor": (ALL_GATHER, ("input_tensor",), ("output_tensor",), None),
    "reduce_scatter_tensor": (REDUCE_SCATTER, ("input",), ("output",), None),
    "all_reduce": (ALL_REDUCE, ("tensor",), ("tensor",), None),
    "all_reduce_coalesced": (ALL_REDUCE, ("tensors",), ("tensors",), None),
    "all_gather_single": (ALL_GATHER, ("input_tensor",), ("output_tensor",), None),
    "all_gather": (ALL_GATHER, ("tensor",), ("tensor_list",), None),
    "all_gather_coalesced": (ALL_GATHER, ("input_tensor_list",), ("output_tensor_lists",), None),
    "reduce_scatter_single": (REDUCE_SCATTER, ("input",), ("output",), None),
    "reduce_scatter": (REDUCE_SCATTER, ("input_list",), ("output",), None),
    "all_to_all_single": (ALL_TO_ALL, ("input",), ("output",), None),
    "all_to_all": (ALL_TO_ALL, ("input_tensor_list",), ("output_tensor_list",), None),
    "broadcast": (BROADCAST, ("tensor",), ("tensor",), None),
    "reduce": (REDUCE, ("tensor",), ("tensor",), None),
    "gather": (GATHER, ("tensor",), ("gather_list",), None),
    "scatter": (SCATTER, ("scatter_list",), ("tensor",), None),
    "send": (SEND, ("tensor",), (), "dst"),
    "isend": (SEND, ("tensor",), (), "dst"),
    "recv": (RECV, (), ("tensor",), "src"),
    "irecv": (RECV, (), ("tensor",), "src"),
}
#: The ones the installed torch has.
DIST_FUNCTIONS = {name: v for name, v in _KNOWN_DIST_FUNCTIONS.items() if hasattr(dist, name)}
BARRIER_FUNCTIONS = ("barrier", "monitored_barrier")
# Wrapped (patched) while an interceptor is active: every collective above but isend and
# irecv, whose identity ``P2POp`` and ``batch_isend_irecv`` check (a torch function mode
# sees those two instead).
WRAPPED_FUNCTIONS = tuple(n for n in DIST_FUNCTIONS if n not in ("isend", "irecv")) + (
    BARRIER_FUNCTIONS
)

# Functional collective ops (what DTensor and funcol issue), by op name in any of the
# functional namespaces: name -> kind. The input is always the first argument, the group
# the last positional one (or ``group_name=``).
FUNCTIONAL_OPS: dict[str, str] = {
    "all_reduce": ALL_REDUCE,
    "all_reduce_coalesced": ALL_REDUCE,
    "all_gather_into_tensor": ALL_GATHER,
    "all_gather_into_tensor_coalesced": ALL_GATHER,
    "all_gather_into_tensor_out": ALL_GATHER,
    "reduce_scatter_tensor": REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": REDUCE_SCATTER,
    "all_to_all_single": ALL_TO_ALL,
    "broadcast": BROADCAST,
    "isend": SEND,
    "irecv": RECV,
}
FUNCTIONAL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")

# What the threaded backend (harness/threads) calls its operations.
THREADED_OPS: dict[str, str] = {
    "allreduce": ALL_REDUCE,
    "reduce": REDUCE,
    "reduce_scatter": REDUCE_SCATTER,
    "reduce_scatter_single": REDUCE_SCATTER,
    "reduce_scatter_single_coalesced": REDUCE_SCATTER,
    "allgather": ALL_GATHER,
    "all_gather_single": ALL_GATHER,
    "all_gather_single_coalesced": ALL_GATHER,
    "gather": GATHER,
    "broadcast": BROADCAST,
    "scatter": SCATTER,
    "alltoall": ALL_TO_ALL,
    "all_to_all_single": ALL_TO_ALL,
    "send": SEND,
    "recv": RECV,
    "barrier": BARRIER,
}

_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name schedules print for ``dtype`` (``bf16``, ``fp32``...)."""
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as issued by one rank.

    ``numel``/``nbytes`` count the tensors this rank contributes, ``out_numel``/
    ``out_nbytes`` the ones it receives into; ``wire_bytes`` is what a bandwidth-optimal
    algorithm makes this rank send (see :func:`wire_bytes`). ``seq`` numbers every call
    of this rank in order; ``group_seq`` numbers the calls on one group, which is how the
    calls of different ranks are matched.
    """

    seq: int
    group_seq: int
    kind: str
    api: str
    group: str
    group_name: str
    group_ranks: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    numel: int
    nbytes: int
    out_numel: int
    out_nbytes: int
    wire_bytes: int
    phase: str
    site: str
    peer: int | None = None
    time: float = 0.0
    op: str | None = None  # the reduce op of reductions: SUM, AVG, PREMUL_SUM, ...

    @property
    def signature(self) -> tuple:
        """What must agree across the ranks of the group for the collective to match."""
        return (self.kind, self.shapes, self.dtypes)

    def tensors_text(self) -> str:
        if not self.shapes:
            return "-"
        return ",".join(
            f"{dtype}[{'x'.join(str(d) for d in shape)}]"
            for dtype, shape in zip(self.dtypes, self.shapes, strict=True)
        )

    def describe(self) -> str:
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return (
            f"{self.kind} #{self.group_seq} on {self.group} {self.tensors_text()}{peer} "
            f"({self.api}) at {self.site}"
        )

    def to_json(self) -> dict[str, Any]:
        # A shallow copy: asdict's deep copy costs most of a record's time, for nothing.
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveCall:
        data = dict(data)
        data["group_ranks"] = tuple(data["group_ranks"])
        data["shapes"] = tuple(tuple(s) for s in data["shapes"])
        data["dtypes"] = tuple(data["dtypes"])
        return cls(**data)


@dataclass
class RawCall:
    """A collective seen by an interception path, before an observer numbers it."""

    kind: str
    api: str
    group: Any  # a ProcessGroup, a group name, or None for the default group
    inputs: Sequence[torch.Tensor]
    out_numel: int
    out_nbytes: int
    site: str
    auto_phase: str
    peer: int | None = None
    group_ranks: tuple[int, ...] | None = None  # known already (threaded listener)
    shapes: tuple[tuple[int, ...], ...] | None = None
    dtypes: tuple[str, ...] | None = None
    numel: int | None = None
    nbytes: int | None = None
    time: float = 0.0
    op: str | None = None

    def __post_init__(self) -> None:
        if self.shapes is None:
            self.shapes = tuple(tuple(t.shape) for t in self.inputs)
            self.dtypes = tuple(dtype_name(t.dtype) for t in self.inputs)
            self.numel = sum(t.numel() for t in self.inputs)
            self.nbytes = sum(t.numel() * t.element_size() for t in self.inputs)
        if not self.time:
            self.time = time.monotonic()


def wire_bytes(kind: str, nbytes: int, out_nbytes: int, group_size: int) -> int:
    """Bytes this rank sends in a bandwidth-optimal (ring) algorithm.

    all-gather: (n-1)/n of the gathered output; reduce-scatter and all-to-all: (n-1)/n of
    the input; all-reduce: 2(n-1)/n of the input (a reduce-scatter then an all-gather);
    send: the tensor; everything else: the input bytes.
    """
    n = max(group_size, 1)
    if kind == ALL_GATHER:
        return out_nbytes * (n - 1) // n
    if kind in (REDUCE_SCATTER, ALL_TO_ALL):
        return nbytes * (n - 1) // n
    if kind == ALL_REDUCE:
        return 2 * nbytes * (n - 1) // n
    if kind == RECV:
        return 0
    return nbytes


def reduce_op_name(op: Any) -> str | None:
    """``SUM``, ``AVG``, ``PREMUL_SUM``... for a ``ReduceOp`` (or its ``RedOpType``) or a
    functional collective's op string; ``None`` for anything else."""
    if op is None:
        return None
    if isinstance(op, str):
        return op.upper()
    kind = getattr(op, "op", op)  # a ReduceOp instance (PREMUL_SUM) wraps its RedOpType
    name = getattr(kind, "name", None)
    return name if isinstance(name, str) else None


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    """Tensors in a tensor, a list of tensors, or a list of lists of tensors."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        found: list[torch.Tensor] = []
        for item in value:
            found.extend(flatten_tensors(item))
        return found
    return []


# --- call sites and phases -------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames from these directories are machinery, not the caller the report should name.
_MACHINERY_DIRS = (
    _TORCH_DIR,
    os.path.join(_HARNESS_DIR, "comm") + os.sep,
    os.path.join(_HARNESS_DIR, "threads") + os.sep,
    # The collectives under the installed torch's names: the caller's line is the site.
    os.path.join(_HARNESS_DIR, "torch_api.py"),
    # ``with`` blocks and ``@contextmanager`` helpers around a call are not its site.
    contextlib.__file__,
)
_BACKWARD_FRAME = (os.path.join(_TORCH_DIR, "autograd", "graph.py"), "_engine_run_backward")
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_MODULE_FILE = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")


def site_and_phase() -> tuple[str, str]:
    """The first caller outside torch and the harness, and the phase the stack implies.

    The phase is ``backward`` inside the autograd engine (e.g. a gradient hook),
    ``optimizer`` inside ``torch.optim``, ``forward`` inside a module call, else ``-``.
    The autograd engine is only seen when backward runs on the calling thread (CPU);
    on accelerators name phases explicitly with ``CommTracer.phase``.
    """
    frame = inspect.currentframe()
    site = None
    in_backward = in_optim = in_module = False
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if site is None and not filename.startswith(_MACHINERY_DIRS):
            site = f"{_short_path(filename)}:{frame.f_lineno} in {code.co_name}"
        if filename.startswith(_TORCH_DIR):
            if (filename, code.co_name) == _BACKWARD_FRAME:
                in_backward = True
            elif filename.startswith(_OPTIM_DIR):
                in_optim = True
            elif filename == _MODULE_FILE and code.co_name == "_call_impl":
                in_module = True
        frame = frame.f_back
    if in_backward:
        phase = "backward"
    elif in_optim:
        phase = "optimizer"
    elif in_module:
        phase = "forward"
    else:
        phase = "-"
    return site or "<unknown>", phase


@functools.lru_cache(maxsize=1024)
def _short_path(filename: str) -> str:
    """Relative to the working directory when below it (cached: sites repeat)."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


# --- process groups ---------------------------------------------------------------------


def default_group_name() -> str | None:
    world = dist.group.WORLD if dist.is_initialized() else None
    return group_name_of(world) if world is not None else None


def group_name_of(group: dist.ProcessGroup) -> str:
    """A group's c10d name, also for a vendor's Python ProcessGroup whose own ``group_name``
    was never set."""
    try:
        return group.group_name
    except RuntimeError:
        return _torch_private.registered_group_name(group)


def group_identity(group: Any, known: Callable[[], Iterable[Any]]) -> tuple[str, tuple[int, ...]]:
    """(c10d group name, global ranks) of a ProcessGroup, a group name, or None (default).

    ``known`` lists the live groups; it is consulted only to resolve a group name.
    """
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        for candidate in known():
            if group_name_of(candidate) == group:
                return group, tuple(dist.get_process_group_ranks(candidate))
        return group, ()
    if isinstance(group, dist.ProcessGroup):
        return group_name_of(group), tuple(dist.get_process_group_ranks(group))
    return str(group), ()


def bind_dist_call(name: str, func: Callable[..., Any], args: tuple, kwargs: dict) -> RawCall:
    """Classify a call of the ``torch.distributed`` function ``name``."""
    if name in BARRIER_FUNCTIONS:
        kind, in_params, out_params, peer_param = BARRIER, (), (), None
    else:
        kind, in_params, out_params, peer_param = DIST_FUNCTIONS[name]
    values = _binder(func).bind(args, kwargs)
    inputs = [t for p in in_params for t in flatten_tensors(values.get(p))]
    outputs = [t for p in out_params for t in flatten_tensors(values.get(p))]
    site, phase = site_and_phase()
    return RawCall(
        kind=kind,
        api=f"dist.{name}",
        group=values.get("group"),
        inputs=inputs,
        out_numel=sum(t.numel() for t in outputs),
        out_nbytes=sum(t.numel() * t.element_size() for t in outputs),
        site=site,
        auto_phase=phase,
        peer=values.get(peer_param) if peer_param else None,
        op=reduce_op_name(values.get("op")),
    )


class _ArgumentBinder:
    """A function's arguments by parameter name, defaults filled in.

    ``inspect.Signature.bind`` costs several microseconds, on every collective of every
    rank; the collectives take plain parameters, so a call that passes them in order or
    by name is bound with two dict updates. Anything else (too many arguments, an unknown
    or repeated name) goes to ``Signature.bind``, which raises what Python would.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        self._signature = inspect.signature(func)
        params = self._signature.parameters.values()
        plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self._simple = all(p.kind in plain for p in params)
        self._positional = tuple(
            p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        self._names = frozenset(p.name for p in params)
        self._defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        if (
            self._simple
            and len(args) <= len(self._positional)
            and self._names.issuperset(kwargs)
            and not any(name in kwargs for name in self._positional[: len(args)])
        ):
            values = dict(self._defaults)
            values.update(zip(self._positional, args, strict=False))
            values.update(kwargs)
            return values
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


_binders: dict[Any, _ArgumentBinder] = {}


def _binder(func: Callable[..., Any]) -> _ArgumentBinder:
    found = _binders.get(func)
    if found is None:
        found = _binders[func] = _ArgumentBinder(func)
    return found


def functional_op_name(func: Any) -> str | None:
    """``all_gather_into_tensor`` for ``_c10d_functional.all_gather_into_tensor[.default]``.

    Ops print as ``namespace.name[.overload]``; the op classes themselves live in a
    private torch module, so the printed name is what is matched.
    """
    parts = str(func).split(".")
    if len(parts) < 2 or parts[0] not in FUNCTIONAL_NAMESPACES or parts[1] not in FUNCTIONAL_OPS:
        return None
    return parts[1]


def bind_functional_call(name: str, args: tuple, kwargs: dict) -> RawCall:
    kind = FUNCTIONAL_OPS[name]
    inputs = flatten_tensors(args[0] if args else kwargs.get("input", kwargs.get("inputs")))
    group = kwargs.get("group_name", args[-1] if len(args) > 1 else None)
    numel = sum(t.numel() for t in inputs)
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    factor_num, factor_den = 1, 1
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        size = next((a for a in args[1:] if isinstance(a, int)), kwargs.get("group_size", 1))
        factor_num, factor_den = (size, 1) if kind == ALL_GATHER else (1, size)
    out_numel, out_nbytes = numel * factor_num // factor_den, nbytes * factor_num // factor_den
    if kind == ALL_TO_ALL and len(args) > 1 and args[1] and inputs:
        row = inputs[0].numel() // max(inputs[0].shape[0], 1) if inputs[0].dim() else 1
        out_numel = int(sum(args[1])) * row
        out_nbytes = out_numel * inputs[0].element_size()
    site, phase = site_and_phase()
    peer = args[1] if kind in POINT_TO_POINT and len(args) > 1 else None
    op = args[1] if kind in (ALL_REDUCE, REDUCE_SCATTER) and len(args) > 1 else None
    return RawCall(
        kind=kind,
        api=f"funcol.{name}",
        group=group,
        inputs=inputs,
        out_numel=out_numel,
        out_nbytes=out_nbytes,
        site=site,
        auto_phase=phase,
        peer=peer,
        op=reduce_op_name(op),
    )
