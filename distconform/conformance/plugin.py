"""pytest plugin of conformance runs: the implementation under test, the case table at
collection, expectations, and the report at the end.

Registered through the ``pytest11`` entry point ``distconform-conformance``. ``--impl``
chooses the implementation (the ``impl`` fixture; the value pickles as its spec, see
``distconform.impl.api.Implementation.__reduce__``, and each rank rebuilds it by name, so no
implementation state crosses process boundaries). Every test tied to a case with
``distconform.suites.cases.conformance`` gets the table's skips, ``slow`` marks and user properties.
Expectations are applied whenever a file is named (``--expectations``) or the implementation
has one in ``suites/expectations/<spec>.toml``; an implementation built on another
(``Implementation.built_on``) inherits that one's as well. The report is written and printed with
``--conformance-out DIR`` (or ``--conformance-table`` to only print it). It is built from
pytest's own ``TestReport`` objects, so it covers whatever was collected. Its profiles come
from the ``pytest_distconform_conformance_profiles`` hook, which this plugin answers last
with the case table's profiles.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from distconform import suites
from distconform.conformance import hookspecs
from distconform.conformance import report as conformance_report
from distconform.conformance.cli import PYTEST_INI
from distconform.conformance.expectations import (
    Entry,
    Expectations,
    ExpectationsError,
    combine,
    inherit,
    load,
)
from distconform.conformance.out_lock import OutputLock
from distconform.conformance.progress import RunTracker
from distconform.conformance.recorder import Recorder, profiles_from_hook
from distconform.conformance.renderers import FILE_FORMATS, junit, terminal
from distconform.conformance.renderers.format import write_files
from distconform.conformance.renderers.third_party import ReportFormatError, installed_formats
from distconform.conformance.run_environment import environment_of, writable_directory
from distconform.conformance.tolerance import Tolerance
from distconform.extension import (
    implementations,
    installed_torch_version,
    prints_the_report,
    requested_launcher,
    settings_of,
    world_size_of,
)
from distconform.impl.api import ENV_VAR, Implementation, default_spec, load_implementation
from distconform.suites.backend.declaration import (
    BackendDeclaration,
    DeclarationError,
    load_declaration,
)
from distconform.suites.cases import (
    BACKEND,
    CASE_MARKER,
    Profile,
    apply_case_table,
    load_profiles,
)

PLUGIN_NAME = "distconform-conformance-report"
# The harness plugin as pytest names it: its pytest11 entry point (pyproject.toml) when
# installed, its module when a plain copy of the tree names it with ``-p``.
HARNESS_PLUGIN_NAMES = ("distconform", "distconform.harness.plugin")
_FILE_NAMES = [fmt.file_name for fmt in FILE_FORMATS if fmt.file_name]
TOLERANCE_KEY = pytest.StashKey[Tolerance]()
DECLARATION_KEY = pytest.StashKey[BackendDeclaration]()
SUITES_DIR = Path(suites.__file__).resolve().parent
BACKEND_EXPECTATIONS_DIR = SUITES_DIR / "backend" / "expectations"


class StaleExpectationWarning(pytest.PytestWarning):
    """An expectations entry selects no collected test: it is out of date or misspelt."""


@pytest.hookimpl(tryfirst=True)
def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconform-conformance", "conformance runs (distconform)")
    group.addoption(
        "--impl",
        default=None,
        metavar="SPEC",
        help=f"implementation under test: reference, torch, an installed vendor's registered "
        f"name, or package.module[:factory] (default: ${ENV_VAR} or reference)",
    )
    group.addoption(
        "--conformance-out",
        default=None,
        metavar="DIR",
        help=f"write the conformance report to DIR ({', '.join(_FILE_NAMES)}) and print its table",
    )
    group.addoption(
        "--conformance-table",
        action="store_true",
        default=False,
        help="print the conformance table at the end (implied by --conformance-out)",
    )
    group.addoption(
        "--conformance-progress",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --conformance-out or --conformance-table: every SECONDS, print tests done "
        "of those selected, time elapsed and time left, and write the report so far (marked "
        "unfinished) (default: 30; 0: never)",
    )
    group.addoption(
        "--expectations",
        default=None,
        metavar="FILE",
        help="expected failures and tolerance overrides of the implementation under test "
        "(TOML; default: suites/expectations/<impl>.toml when it exists; the backend "
        "suite adds suites/backend/expectations/<backend>.toml)",
    )
    group.addoption(
        "--backend-declaration",
        default=None,
        metavar="FILE",
        help="what the backend under test supports, for the backend suite (TOML; default: "
        "suites/backend/declarations/<backend>.toml; none: every capability is held)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{CASE_MARKER}(case_id): the suites/cases.toml row this conformance test implements",
    )
    config.addinivalue_line(
        "markers",
        "feature(name): the conformance report's feature for this test "
        "(default: its module name without test_)",
    )
    if config.pluginmanager.has_plugin(PLUGIN_NAME):
        return
    if not any(config.pluginmanager.has_plugin(name) for name in HARNESS_PLUGIN_NAMES):
        # -p no:distconform: the harness that runs the suites' ranks is off, and with it
        # the hooks this plugin implements; plain tests still run.
        return
    try:
        plugin = ConformancePlugin(config)
    except ExpectationsError as exc:
        raise pytest.UsageError(f"distconform: {exc}") from None
    config.pluginmanager.register(plugin, PLUGIN_NAME)


def selected_spec(config: pytest.Config) -> str:
    """The implementation under test: ``--impl``, else ``$DISTCONFORM_IMPL``, else reference."""
    return config.getoption("impl") or default_spec()


def pytest_report_header(config: pytest.Config) -> str:
    return f"distconform implementation: {selected_spec(config)}"


@pytest.hookimpl(trylast=True)
def pytest_distconform_conformance_profiles(config: pytest.Config) -> list[dict[str, Any]]:
    """The case table's profiles, unless another plugin answered first."""
    return [profile.as_hook_dict() for profile in load_profiles()]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # First, so that the slow marks added here are seen by -m's deselection.
    if not any(item.get_closest_marker(CASE_MARKER) for item in items):
        return
    inapplicable = apply_case_table(
        items,
        device_type=config.getoption("device") or "cpu",
        launcher=requested_launcher(config),
        capabilities_of=lambda subject: declared_capabilities(config, subject),
        world_size_of=world_size_of,
    )
    if inapplicable:
        left_out = {id(item) for item in inapplicable}
        items[:] = [item for item in items if id(item) not in left_out]
        config.hook.pytest_deselected(items=inapplicable)


def declared_capabilities(config: pytest.Config, subject: str) -> frozenset[str]:
    """What the implementation (``--impl``) or the backend (``--backend``) declares."""
    if subject == BACKEND:
        return backend_declaration(config).capabilities
    return implementation_under_test(config).capabilities


def implementation_under_test(config: pytest.Config) -> Implementation:
    """The run's implementation, loaded once; a spec that does not load is a usage error."""
    spec = selected_spec(config)
    try:
        return load_implementation(spec)
    except (ImportError, ValueError, TypeError) as error:
        raise pytest.UsageError(f"--impl {spec}: {error}") from None


def backend_declaration(config: pytest.Config) -> BackendDeclaration:
    """The run's backend's declaration, read once per session."""
    declaration = config.stash.get(DECLARATION_KEY, None)
    if declaration is None:
        try:
            declaration = load_declaration(
                settings_of(config).backend, config.getoption("backend_declaration")
            )
        except DeclarationError as exc:
            raise pytest.UsageError(f"distconform: {exc}") from None
        config.stash[DECLARATION_KEY] = declaration
    return declaration


def default_backend_expectations(backend: str) -> Expectations:
    """A bundled backend's expectations: ``suites/backend/expectations/<backend>.toml``, and
    ``<backend>-<major>.<minor>.toml`` for what only the installed torch release adds (gloo
    lacks a list all-to-all in torch 2.11), each if it exists."""
    if not backend.isidentifier():
        return Expectations()
    major, minor = installed_torch_version()
    found = [
        load(path)
        for path in (
            BACKEND_EXPECTATIONS_DIR / f"{backend}.toml",
            BACKEND_EXPECTATIONS_DIR / f"{backend}-{major}.{minor}.toml",
        )
        if path.is_file()
    ]
    return combine(*found) if found else Expectations()


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest) -> Implementation:
    """The implementation under test, chosen by ``--impl`` or ``$DISTCONFORM_IMPL``."""
    return implementation_under_test(request.config)


@pytest.fixture
def conformance_tolerance(request: pytest.FixtureRequest) -> Tolerance:
    """This test's tolerance override from the expectations file (empty when none)."""
    return request.node.stash.get(TOLERANCE_KEY, Tolerance())


def release_expectations() -> Expectations:
    """``suites/expectations/release-<major>.<minor>.toml``: differences of the installed torch
    release's own components that every implementation meets (its pipelining engine), if any."""
    major, minor = installed_torch_version()
    path = Path(suites.__file__).parent / "expectations" / f"release-{major}.{minor}.toml"
    return load(path) if path.is_file() else Expectations()


def default_expectations_path(spec: str) -> Path | None:
    """The expectations of a built-in implementation on the installed torch, if any:
    ``suites/expectations/<spec>-<major>.<minor>.toml`` (torch's FSDP2 differs between
    releases), else ``suites/expectations/<spec>.toml``."""
    if not spec.isidentifier():
        return None
    folder = Path(suites.__file__).parent / "expectations"
    major, minor = installed_torch_version()
    for path in (folder / f"{spec}-{major}.{minor}.toml", folder / f"{spec}.toml"):
        if path.is_file():
            return path
    return None


def bundled_expectations(spec: str) -> Expectations:
    """What ``--impl spec`` expects without ``--expectations``: its bundled file on the
    installed torch (:func:`default_expectations_path`), then the release's."""
    path = default_expectations_path(spec)
    own = load(path) if path is not None else Expectations()
    return combine(own, release_expectations())


def check_named_implementation(config: pytest.Config) -> Implementation | None:
    """Load an implementation the run names (``--impl``, ``$DISTCONFORM_IMPL``) before any
    test starts, so a misspelt spec is one error line, not an empty report; None when the
    run names none."""
    if config.getoption("impl") or os.environ.get(ENV_VAR):
        return implementation_under_test(config)
    return None


def base_implementation(implementation: Implementation | None) -> str | None:
    """The registered implementation ``implementation`` is built on, checked; None when it
    declares none (or the run names no implementation: the default, the reference, is
    built on nothing, and loading it to ask would import torch into every session)."""
    if implementation is None or implementation.built_on is None:
        return None
    base = implementation.built_on
    registered = implementations()
    if not isinstance(base, str) or base not in registered:
        raise pytest.UsageError(
            f"--impl {implementation.spec}: {implementation.name} is built on {base!r}, which "
            f"is not a registered implementation ({', '.join(sorted(registered))})"
        )
    if base == implementation.spec:
        raise pytest.UsageError(f"--impl {implementation.spec}: built on itself")
    return base


class ConformancePlugin:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.spec = selected_spec(config)
        base = base_implementation(check_named_implementation(config))
        named = config.getoption("expectations")
        if named:  # a vendor's own file stands alone: the bundled ones do not apply
            loaded = load(Path(named))
        elif base is None:
            loaded = bundled_expectations(self.spec)
        else:  # the base's bundled set below brings the release's
            path = default_expectations_path(self.spec)
            loaded = load(path) if path is not None else Expectations()
        if base is not None:
            loaded = inherit(loaded, bundled_expectations(base), base)
        self.expectations = loaded.on_device(config.getoption("device") or "cpu")
        # A pytest-xdist worker: the controller sees every report, tracks and writes.
        self.is_worker = hasattr(config, "workerinput")
        # Under torchrun or srun every rank runs the session; rank 0 writes the report.
        rank_0 = prints_the_report(config)
        out = config.getoption("conformance_out") if rank_0 else None
        self.out_dir = writable_directory(Path(out), "--conformance-out") if out else None
        try:  # before any test: a broken installed format must not cost a whole run
            self.formats = FILE_FORMATS + installed_formats(FILE_FORMATS)
        except ReportFormatError as exc:
            raise pytest.UsageError(str(exc)) from None
        junit = getattr(config.option, "xmlpath", None)
        if junit:
            writable_directory(Path(junit).parent, "--junitxml")
        self.reporting = self.out_dir is not None or (
            rank_0 and config.getoption("conformance_table")
        )
        self.recorder = Recorder(
            lambda nodeid: self.expectations.xfail_for(case_id(nodeid, config.rootpath))
        )
        self.stale: list[Entry] = []
        self.profiles: list[Profile] = []
        self.report: conformance_report.ConformanceReport | None = None
        self.tracker = RunTracker(config.getoption("conformance_progress"))
        # Last: a run refused by anything above never creates or locks the directory.
        self.out_lock: OutputLock | None = None
        self.discard_report = False
        if self.out_dir is not None and not self.is_worker:
            self.out_lock = OutputLock(self.out_dir, "--conformance-out")
            self.out_lock.acquire()

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        return None if self.out_lock is None else self.out_lock.note

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.out_lock is not None:
            self.out_lock.release(discard=self.discard_report)

    def pytest_configure(self, config: pytest.Config) -> None:
        if self.reporting:
            # Asked now, not at the end, so that a malformed answer is a usage error.
            raw = config.hook.pytest_distconform_conformance_profiles(config=config)
            try:
                self.profiles = profiles_from_hook(raw)
            except ValueError as exc:
                raise pytest.UsageError(f"distconform: {exc}") from None

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Add the bundled expectations of the run's backend (the backend suite's known
        differences), unless a file was named: a named file replaces every default; then
        write a report marked unfinished.

        At session start, not at collection: a pytest-xdist controller collects nothing but
        reports the expectations applied, and the harness has resolved the backend by now.
        A named declaration file is read here too, so that a bad one stops the run before
        any test.
        """
        try:
            backend = settings_of(self.config).backend
        except pytest.UsageError:
            backend = None  # the harness plugin is disabled: no backend, no backend suite
        if backend is not None and self.config.getoption("backend_declaration"):
            backend_declaration(self.config)
        if backend is not None and not self.config.getoption("expectations"):
            try:
                backend_expectations = default_backend_expectations(backend)
                self.expectations = combine(
                    self.expectations,
                    backend_expectations.on_device(self.config.getoption("device") or "cpu"),
                )
            except ExpectationsError as exc:
                raise pytest.UsageError(f"distconform: {exc}") from None
        if self.out_dir is not None and not self.is_worker:
            # Replaces a previous run's report at once: a run that is killed never leaves
            # an earlier, finished-looking one in its place.
            self._write(self._build(self.tracker.running_state(0)))

    def pytest_distconform_reproducer_command(self, config: pytest.Config) -> list[str] | None:
        # A run of the bundled suites through ``distconform conformance`` has test ids
        # relative to the package: that command takes them back from any directory.
        if config.inipath is not None and config.inipath.resolve() == PYTEST_INI:
            return ["-m", "distconform", "conformance"]
        return None

    def pytest_distconform_reproducer_args(self, config: pytest.Config) -> list[str]:
        args: list[str] = []
        spec = config.getoption("impl")
        if spec:
            args += ["--impl", spec]
        for module in config.getoption("backend_plugin"):
            args += ["--backend-plugin", module]
        if config.getoption("backend_declaration"):
            args += ["--backend-declaration", config.getoption("backend_declaration")]
        if config.getoption("expectations"):
            args += ["--expectations", config.getoption("expectations")]
        return args

    # --- collection ----------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        # Before any deselection: staleness is judged against everything collected.
        ids = {item.nodeid: case_id(item.nodeid, config.rootpath) for item in items}
        collected_files = {nodeid.split("::", 1)[0] for nodeid in ids.values()}

        used: set[int] = set()
        for item in items:
            self.recorder.describe_item(item)
            entry = self.expectations.xfail_for(ids[item.nodeid])
            if entry is not None:
                used.add(id(entry))
                item.add_marker(pytest.mark.xfail(reason=entry.xfail_reason(), strict=False))
                self.recorder.expect(item.nodeid, entry)
            tolerance = self.expectations.tolerance_for(ids[item.nodeid])
            if tolerance is not None:
                used.add(id(tolerance))
                item.stash[TOLERANCE_KEY] = Tolerance(
                    tolerance.rtol, tolerance.atol, tolerance.reason, str(tolerance.source)
                )
        for entry in self.expectations.entries:
            # An inherited entry that the implementation's own entry overrides still selects
            # a test: overridden, not stale.
            overridden = entry.inherited_from is not None and any(
                entry.matches(test_id) for test_id in ids.values()
            )
            if (
                id(entry) not in used
                and not overridden
                and _could_have_matched(entry, collected_files, config)
            ):
                self.stale.append(entry)
                warnings.warn_explicit(
                    StaleExpectationWarning(
                        f"{entry.describe()} selects no collected test (stale or misspelt); "
                        f"reason was: {entry.reason}"
                    ),
                    StaleExpectationWarning,
                    filename=str(entry.source),
                    lineno=entry.line,
                )
        return (yield)

    # --- results -------------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.config.pluginmanager.has_plugin("dsession"):
            self.tracker.tests_selected(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        # A pytest-xdist controller collects nothing itself: every worker collects it all.
        self.tracker.tests_selected(len(ids))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.recorder.add_collect_skip(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorder.add(report)
        if report.when != "teardown" or self.is_worker or not self.reporting:
            return
        self.tracker.test_finished()
        if self.tracker.due():
            self._show_progress()
            if self.out_dir is not None:
                # So a run that is killed still leaves its results, marked unfinished.
                self._write(self._build(self.tracker.running_state(self._cut_short())))

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo) -> None:
        self.tracker.interrupted = f"interrupted ({excinfo.typename})"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.reporting or self.is_worker:
            return
        run = self.tracker.final_state(session, exitstatus, self._cut_short())
        self.report = self._build(run)
        if self.out_dir is not None:
            self._write(self.report)
        if exitstatus == pytest.ExitCode.USAGE_ERROR and not self.report.tests:
            self.report = None  # the usage error is the message; an empty table is noise
            self.discard_report = True  # and a refused run leaves no report behind

    def _cut_short(self) -> int:
        return len(self.recorder.in_progress)

    def _build(self, run: conformance_report.RunState) -> conformance_report.ConformanceReport:
        # From the reports, not the items: a pytest-xdist controller collects none.
        backend_cases = any(r.subject == BACKEND for r in self.recorder.results.values())
        declaration = backend_declaration(self.config).describe() if backend_cases else None
        environment = environment_of(self.config, self.spec, self.expectations, declaration)
        if self.out_dir is not None:
            environment["junit_xml"] = str(self.out_dir / junit.FORMAT.file_name)
        return self.recorder.build(environment, self.stale, self.profiles, run)

    def _write(self, report: conformance_report.ConformanceReport) -> None:
        assert self.out_dir is not None
        write_files(report, self.out_dir, self.formats)

    def _show_progress(self) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(self.tracker.progress_line())

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.report is None:
            return
        terminalreporter.write_sep("=", "conformance")
        for line in terminal.FORMAT.render(self.report).splitlines():
            terminalreporter.write_line(line)
        if self.out_dir is not None:
            terminalreporter.write_line(
                f"report written to {self.out_dir} (open {self.out_dir / 'conformance.html'})"
            )


def case_id(nodeid: str, rootpath: Path) -> str:
    """The id an expectations file names a test by: a bundled suite's file relative to the
    folder that holds ``suites/`` (``suites/test_x.py::test_y[ws2]``), whatever the session's
    root (the checkout's own runs say ``distconform/suites/...``); any other test's node id."""
    file_part, separator, rest = nodeid.partition("::")
    path = (rootpath / file_part).resolve()
    if path.is_relative_to(SUITES_DIR):
        file_part = path.relative_to(SUITES_DIR.parent).as_posix()
    return file_part + separator + rest


def _could_have_matched(entry: Entry, collected_files: set[str], config: pytest.Config) -> bool:
    """Whether an unused entry is worth a warning in this run.

    Running a subset of the suites must not flag entries for files that were simply not
    collected; an entry whose file was collected, or names no file at all, is stale. A file
    is looked for where the entry's expectations file means it: under the session's root,
    or, for a bundled file (``suites/expectations``, ``suites/backend/expectations``, loaded
    by default into sessions in the user's own directories too), in this project.
    """
    file_part = entry.file_part
    if any(ch in file_part for ch in "*?["):
        return True
    if file_part in collected_files:
        return True
    bundled = Path(entry.source).resolve().is_relative_to(SUITES_DIR)
    root = SUITES_DIR.parent if bundled else config.rootpath
    return not (root / file_part).exists()
