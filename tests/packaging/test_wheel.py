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
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What a verdict needs from the package's data files.
PACKAGE_DATA = (
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

VENDOR_PYPROJECT = """\
[tool.pytest.ini_options]
addopts = ["-x", "-p", "no:cacheprovider"]
testpaths = ["vendor_tests"]
"""
VENDOR_CONFTEST = """\
import pytest


@pytest.fixture(autouse=True)
def vendor_fixture():
    raise RuntimeError("the vendor's autouse fixture ran in distconform's suites")
"""
ACME = """\
from impl.api import load_implementation


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


def test_every_module_comes_from_the_wheel(installed, tmp_path):
    _, python = installed
    done = run(
        [python, "-c", "import harness, impl, suites, conformance; "
         "print(*(m.__file__ for m in (harness, impl, suites, conformance)))"],
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


def test_the_readme_job_runs_from_a_vendor_repository(installed, tmp_path):
    """Its own addopts, an autouse fixture that would fail every test, its own impl/ folder:
    the console script gets the checkout's quick selection and verdict; ``python -m
    harness``, which puts the repository first on sys.path, names the conflict."""
    _, python = installed
    vendor = tmp_path / "vendor"
    (vendor / "impl").mkdir(parents=True)
    (vendor / "impl" / "__init__.py").write_text("VENDOR = True\n")
    (vendor / "pyproject.toml").write_text(VENDOR_PYPROJECT)
    (vendor / "conftest.py").write_text(VENDOR_CONFTEST)
    script = python.parent / "distconform"
    checkout = quick_count([sys.executable, "-m", "harness"], ROOT, tmp_path / "checkout")
    assert quick_count([script], vendor, tmp_path / "count") == checkout

    done = run([script, "conformance", "--impl", "reference", "--quick", "--out", "report"], vendor)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads((vendor / "report" / "conformance.json").read_text())
    assert report["verdict"]["status"] == "CONFORMANT", report["verdict"]
    assert len(report["tests"]) == int(checkout.split("/")[0])
    assert report["summary"]["counts"]["FAIL"] == 0

    shadowed = run([python, "-m", "harness", "conformance", "--impl", "reference"], vendor)
    assert shadowed.returncode == 2
    (line,) = shadowed.stderr.strip().splitlines()
    assert line.startswith(f"distconform: 'impl' resolves to {(vendor / 'impl').resolve()}")


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
