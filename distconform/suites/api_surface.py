"""The public surfaces of the installed torch that the conformance suites claim, spelled as the
coverage tables (``suites/coverage/*.toml``, ``suites/backend/api_coverage.toml``) spell them.

One family per table (:data:`distconform.suites.api_coverage.FAMILIES`):

* ``fsdp``: each name of ``torch.distributed.fsdp.__all__``; for FSDP2's own objects (those
  whose ``__module__`` is the public ``torch.distributed.fsdp``: FSDP1's name its submodules)
  each argument of a function, each field of a dataclass, each public method a class defines
  and each argument of those methods; and FSDP2's ``replicate`` with its arguments (no public
  import path in the window: it comes through the audited
  :func:`distconform.impl._torch_private.torch_replicate`);
* ``state_dict``: ``torch.distributed.checkpoint.state_dict``: its functions and their
  arguments, every ``StateDictOptions`` field, its type aliases by name;
* ``tensor_parallel``: ``torch.distributed.tensor.parallel``: each style's constructor
  arguments, ``parallelize_module``'s arguments, ``loss_parallel``;
* ``pipelining``: ``torch.distributed.pipelining`` and its ``schedules`` module: every schedule
  class's constructor arguments and ``step`` arguments, ``PipelineStage``'s constructor
  arguments, the tracer front end's functions and arguments, ``SplitPoint``'s members.

Names: ``f`` (a function or class), ``f(arg)`` (an argument, a constructor's for a class),
``C.field`` (a dataclass field), ``C.method`` and ``C.method(arg)``, ``Enum.MEMBER``. Where an
argument's annotation offers a choice, every value class is a name too, ``f(arg=True)``:
``True`` and ``False`` for a bool, ``int`` beside a bool, ``None`` beside anything else,
``dtype``, ``Shard`` and ``Replicate`` for a placement, ``tuple`` and ``str`` beside those
(:func:`value_classes`). A case covers a value class only if its oracle would differ with
another value there.

c10d: each name of ``torch.distributed.distributed_c10d.__all__``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import typing
from collections.abc import Callable, Iterator

import torch.distributed.checkpoint.state_dict as state_dict
import torch.distributed.distributed_c10d as c10d
import torch.distributed.fsdp as fsdp
import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.schedules as schedules
import torch.distributed.tensor.parallel as tensor_parallel

from distconform.impl import _torch_private

#: The public module every FSDP2 object names as its own.
PUBLIC_MODULE = "torch.distributed.fsdp"

#: The order value classes are listed in.
_CLASS_ORDER = ("True", "False", "int", "dtype", "Shard", "Replicate", "str", "tuple", "None")
#: Abstract bases of the schedules module: named, never constructed by a user as such.
_SCHEDULE_BASES = frozenset({"PipelineScheduleSingle", "PipelineScheduleMulti"})


# --- value classes ---------------------------------------------------------------------------


def _annotation_text(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def _top_level_alternatives(text: str) -> list[str]:
    """``"A | B[C | D] | None"`` as ``["A", "B[C | D]", "None"]``; ``Optional``/``Union``
    unwrapped."""
    text = text.strip()
    for wrapper in ("typing.Optional[", "Optional["):
        if text.startswith(wrapper) and text.endswith("]"):
            return [*_top_level_alternatives(text[len(wrapper) : -1]), "None"]
    for wrapper in ("typing.Union[", "Union["):
        if text.startswith(wrapper) and text.endswith("]"):
            return _split_top_level(text[len(wrapper) : -1], ",")
    return _split_top_level(text, "|")


def _split_top_level(text: str, separator: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == separator and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return [part for part in parts if part]


def _classes_of(alternative: str) -> tuple[str, ...]:
    head = re.split(r"[\[.]", alternative.split("[", 1)[0])[-1]
    if alternative.split("[", 1)[0].endswith("dtype"):
        return ("dtype",)
    return {
        "bool": ("True", "False"),
        "int": ("int",),
        "None": ("None",),
        "NoneType": ("None",),
        "Placement": ("Shard", "Replicate"),
        "str": ("str",),
        "tuple": ("tuple",),
    }.get(head, ())


def value_classes(annotation: object) -> list[str]:
    """The value classes of an annotation that offers a choice; ``[]`` when it offers none
    (one class, or classes that only differ in container, like ``Tensor | tuple[Tensor]``)."""
    if annotation is inspect.Parameter.empty:
        return []
    found: set[str] = set()
    for alternative in _top_level_alternatives(_annotation_text(annotation)):
        found.update(_classes_of(alternative))
    if not found - {"None", "tuple"}:
        return []
    if len(found) < 2:
        return []
    return [name for name in _CLASS_ORDER if name in found]


# --- names of one object ---------------------------------------------------------------------


def _parameters(function: Callable) -> Iterator[inspect.Parameter]:
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name == "self" or parameter.name.startswith("_"):
            continue  # a private argument is no part of the public surface
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        yield parameter


def argument_names(name: str, function: Callable) -> Iterator[str]:
    """``name(arg)`` for each argument of ``function``, and ``name(arg=CLASS)`` for each value
    class of an argument that offers a choice."""
    for parameter in _parameters(function):
        yield f"{name}({parameter.name})"
        yield from (
            f"{name}({parameter.name}={value})" for value in value_classes(parameter.annotation)
        )


def field_names(name: str, cls: type) -> Iterator[str]:
    """``name.field`` for each field of a dataclass, and ``name.field=CLASS`` for each value
    class of a field that offers a choice."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # a forward reference another release cannot resolve
        hints = {}
    for field in dataclasses.fields(cls):
        yield f"{name}.{field.name}"
        annotation = hints.get(field.name, field.type)
        yield from (f"{name}.{field.name}={value}" for value in value_classes(annotation))


def method_names(name: str, cls: type) -> Iterator[str]:
    """``name.method`` for each public method ``cls`` defines, with its arguments."""
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        yield f"{name}.{attr}"
        if inspect.isfunction(value):
            yield from argument_names(f"{name}.{attr}", value)


def _enum_names(name: str, cls: type[enum.Enum]) -> Iterator[str]:
    yield from (f"{name}.{member.name}" for member in cls)


# --- the families ----------------------------------------------------------------------------


def fsdp_surface() -> list[str]:
    """Every public FSDP2-related name of the installed torch."""
    names: list[str] = []
    for name in fsdp.__all__:
        obj = getattr(fsdp, name)
        names.append(name)
        if getattr(obj, "__module__", None) != PUBLIC_MODULE:
            continue
        if inspect.isfunction(obj):
            names += argument_names(name, obj)
        elif dataclasses.is_dataclass(obj):
            names += field_names(name, obj)
        elif inspect.isclass(obj):
            names += method_names(name, obj)
    names.append("replicate")
    names += argument_names("replicate", _torch_private.torch_replicate())
    return names


def state_dict_surface() -> list[str]:
    """Every public name of ``torch.distributed.checkpoint.state_dict``."""
    names: list[str] = []
    for name in state_dict.__all__:
        obj = getattr(state_dict, name)
        names.append(name)
        if inspect.isfunction(obj):
            names += argument_names(name, obj)
        elif dataclasses.is_dataclass(obj):
            names += field_names(name, obj)
    return names


def tensor_parallel_surface() -> list[str]:
    """Every public name of ``torch.distributed.tensor.parallel``: each style's constructor
    arguments (their methods are the engine's: ``parallelize_module`` calls them)."""
    names: list[str] = []
    for name in tensor_parallel.__all__:
        obj = getattr(tensor_parallel, name)
        names.append(name)
        if inspect.isfunction(obj) or (inspect.isclass(obj) and not inspect.isabstract(obj)):
            names += argument_names(name, obj)
    return names


def pipelining_surface() -> list[str]:
    """Every public name of ``torch.distributed.pipelining`` and of its ``schedules`` module:
    constructor arguments of each stage and schedule class, each schedule's ``step``
    arguments (a stage's other methods are the schedules' to call, not a user's)."""
    names: list[str] = []
    public = dict.fromkeys([*pipelining.__all__, *schedules.__all__])
    for name in public:
        obj = getattr(pipelining, name, None) or getattr(schedules, name)
        names.append(name)
        if name in _SCHEDULE_BASES:
            continue
        if inspect.isclass(obj) and issubclass(obj, enum.Enum):
            names += _enum_names(name, obj)
        elif inspect.isfunction(obj):
            names += argument_names(name, obj)
        elif inspect.isclass(obj):
            names += argument_names(name, obj)
            if issubclass(obj, (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti)):
                names += argument_names(f"{name}.step", obj.step)
    return names


def c10d_surface() -> list[str]:
    """Every public name of the installed torch's c10d Python API."""
    return list(c10d.__all__)


#: Family name (as :data:`distconform.suites.api_coverage.FAMILIES` names them) -> its surface.
SURFACES: dict[str, Callable[[], list[str]]] = {
    "fsdp": fsdp_surface,
    "state_dict": state_dict_surface,
    "tensor_parallel": tensor_parallel_surface,
    "pipelining": pipelining_surface,
}


def public_surface() -> list[str]:
    """The FSDP2 family's surface (the name the first table's tests use)."""
    return fsdp_surface()
