"""The case tables and how they turn into pytest items and skips.

Two tables, one per subject under test: ``suites/cases.toml`` (the sharding implementation,
capabilities declared by ``--impl``) and ``suites/backend/cases.toml`` (the communication
backend, capability names in ``suites/backend_capabilities.py``, declared in the backend's
TOML declaration, ``suites/backend/declaration.py``).
They share one format and one id space; each row records its subject, so the conformance
plugin asks the right party for capabilities and the report keeps their profiles apart.

A suite function is tied to one case with ``@conformance("fsdp.parity.single_group")``: the
decorator marks it with the case's world sizes (one item per size) and with
``conformance_case``. At collection, ``apply_case_table`` then

* skips, with a reason starting ``CPU:``, the items a CPU run cannot execute (the case's
  ``cpu`` verdict, or a grid value listed under ``cpu_skip``);
* skips, with a reason starting ``UNSUPPORTED:``, the items that need a capability the
  implementation does not declare (``requires``, plus ``param_requires`` for grid values);
* skips on a launcher the case's ``launchers`` leave out (``LAUNCHER:``);
* marks ``slow`` every item whose parameter id matches none of the case's ``fast``
  patterns (no ``fast`` key: every item is in the default run);
* gives a pool of its own to items that reshard to an int smaller than the world size
  (torch caches the sub-mesh by value while the harness destroys its groups after a test);
* records, skipped or not, the item's case and the capabilities it needs as user properties
  (``conformance_case``, ``capabilities``), which the conformance report groups by profile;
* leaves out the items of an ``only_undeclared`` case (the refusal probes, parametrized by
  ``capability=X``) whose capability the implementation declares: its own cases run instead.

Every case has a ``description`` (what it checks, what a failing implementation gets wrong);
``python -m distconform.suites.catalogue`` renders the table, descriptions and profiles as
``docs/cases.md``.

The table's ``[profile.NAME]`` rows are the conformance profiles (``load_profiles``): a
required core, and one extension per capability no profile lists, named after it.

Grid values are matched as tokens of the item's parameter id: its ``-``-separated parts
without the world size, ``name=value`` for ids built with :func:`grid_id` (the preferred
form), or bare values such as ``bf16`` for ids that name values only (the composition suites'
``1F1B-replicate-bf16``). A key of ``param_requires`` or ``cpu_skip`` must equal one token.
"""

from __future__ import annotations

import fnmatch
import functools
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from distconform.extension import BUILT_IN_LAUNCHERS
from distconform.extension import device_type as registered_device
from distconform.suites.backend_capabilities import KNOWN_BACKEND_CAPABILITIES

CASES_FILE = Path(__file__).with_name("cases.toml")
#: The backend suite's table: cases about a communication backend, not an implementation.
BACKEND_CASES_FILE = Path(__file__).parent / "backend" / "cases.toml"
#: What a case table's capabilities belong to: the FSDP implementation (``--impl``) or the
#: c10d backend (``--backend``); each has its own capabilities, profiles and declaration.
IMPLEMENTATION = "implementation"
BACKEND = "backend"
SUBJECTS = (IMPLEMENTATION, BACKEND)
#: The marker ``@conformance`` puts on a suite function (registered by the conformance plugin).
CASE_MARKER = "conformance_case"
#: User properties of a test tied to a case, which the conformance report groups by profile.
CASE_PROPERTY = "conformance_case"
CAPABILITIES_PROPERTY = "capabilities"
SUBJECT_PROPERTY = "conformance_subject"
CPU_PREFIX = "CPU:"
UNSUPPORTED_PREFIX = "UNSUPPORTED:"
#: Starts the skip reason of a suite module that cannot be imported for want of a package:
#: the conformance report names it in the headline, and the run's verdict is INCOMPLETE.
MISSING_DEPENDENCY_PREFIX = "MISSING DEPENDENCY:"
LAUNCHER_PREFIX = "LAUNCHER:"
#: The launchers a case row may name (distconform's own).
LAUNCHERS = frozenset(BUILT_IN_LAUNCHERS)


@dataclass(frozen=True)
class Profile:
    """A set of capabilities whose cases are reported together: a required core or an
    extension (``distconform.conformance.hookspecs.pytest_distconform_conformance_profiles``)."""

    name: str
    description: str
    required: bool
    capabilities: tuple[str, ...]
    #: Whose capabilities these are (``IMPLEMENTATION`` or ``BACKEND``).
    subject: str = IMPLEMENTATION

    def as_hook_dict(self) -> dict[str, Any]:
        """The form ``pytest_distconform_conformance_profiles`` returns."""
        return {
            "name": self.name,
            "description": self.description,
            "required": self.required,
            "capabilities": list(self.capabilities),
            "subject": self.subject,
        }


@dataclass(frozen=True)
class Case:
    """One row of the case table."""

    case_id: str
    upstream: str
    #: What the case checks and what a failing implementation gets wrong (docs/cases.md).
    description: str
    world_sizes: tuple[int, ...]
    cpu: bool
    cpu_reason: str
    requires: tuple[str, ...]
    param_requires: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cpu_skip: dict[str, str] = field(default_factory=dict)
    launchers: frozenset[str] = LAUNCHERS
    fast: tuple[str, ...] | None = None
    suite: str = ""
    #: Items parametrized by ``capability=X`` apply only where X is not declared (refusals).
    only_undeclared: bool = False
    #: Whose capabilities ``requires`` names: the implementation's or the backend's.
    subject: str = IMPLEMENTATION

    def needed_capabilities(self, tokens: Iterable[str]) -> list[str]:
        """What an item with these parameter tokens needs: ``requires`` plus its grid values'
        ``param_requires``, sorted."""
        needed = set(self.requires)
        for token in tokens:
            needed.update(self.param_requires.get(token, ()))
        return sorted(needed)

    def missing_capabilities(self, tokens: Iterable[str], declared: frozenset[str]) -> list[str]:
        return [cap for cap in self.needed_capabilities(tokens) if cap not in declared]

    def cpu_skip_reason(self, tokens: Iterable[str]) -> str | None:
        if not self.cpu:
            return self.cpu_reason
        for token in tokens:
            if token in self.cpu_skip:
                return self.cpu_skip[token]
        return None

    def is_fast(self, param_id: str, world_size: int | None) -> bool:
        """Whether the item belongs to the default run.

        Patterns match ``ws<N>-<param id>``; a pattern without a ``ws`` prefix means the
        case's smallest world size (the larger ones are the slow run's).
        """
        if self.fast is None:
            return True
        full = f"ws{world_size}-{param_id}" if param_id else f"ws{world_size}"
        smallest = min(self.world_sizes)
        for pattern in self.fast:
            if not pattern.startswith("ws"):
                pattern = f"ws{smallest}-{pattern}" if pattern else f"ws{smallest}"
            if fnmatch.fnmatchcase(full, pattern):
                return True
        return False


def _tuple(value: Any, what: str) -> tuple:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {value!r}")
    return tuple(value)


def parse_cases(
    text: str,
    *,
    known_capabilities: Iterable[str] | None = None,
    require_description: bool = False,
    subject: str = IMPLEMENTATION,
) -> dict[str, Case]:
    """The cases of a TOML text, validated (unknown keys and capabilities are errors).

    A ``description`` must be a non-empty string wherever it is given; with
    ``require_description`` (the project's table: :func:`read_cases`) every row needs one.
    Fragments parsed to exercise other rules may leave it out. A top-level
    ``[param_requires]`` applies to every row (the backend table's ``dtype=X`` tokens), under
    the row's own entries.
    """
    known = frozenset(known_capabilities) if known_capabilities is not None else None
    allowed_keys = {
        "upstream",
        "description",
        "world_sizes",
        "cpu",
        "cpu_reason",
        "requires",
        "param_requires",
        "cpu_skip",
        "launchers",
        "fast",
        "suite",
        "only_undeclared",
    }
    document = tomllib.loads(text)
    raw = document.get("case", {})
    shared_requires = {
        k: _tuple(v, "param_requires") for k, v in document.get("param_requires", {}).items()
    }
    cases: dict[str, Case] = {}
    for case_id, row in raw.items():
        unknown = set(row) - allowed_keys
        if unknown:
            raise ValueError(f"case {case_id!r}: unknown keys {sorted(unknown)}")
        description = row.get("description")
        if description is None:
            if require_description:
                raise ValueError(
                    f"case {case_id!r}: no description (say what it checks and what a failing "
                    f"implementation gets wrong)"
                )
            description = ""
        elif not isinstance(description, str) or not description.strip():
            raise ValueError(f"case {case_id!r}: description must be a non-empty string")
        cpu = row.get("cpu", True)
        if not cpu and not str(row.get("cpu_reason", "")).startswith(CPU_PREFIX):
            raise ValueError(f"case {case_id!r}: cpu = false needs a cpu_reason starting 'CPU:'")
        param_requires = {
            **shared_requires,
            **{
                k: _tuple(v, f"{case_id}.param_requires")
                for k, v in row.get("param_requires", {}).items()
            },
        }
        cpu_skip = dict(row.get("cpu_skip", {}))
        for token, reason in cpu_skip.items():
            if not reason.startswith(CPU_PREFIX):
                raise ValueError(f"case {case_id!r}: cpu_skip[{token!r}] must start with 'CPU:'")
        requires = _tuple(row.get("requires", []), f"{case_id}.requires")
        if known is not None:
            named = set(requires).union(*param_requires.values())
            if named - known:
                raise ValueError(f"case {case_id!r}: unknown capabilities {sorted(named - known)}")
        launchers = frozenset(row.get("launchers", sorted(LAUNCHERS)))
        if launchers - LAUNCHERS:
            raise ValueError(f"case {case_id!r}: unknown launchers {sorted(launchers - LAUNCHERS)}")
        fast = row.get("fast")
        cases[case_id] = Case(
            case_id=case_id,
            upstream=row.get("upstream", ""),
            description=" ".join(description.split()),
            world_sizes=_tuple(row["world_sizes"], f"{case_id}.world_sizes"),
            cpu=cpu,
            cpu_reason=row.get("cpu_reason", ""),
            requires=requires,
            param_requires=param_requires,
            cpu_skip=cpu_skip,
            launchers=launchers,
            fast=None if fast is None else _tuple(fast, f"{case_id}.fast"),
            suite=row.get("suite", ""),
            only_undeclared=bool(row.get("only_undeclared", False)),
            subject=subject,
        )
    return cases


def parse_profiles(
    text: str,
    *,
    known_capabilities: Iterable[str] | None = None,
    subject: str = IMPLEMENTATION,
) -> dict[str, Profile]:
    """The ``[profile.NAME]`` rows of a TOML text, validated like the cases."""
    known = frozenset(known_capabilities) if known_capabilities is not None else None
    allowed_keys = {"description", "required", "capabilities"}
    profiles: dict[str, Profile] = {}
    for name, row in tomllib.loads(text).get("profile", {}).items():
        unknown = set(row) - allowed_keys
        if unknown:
            raise ValueError(f"profile {name!r}: unknown keys {sorted(unknown)}")
        required = row.get("required", False)
        if not isinstance(required, bool):
            raise ValueError(f"profile {name!r}: required must be true or false")
        capabilities = _tuple(row.get("capabilities", []), f"profile {name}.capabilities")
        if not capabilities:
            raise ValueError(f"profile {name!r}: lists no capabilities")
        if known is not None and set(capabilities) - known:
            raise ValueError(
                f"profile {name!r}: unknown capabilities {sorted(set(capabilities) - known)}"
            )
        profiles[name] = Profile(
            name, str(row.get("description", "")), required, capabilities, subject
        )
    return profiles


def with_extensions(
    profiles: dict[str, Profile], known_capabilities: Iterable[str], subject: str = IMPLEMENTATION
) -> tuple[Profile, ...]:
    """The table's profiles, then one extension per capability none of them lists."""
    listed = {cap for profile in profiles.values() for cap in profile.capabilities}
    extensions = []
    for capability in sorted(set(known_capabilities) - listed):
        if capability in profiles:
            raise ValueError(f"profile {capability!r} is named after a capability it leaves out")
        extensions.append(
            Profile(capability, f"extension: {capability}", False, (capability,), subject)
        )
    return (*profiles.values(), *extensions)


def known_capabilities(subject: str) -> frozenset[str]:
    """The capability names a subject's case table and declarations may use."""
    if subject == BACKEND:
        return KNOWN_BACKEND_CAPABILITIES
    # distconform.impl.api imports torch; the report's header needs the profiles before any test
    # runs.
    from distconform.impl.api import KNOWN_CAPABILITIES

    return KNOWN_CAPABILITIES


#: subject -> its case table.
TABLES = {IMPLEMENTATION: CASES_FILE, BACKEND: BACKEND_CASES_FILE}


@functools.cache
def load_profiles() -> tuple[Profile, ...]:
    """The project's profiles: each table's, then its generated extensions."""
    loaded: list[Profile] = []
    for subject, path in TABLES.items():
        known = known_capabilities(subject)
        profiles = parse_profiles(path.read_text(), known_capabilities=known, subject=subject)
        if not any(profile.required for profile in profiles.values()):
            raise ValueError(f"{path} defines no required profile")
        loaded += with_extensions(profiles, known, subject)
    return tuple(loaded)


def read_cases(path: Path = CASES_FILE, subject: str = IMPLEMENTATION) -> dict[str, Case]:
    """A case table file checked like the project's: known capabilities, every row described."""
    return parse_cases(
        path.read_text(),
        known_capabilities=known_capabilities(subject),
        require_description=True,
        subject=subject,
    )


@functools.cache
def load_cases() -> dict[str, Case]:
    """The project's case tables, the implementation's and the backend's, by case id."""
    cases: dict[str, Case] = {}
    for subject, path in TABLES.items():
        table = read_cases(path, subject)
        twice = set(table) & set(cases)
        if twice:
            raise ValueError(f"case ids {sorted(twice)} are in more than one case table")
        cases.update(table)
    return cases


def case(case_id: str) -> Case:
    try:
        return load_cases()[case_id]
    except KeyError:
        raise KeyError(
            f"no case {case_id!r} in {CASES_FILE.name} or {BACKEND_CASES_FILE.name}"
        ) from None


def conformance(case_id: str) -> Callable[[Callable], Callable]:
    """Tie a suite function to a case: its world sizes and its row of the case table.

    Every case also runs under the harness's device audit (``harness/rank/device_audit.py``): a
    tensor the suite creates without a device fails the case on CPU already, since on an
    accelerator run it would sit on the CPU, off the rank's device.
    """
    row = case(case_id)

    def decorate(fn: Callable) -> Callable:
        fn = pytest.mark.world_size(*row.world_sizes)(fn)
        fn = pytest.mark.device_audit(fn)
        return getattr(pytest.mark, CASE_MARKER)(case_id)(fn)

    return decorate


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def grid_id(**params: Any) -> str:
    """``name=value`` tokens joined by ``-``, the form the case table matches."""
    return "-".join(f"{name}={_format(value)}" for name, value in params.items())


def grid(**axes: Sequence[Any]) -> list[Any]:
    """The cartesian product of ``axes`` as ``pytest.param``s with :func:`grid_id` ids.

    Each param carries a dict of its values, so a test takes one ``point`` argument.
    """
    points: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        points = [{**point, name: value} for point in points for value in values]
    return [pytest.param(point, id=grid_id(**point)) for point in points]


def param_tokens(item: pytest.Item) -> tuple[str, tuple[str, ...]]:
    """The item's parameter id without the world size, and its tokens (the ``-``-separated
    parts of that id)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return "", ()
    parts = [p for p in callspec.id.split("-") if not (p.startswith("ws") and p[2:].isdigit())]
    return "-".join(parts), tuple(parts)


def _record_case(item: pytest.Item, row: Case, tokens: Iterable[str]) -> None:
    # User properties travel in every TestReport, across pytest-xdist too (items do not), so
    # the report can place a skipped item in its profile as well as one that ran.
    if any(name == CASE_PROPERTY for name, _ in item.user_properties):
        return  # collection hooks may run twice (e.g. a plugin re-applying the table)
    item.user_properties.append((CASE_PROPERTY, row.case_id))
    item.user_properties.append((CAPABILITIES_PROPERTY, ",".join(row.needed_capabilities(tokens))))
    item.user_properties.append((SUBJECT_PROPERTY, row.subject))


def apply_case_table(
    items: list[pytest.Item],
    *,
    device_type: str,
    launcher: str,
    capabilities_of: Callable[[str], frozenset[str]],
    world_size_of: Callable[[pytest.Item], int | None],
) -> list[pytest.Item]:
    """Add the skips and ``slow`` marks the case table asks for, and the user
    properties the conformance report reads; return the items that do not apply at all (an
    ``only_undeclared`` case's items for declared capabilities), for the caller to deselect.

    ``capabilities_of(subject)`` gives what the implementation or the backend declares; it
    is asked only for subjects whose cases were collected.
    """
    inapplicable = []
    for item in items:
        marker = item.get_closest_marker(CASE_MARKER)
        if marker is None:
            continue
        row = case(marker.args[0])
        param_id, tokens = param_tokens(item)
        capabilities = capabilities_of(row.subject)
        if row.only_undeclared and _probed_capability(tokens) in capabilities:
            inapplicable.append(item)
            continue
        _record_case(item, row, tokens)
        if not row.is_fast(param_id, world_size_of(item)):
            item.add_marker(pytest.mark.slow)
        if device_type == "cpu":
            reason = row.cpu_skip_reason(tokens)
        else:  # the device says what it cannot run (distconform.extension.DeviceType)
            device = registered_device(device_type)
            reason = device.case_skip_reason(row.case_id, tokens) if device else None
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        missing = row.missing_capabilities(tokens, capabilities)
        if missing:
            reason = f"{UNSUPPORTED_PREFIX} needs capability {', '.join(missing)}"
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        if launcher not in row.launchers:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"{LAUNCHER_PREFIX} case {row.case_id} runs on "
                    f"{', '.join(sorted(row.launchers))} ranks only"
                )
            )
    return inapplicable


def _probed_capability(tokens: Iterable[str]) -> str | None:
    for token in tokens:
        name, _, value = token.partition("=")
        if name == "capability":
            return value
    return None
