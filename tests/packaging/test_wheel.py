"""distconform as a vendor installs it: the wheel, in a fresh virtual environment, run from
a vendor repository with its own pytest configuration.

The environment gets the wheel alone (``pip --python ENV install --no-deps``); torch, pytest
and the other dependencies come from this interpreter's site-packages through a ``.pth``
file, which adds the directory without running the ``.pth`` files in it (this checkout's
editable install among them), so every distconform module comes from the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What a verdict needs from the package's data files.
PACKAGE_DATA = tuple(
    f"distconform/{name}"
    for name in (
        "conformance/conformance.schema.json",
        "conformance/pytest.ini",
        "suites/cases.toml",
        "suites/coverage/fsdp.toml",
        "suites/coverage/state_dict.toml",
        "suites/coverage/tensor_parallel.toml",
        "suites/coverage/pipelining.toml",
        "suites/expectations/torch-2.13.toml",
        "suites/backend/cases.toml",
        "suites/backend/api_coverage.toml",
        "suites/backend/declarations/gloo.toml",
        "suites/backend/expectations/gloo.toml",
        "harness/devices/fakeaccel/fakeaccel.cpp",
        "harness/devices/fakeaccel/stream_checker.cpp",
        "harness/devices/fakeaccel/stream_checker.h",
    )
)
#: The generic names a vendor's repository may well use for packages of its own.
VENDOR_PACKAGES = ("harness", "impl", "suites", "conformance")

VENDOR_PYPROJECT = """\
[tool.pytest.ini_options]
addopts = ["-x", "-p", "no:cacheprovider"]
testpaths = ["vendor_tests"]
"""
VENDOR_CONFTEST = """\
import pytest


@pytest.fixture(autouse=True)
def vendor_fixture(request):
    if not request.node.nodeid.startswith("vendor_tests/"):
        raise RuntimeError("the vendor's autouse fixture ran in distconform's suites")
"""
ACME = """\
from distconform.impl.api import load_implementation


def implementation():
    impl = load_implementation("reference")
    impl.name = "acme"
    return impl
"""


def run(command: list, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the environment's python) with only the wheel installed in it."""
    work = tmp_path_factory.mktemp("wheel")
    built = run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(work / "dist"), str(ROOT)],
        ROOT,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("distconform-*.whl")
    venv = work / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], work)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    work).stdout.strip())  # fmt: skip
    (site / "distconform-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = run(
        # --ignore-installed: an installed distconform seen through the .pth (tox installs one)
        # would otherwise count as the wheel's and leave this environment without it.
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--ignore-installed", str(wheel)],
        work,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    return wheel, python


def test_the_wheel_carries_the_package_data_and_no_tests(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in PACKAGE_DATA if name not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    assert not any(name.startswith("tests/") for name in names)


def test_the_wheel_claims_one_top_level_name(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"distconform"}
    top_level = [name for name in names if name.endswith(".dist-info/top_level.txt")]
    for name in top_level:
        assert zipfile.ZipFile(wheel).read(name).decode().split() == ["distconform"]


def test_every_module_comes_from_the_wheel(installed, tmp_path):
    _, python = installed
    done = run(
        [python, "-c", "import distconform.harness, distconform.impl, distconform.suites, "
         "distconform.conformance as c; import distconform as d; "
         "print(d.__file__, *(m.__file__ for m in (d.harness, d.impl, d.suites, c)))"],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert all("site-packages" in path for path in done.stdout.split()), done.stdout


def quick_count(command: list, cwd: Path, out: Path, **env: str) -> str:
    done = run([*command, "conformance", "--impl", "reference", "--quick", "--out", str(out),
                "--co", "-q"], cwd, **env)  # fmt: skip
    match = re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", done.stdout)
    assert match, done.stdout[-2000:] + done.stderr[-2000:]
    return match.group(0)


def vendor_repository(root: Path) -> Path:
    """A repository with packages named like distconform's folders, tests of its own that
    import them, its own addopts, and an autouse fixture that would fail any other test."""
    for name in VENDOR_PACKAGES:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"OWNER = 'vendor:{name}'\n")
    (root / "vendor_tests").mkdir()
    (root / "vendor_tests" / "test_own.py").write_text(
        "import importlib\n\nimport pytest\n\n\n"
        f"@pytest.mark.parametrize('name', {list(VENDOR_PACKAGES)!r})\n"
        "def test_our_package(name):\n"
        "    assert importlib.import_module(name).OWNER == f'vendor:{name}'\n"
    )
    (root / "pyproject.toml").write_text(VENDOR_PYPROJECT)
    (root / "conftest.py").write_text(VENDOR_CONFTEST)
    return root


def test_a_vendor_repository_with_packages_of_our_folder_names(installed, tmp_path):
    """Its own ``impl``, ``harness``, ``suites`` and ``conformance``: its tests pass with
    distconform installed (plugins loaded), and distconform's command collects the
    checkout's quick selection from inside it. (A run from inside it, to a verdict: the
    reproduce test below; ``python -m distconform`` is the script: test_console_script.)"""
    _, python = installed
    vendor = vendor_repository(tmp_path / "vendor")
    own = run([python, "-m", "pytest", "-q"], vendor)
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-2000:]
    assert f"{len(VENDOR_PACKAGES)} passed" in own.stdout

    script = python.parent / "distconform"
    checkout = quick_count([sys.executable, "-m", "distconform"], ROOT, tmp_path / "checkout")
    assert quick_count([script], vendor, tmp_path / "count") == checkout


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_a_vendor_implementation_from_its_own_repository(installed, tmp_path):
    _, python = installed
    vendor = tmp_path / "acme_repo"
    (vendor / "acme").mkdir(parents=True)
    (vendor / "acme" / "__init__.py").write_text(textwrap.dedent(ACME))
    (vendor / "pyproject.toml").write_text(VENDOR_PYPROJECT)
    done = run(
        [python.parent / "distconform", "conformance", "--impl", "acme:implementation",
         "--quick", "--out", "report", "-k", "test_training_parity"],
        vendor,
        PYTHONPATH=str(vendor),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((vendor / "report" / "conformance.json").read_text())
    assert report["environment"]["implementation"]["name"] == "acme"
    assert report["summary"]["counts"]["PASS"] >= 1
    assert report["summary"]["counts"]["FAIL"] == 0


BROKEN_ACME = """\
from distconform.impl.api import load_implementation


def implementation():
    impl = load_implementation("reference")
    impl.name = "acme"
    sharded = impl.fully_shard

    def fully_shard(module, **options):
        if options.get("reshard_after_forward") == 2:
            raise RuntimeError("acme cannot reshard to a group of 2")
        return sharded(module, **options)

    impl.fully_shard = fully_shard
    return impl
"""


def test_the_reproduce_command_of_an_installed_run_works_where_the_run_started(installed, tmp_path):
    """A vendor's implementation fails one case; the command the failure report prints is
    run as printed, from the vendor's repository, and reruns that case alone."""
    _, python = installed
    vendor = vendor_repository(tmp_path / "vendor")
    (vendor / "acme").mkdir()
    (vendor / "acme" / "__init__.py").write_text(BROKEN_ACME)
    bin_dir = str(python.parent)
    env = {"PYTHONPATH": str(vendor), "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    selection = "test_reshard_after_forward_schedule"
    done = run(
        ["distconform", "conformance", "--impl", "acme:implementation", "--quick",
         "--out", "report", "-k", selection],
        vendor,
        **env,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    commands = re.findall(r"reproduce with:\n  (.+)", output)
    assert commands, output[-3000:]
    command = commands[0]
    words = shlex.split(command)
    assert words[1:4] == ["-m", "distconform", "conformance"], command
    assert "--impl acme:implementation" in command, command
    failed = re.findall(r"^FAILED (\S+)", done.stdout, re.M)
    # pytest's summary names the file from the current directory; the id is the same
    assert any(line.endswith("/" + words[4]) for line in failed), (failed, command)

    again = subprocess.run(
        command + " --out again -q", shell=True, cwd=vendor, env={**os.environ, **env},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rerun = again.stdout + again.stderr
    assert again.returncode == 1, rerun[-3000:]
    assert "acme cannot reshard to a group of 2" in rerun, rerun[-3000:]
    report = json.loads((vendor / "again" / "conformance.json").read_text())
    assert [test["nodeid"] for test in report["tests"]] == [words[4]]
    # The first run, from inside a repository with packages of our folders' names, reached
    # a verdict: its report names the failing case.
    first = json.loads((vendor / "report" / "conformance.json").read_text())
    assert first["summary"]["counts"]["FAIL"] >= 1
    assert words[4] in [test["nodeid"] for test in first["tests"]]
