"""The project's CI and packaging files do what the README says they do."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
RUNTIME_PACKAGES = ("distconform",)
# Runtime dependencies that no module imports by name, and why they are still needed.
NEEDED_UNIMPORTED = {
    "numpy": "torch warns 'Failed to initialize NumPy' at import without it, in every rank",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def _imported_modules(packages: tuple[str, ...]) -> set[str]:
    found = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
    return found


def test_ci_runs_the_project_script():
    workflow = (WORKFLOWS / "ci.yml").read_text()
    assert re.search(r"^\s*run: bash \.ci/run\s*$", workflow, re.MULTILINE), workflow
    script = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -n 2 --dist loadfile\n" in script and "ruff check ." in script
    # The README's test command is the one CI runs.
    assert "python -m pytest -n 2 --dist loadfile\n" in (ROOT / "README.md").read_text()


def test_the_gpu_job_fails_when_its_gpus_are_not_visible():
    workflow = (WORKFLOWS / "gpu.yml").read_text()
    check = workflow.index("torch.cuda.device_count()")
    tests = workflow.index("python -m pytest --device cuda")
    assert check < tests, "the device check must run before the tests"
    assert "sys.exit(" in workflow[check:tests] and "REQUIRED_GPUS" in workflow
    assert "python3.11 -m venv" in workflow  # a known Python, not whatever the runner has


def test_every_install_path_is_constrained_and_the_tools_are_pinned():
    pins = {
        _requirement_name(line): line
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert pins.keys() >= {"torch", "pytest", "ruff"}
    assert all("==" in line for line in pins.values()), pins
    texts = {path.name: path.read_text() for path in WORKFLOWS.glob("*.yml")}
    texts |= {"tox.ini": (ROOT / "tox.ini").read_text(), ".ci/run": (ROOT / ".ci/run").read_text()}
    for name, text in texts.items():
        for line in text.splitlines():
            if "pip install" in line and not line.rstrip().endswith("--upgrade pip"):
                constrained = "constraints.txt" in line or "-c {toxinidir}/{env:TORCH_PINS}" in line
                assert constrained, (name, line)
    assert "deps = ruff" in texts["tox.ini"]  # lint env: pinned through the constraints


def test_each_torch_of_the_version_matrix_is_pinned_with_the_same_tools():
    def pins_of(path: Path) -> dict[str, str]:
        return {
            _requirement_name(line): line.strip()
            for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }

    default = pins_of(ROOT / "constraints.txt")
    tox = (ROOT / "tox.ini").read_text()
    window = _pyproject()["project"]["dependencies"]
    assert "torch>=2.11,<2.16" in window
    for minor in (11, 12, 14, 15):
        path = ROOT / "constraints" / f"torch-2.{minor}.txt"
        pins = pins_of(path)
        assert pins["torch"].startswith(f"torch==2.{minor}."), pins
        assert {k: v for k, v in pins.items() if k != "torch"} == {
            k: v for k, v in default.items() if k != "torch"
        }, f"{path.name} pins other tools than constraints.txt"
        assert f"torch2{minor}: TORCH_PINS = constraints/torch-2.{minor}.txt" in tox
    assert "torch213: TORCH_PINS = constraints.txt" in tox


def test_each_runtime_dependency_is_used_and_test_tools_stay_in_the_test_extra():
    project = _pyproject()["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    imported = _imported_modules(RUNTIME_PACKAGES)
    unused = {name for name in runtime if name not in imported} - NEEDED_UNIMPORTED.keys()
    assert not unused, f"runtime dependencies nothing in {RUNTIME_PACKAGES} imports: {unused}"
    test_only = {_requirement_name(r) for r in project["optional-dependencies"]["test"]}
    assert "psutil" in test_only and "psutil" not in runtime
    assert "psutil" not in imported


def test_the_tox_main_env_is_the_readme_main_job():
    readme = (ROOT / "README.md").read_text()
    main_job = re.search(r"&& (python -m distconform conformance [^\n`]*)", readme).group(1)
    tox = (ROOT / "tox.ini").read_text()
    section = tox.split("[testenv:main]", 1)[1].split("\n[", 1)[0]
    assert f"commands = {main_job.strip()} {{posargs}}" in section, section
