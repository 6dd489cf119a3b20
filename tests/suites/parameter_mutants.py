"""One broken implementation per name of the coverage tables: the parameter ignored.

``--impl 'tests.suites.parameter_mutants:<base>|<name>'`` loads ``<base>`` (``torch`` or
``reference``) with the one parameter, field or value class ``<name>`` of
``suites/coverage/*.toml`` ignored, as a realistic bug would ignore it:

* ``f(arg)``, ``C(arg)``, ``C.method(arg)``: the argument is dropped, so the callee sees its
  default (an argument without a default has no such mutant: no call can leave it out);
* ``f(arg=V)``, ``C.field=V``: a value of class ``V`` (``True``, ``None``, ``Shard``...) is
  replaced: by the default where the default is of another class, otherwise by a value of
  the next class the annotation offers (``True`` -> ``False``, ``None`` -> ``bfloat16``...);
* ``C.field``: the field is reset to its default after construction;
* ``C.method`` (FSDP2's setters, ``reshard``...), ``register_fsdp_forward_method``,
  ``share_comm_ctx``, ``loss_parallel``: the call does nothing.

Where the mutation sits: FSDP2's own names in the implementation under test (the arguments
``fully_shard`` and ``replicate`` receive, the policies among them, and the methods of each
module they return), so the same mutant breaks the reference or torch's FSDP2; the other
families (``torch.distributed.checkpoint.state_dict``, ``torch.distributed.tensor.parallel``,
``torch.distributed.pipelining``) in torch itself, patched in the processes of that session
(the ranks build their implementation, so their patches are installed before any case runs
there). A class is patched on the class (its ``__init__``, its ``step``), so a suite that
imported it by name sees the patch; a function is patched as a module attribute, which is why
the suites call those functions through their module (``dsd.get_state_dict``), never by a
name imported from it (``tests/suites/test_parameter_mutants.py`` checks that).

:func:`mutant_for` says, for a name, which mutant it has or why it has none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as state_dict
import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.schedules as schedules
import torch.distributed.tensor.parallel as tensor_parallel
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from distconform.impl import _torch_private
from distconform.impl.api import Implementation, load_implementation
from distconform.suites.api_surface import value_classes

#: FSDP2's names, mutated in the implementation under test rather than in torch.
FSDP_OBJECTS = frozenset(
    {
        "fully_shard",
        "replicate",
        "FSDPModule",
        "UnshardHandle",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "register_fsdp_forward_method",
        "share_comm_ctx",
    }
)
#: Which ``fully_shard`` keyword carries each policy's fields.
POLICY_ARGUMENTS = {
    "MixedPrecisionPolicy": "mp_policy",
    "CPUOffloadPolicy": "offload_policy",
    "DataParallelMeshDims": "dp_mesh_dims",
}
#: Torch's modules whose public names the other families list, searched in this order.
TORCH_MODULES = (state_dict, tensor_parallel, pipelining, schedules)
#: Functions whose mutant is "does nothing": what each is replaced by.
NOOP_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "loss_parallel": contextlib.nullcontext,
}
#: FSDP2's implementation-level calls whose mutant is "does nothing".
NOOP_IMPLEMENTATION_CALLS = frozenset({"register_fsdp_forward_method", "share_comm_ctx"})

#: Where ``None`` stands for a documented value, that value: the value class a "default" has.
#: ``ColwiseParallel(input_layouts=Replicate)`` is what ``None`` means, so ignoring it changes
#: nothing and its mutant must pass another placement instead.
SEMANTIC_DEFAULTS: dict[str, Any] = {
    "ColwiseParallel(input_layouts)": Replicate(),
    "ColwiseParallel(output_layouts)": Shard(-1),
    "RowwiseParallel(input_layouts)": Shard(-1),
    "RowwiseParallel(output_layouts)": Replicate(),
}

_NAME = re.compile(
    r"^(?P<owner>[A-Za-z_]\w*)"
    r"(?:\.(?P<member>[A-Za-z_]\w*))?"
    r"(?:\((?P<argument>\w+)(?:=(?P<argument_class>\w+))?\))?"
    r"(?:=(?P<field_class>\w+))?$"
)


# --- value classes ---------------------------------------------------------------------------


def value_class(value: Any) -> str:
    """The value class of ``value``, as ``distconform.suites.api_surface.value_classes``
    names them."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return "int"
    if isinstance(value, torch.dtype):
        return "dtype"
    if isinstance(value, Shard):
        return "Shard"
    if isinstance(value, Replicate):
        return "Replicate"
    if isinstance(value, str):
        return "str"
    if isinstance(value, tuple):
        return "tuple"
    return type(value).__name__


def value_of_class(name: str, current: Any) -> Any:
    """A value of class ``name`` to put in place of ``current``; ``LookupError`` for a class
    no value can be made of without knowing the call (a mesh dim's name, a tuple)."""
    made = {
        "True": True,
        "False": False,
        "None": None,
        "int": 2,
        "dtype": torch.float16 if current == torch.bfloat16 else torch.bfloat16,
        "Shard": Shard(0),
        "Replicate": Replicate(),
    }
    if name not in made:
        raise LookupError(name)
    return made[name]


# --- what a name's mutant is -----------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    """The mutant of one table name."""

    name: str
    owner: str  #: the function or class: "fully_shard", "StateDictOptions", "FSDPModule"
    member: str | None  #: a method or field: "set_requires_gradient_sync", "strict"
    argument: str | None  #: an argument of the function, constructor or method
    value: str | None  #: the value class replaced, or None for the argument or field itself
    replacement: Callable[[Any], Any] | None  #: the new value from the current one
    noop: bool = False  #: the call does nothing

    @property
    def is_field(self) -> bool:
        return self.member is not None and self.argument is None and not self.noop


@dataclass(frozen=True)
class NoMutant:
    """Why a table name has no mutant of its own (its arguments' rows have theirs)."""

    name: str
    reason: str


def _signature_target(owner: Any, member: str | None) -> Callable:
    if member is None:
        return owner
    return getattr(owner, member)


def _parameter(target: Callable, argument: str) -> inspect.Parameter:
    return inspect.signature(target).parameters[argument]


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(field for field in dataclasses.fields(cls) if field.name == name)


def _field_annotation(cls: type, field: dataclasses.Field) -> Any:
    try:
        return typing.get_type_hints(cls).get(field.name, field.type)
    except (NameError, TypeError):  # a forward reference this release cannot resolve
        return field.type


def _default_of_field(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty


def _owner_object(owner: str) -> Any:
    """The object a family table's owner names (FSDP2's from torch's public module)."""
    if owner in FSDP_OBJECTS:
        if owner == "replicate":
            return _torch_private.torch_replicate()
        return getattr(torch.distributed.fsdp, owner)
    for module in TORCH_MODULES:
        if hasattr(module, owner):
            return getattr(module, owner)
    raise LookupError(f"{owner}: in none of torch's modules the coverage tables list")


def _replacing(
    name: str, value: str, default: Any, semantic_key: str, offered: list[str] | None = None
) -> Callable | NoMutant:
    """How a value of class ``value`` is replaced: by the default when the default (what it
    means, where ``SEMANTIC_DEFAULTS`` says) is of another class, else by the next class the
    annotation offers (``offered``) that means something else. An explicit ``None`` means
    what a ``None`` default means: ``ColwiseParallel(input_layouts=None)`` is ``Replicate()``,
    so neither ``None`` nor ``Replicate`` may replace it."""
    meaning = SEMANTIC_DEFAULTS.get(semantic_key, default)

    def means(cls: str) -> str:
        return value_class(meaning) if cls == "None" and default is None else cls

    if default is not inspect.Parameter.empty and value_class(meaning) != means(value):
        return lambda current: default
    for candidate in ("False", "True", "None", "dtype", "Replicate", "Shard", "int"):
        if means(candidate) == means(value):
            continue
        if offered is not None and candidate not in offered:
            continue  # a placement is never replaced by a dtype
        if offered is None and candidate in ("True", "False") and value not in ("True", "False"):
            continue  # without an annotation to go by, a non-bool is never replaced by a bool
        try:
            value_of_class(candidate, None)
        except LookupError:
            continue
        return lambda current, candidate=candidate: value_of_class(candidate, current)
    return NoMutant(
        name, f"a value class no other value can replace without knowing the call: {value}"
    )


def mutant_for(name: str) -> Mutant | NoMutant:
    """The mutant of table name ``name``, or why it has none."""
    match = _NAME.match(name)
    if match is None:
        return NoMutant(name, "not a name of the table grammar")
    owner, member = match["owner"], match["member"]
    argument, value = match["argument"], match["argument_class"] or match["field_class"]
    try:
        obj = _owner_object(owner)
    except LookupError as error:
        return NoMutant(name, str(error))
    if member is not None and dataclasses.is_dataclass(obj) and argument is None:
        field = _field(obj, member)
        default = _default_of_field(field)
        if value is None:
            return Mutant(name, owner, member, None, None, lambda current: default)
        offered = value_classes(_field_annotation(obj, field)) or None
        how = _replacing(name, value, default, f"{owner}.{member}", offered)
        if isinstance(how, NoMutant):
            return how
        return Mutant(name, owner, member, None, value, how)
    if argument is None:
        if member is not None and owner == "FSDPModule":
            return Mutant(name, owner, member, None, None, None, noop=True)
        if member is None and (owner in NOOP_FUNCTIONS or owner in NOOP_IMPLEMENTATION_CALLS):
            return Mutant(name, owner, None, None, None, None, noop=True)
        if member is not None:
            return NoMutant(name, "a method other than FSDPModule's setters: its arguments' rows")
        return NoMutant(name, "a function or class itself: its arguments' and fields' rows")
    if member is not None and owner != "FSDPModule" and not name.startswith(f"{owner}.step("):
        return NoMutant(name, "a method argument outside FSDPModule and the schedules' step")
    parameter = _parameter(_signature_target(obj, member), argument)
    default = parameter.default
    key = f"{owner}{'.' + member if member else ''}({argument})"
    if value is None:
        if default is inspect.Parameter.empty:
            return NoMutant(name, "a required argument: no call can leave it out")
        return Mutant(name, owner, member, argument, None, lambda current: default)
    how = _replacing(name, value, default, key, value_classes(parameter.annotation) or None)
    if isinstance(how, NoMutant):
        return how
    return Mutant(name, owner, member, argument, value, how)


# --- applying a mutant to a call -------------------------------------------------------------


def mutated_arguments(mutant: Mutant, signature: inspect.Signature, args, kwargs):
    """``(args, kwargs)`` of a call with the mutant's argument replaced where it applies."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    current = bound.arguments[mutant.argument]
    if mutant.value is None or value_class(current) == mutant.value:
        bound.arguments[mutant.argument] = mutant.replacement(current)
    return bound.args, bound.kwargs


def mutated_object(mutant: Mutant, obj: Any) -> Any:
    """A copy of dataclass instance ``obj`` with the mutant's field replaced where it applies."""
    current = getattr(obj, mutant.member)
    if mutant.value is not None and value_class(current) != mutant.value:
        return obj
    # A copy: the caller's policy may be shared by several calls, and torch's are frozen.
    return dataclasses.replace(obj, **{mutant.member: mutant.replacement(current)})


def _wrap_call(mutant: Mutant, function: Callable) -> Callable:
    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = mutated_arguments(mutant, signature, args, kwargs)
        return function(*args, **kwargs)

    return call


def _patch_torch(mutant: Mutant) -> None:
    """Install ``mutant`` in torch, once per process."""
    obj = _owner_object(mutant.owner)
    if getattr(obj, "_distconform_mutant", None) == mutant.name:
        return
    if mutant.noop:
        for module in TORCH_MODULES:
            if getattr(module, mutant.owner, None) is obj:
                setattr(module, mutant.owner, NOOP_FUNCTIONS[mutant.owner])
        return
    if inspect.isclass(obj) and mutant.is_field:
        original_init = obj.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            current = getattr(self, mutant.member)
            if mutant.value is None or value_class(current) == mutant.value:
                object.__setattr__(self, mutant.member, mutant.replacement(current))

        obj.__init__ = functools.wraps(original_init)(init)
    elif inspect.isclass(obj):
        attribute = mutant.member or "__init__"
        setattr(obj, attribute, _wrap_call(mutant, getattr(obj, attribute)))
    else:
        wrapped = _wrap_call(mutant, obj)
        for module in TORCH_MODULES:
            if getattr(module, mutant.owner, None) is obj:
                setattr(module, mutant.owner, wrapped)
        obj = wrapped
    obj._distconform_mutant = mutant.name


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


# --- the implementation ----------------------------------------------------------------------


class MutantImplementation(Implementation):
    """``base`` with the one name ``mutant`` ignored (see the module docstring)."""

    def __init__(self, base_spec: str, mutant: Mutant) -> None:
        self.base = load_implementation(base_spec)
        self.mutant = mutant
        self.name = f"{self.base.name} ignoring {mutant.name}"
        self.capabilities = self.base.capabilities
        self.MixedPrecisionPolicy = self.base.MixedPrecisionPolicy
        self.OffloadPolicy = self.base.OffloadPolicy
        self.CPUOffloadPolicy = self.base.CPUOffloadPolicy
        self.DataParallelMeshDims = self.base.DataParallelMeshDims
        self.FSDPModule = self.base.FSDPModule
        if mutant.owner not in FSDP_OBJECTS:
            _patch_torch(mutant)

    # --- FSDP2's names: in the implementation under test ---------------------------------------

    def _arguments(self, entry: str, call: Callable, args, kwargs) -> tuple:
        mutant = self.mutant
        if mutant.owner == entry and mutant.argument is not None:
            return mutated_arguments(mutant, inspect.signature(call), args, kwargs)
        policy = POLICY_ARGUMENTS.get(mutant.owner)
        if policy is None or not mutant.is_field:
            return args, kwargs
        given = kwargs.get(policy)
        if given is None and mutant.owner == "MixedPrecisionPolicy":
            given = self.MixedPrecisionPolicy()
        if given is None or not isinstance(given, _owner_object(mutant.owner)):
            return args, kwargs
        return args, {**kwargs, policy: mutated_object(mutant, given)}

    def _managed(self, result: Any) -> Any:
        mutant = self.mutant
        if mutant.owner != "FSDPModule":
            return result
        for module in result if isinstance(result, list) else [result]:
            method = getattr(module, mutant.member)
            if mutant.noop:
                object.__setattr__(module, mutant.member, _noop)
            else:
                object.__setattr__(module, mutant.member, _wrap_call(mutant, method))
        return result

    def fully_shard(self, module: nn.Module | list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._arguments(
            "fully_shard", self.base.fully_shard, (module, *args), kwargs
        )
        return self._managed(self.base.fully_shard(*args, **kwargs))

    def replicate(self, module: nn.Module | list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._arguments("replicate", self.base.replicate, (module, *args), kwargs)
        return self._managed(self.base.replicate(*args, **kwargs))

    def register_fsdp_forward_method(self, module: nn.Module, method_name: str) -> None:
        if self.mutant.owner == "register_fsdp_forward_method" and self.mutant.noop:
            return
        self.base.register_fsdp_forward_method(module, method_name)

    def share_comm_ctx(self, modules: list[nn.Module]) -> None:
        if self.mutant.owner == "share_comm_ctx" and self.mutant.noop:
            return
        self.base.share_comm_ctx(modules)

    def is_managed(self, module: nn.Module) -> bool:
        return self.base.is_managed(module)

    def is_group_unsharded(self, module: nn.Module) -> bool:
        return self.base.is_group_unsharded(module)

    def modules_to_run_forward(self, module: nn.Module) -> set[nn.Module]:
        return self.base.modules_to_run_forward(module)

    def set_unshard_async_op(self, module: nn.Module, async_op: bool) -> None:
        self.base.set_unshard_async_op(module, async_op)


BASES = ("torch", "reference")


def spec(base: str, name: str) -> str:
    """The ``--impl`` spec of ``base`` with ``name`` ignored."""
    return f"{__name__}:{base}|{name}"


def __getattr__(factory: str) -> Callable[[], MutantImplementation]:
    """``<base>|<name>`` as a factory (``load_implementation`` looks factories up by name)."""
    base, separator, name = factory.partition("|")
    if not separator or base not in BASES:
        raise AttributeError(factory)
    mutant = mutant_for(name)
    if isinstance(mutant, NoMutant):
        raise AttributeError(f"{name} has no mutant: {mutant.reason}")
    return functools.partial(MutantImplementation, base, mutant)


def names_with_mutants(names: Iterator[str]) -> Iterator[Mutant]:
    for name in names:
        mutant = mutant_for(name)
        if isinstance(mutant, Mutant):
            yield mutant
