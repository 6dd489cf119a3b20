"""The documentation: a short README whose newcomer content is also the site's home page, a site
that builds without warnings and is organised as tutorial, how-to guides, reference,
explanation and results, dated measurements only in the results, an option reference generated
from the options' definitions, an API reference generated from the public modules' docstrings,
and measurement tables rendered from the benchmarks' JSON files."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distconform.conformance import options_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
#: The README is for a newcomer; depth goes to docs/.
README_MAX_LINES = 250
#: The top of the site's nav, in order: the four kinds of documentation, then the results.
NAV_SECTIONS = ("Home", "Tutorial", "How-to guides", "Reference", "Explanation", "Results")
#: A date as the measurements write it (2026-11-28). Outside docs/results/ no page may hold
#: one, not even in a file name: a guide links to the results page instead of quoting the run.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
#: The public modules whose docstrings the API reference pages render.
API_PAGES = {"distconform.api": "reference/api", "distconform.extension": "reference/extension"}


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _tables():
    """benchmarks/tables.py, a script beside the benchmarks it imports."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def _nav() -> list:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs (the test extra)")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]


def _nav_files(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [path for item in entry for path in _nav_files(item)]
    return [path for value in entry.values() for path in _nav_files(value)]


def _public_names(module: str) -> list[str]:
    """The names a lazy public module exports, less those that are modules of their own,
    read from its source (``__all__`` and ``_HOMES``) without importing it."""
    source = ROOT.joinpath(*module.split(".")).with_suffix(".py").read_text()
    exported: list[str] = []
    modules: set[str] = set()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
            continue
        if node.targets[0].id == "__all__":
            exported = ast.literal_eval(node.value)
        elif node.targets[0].id == "_HOMES" and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(value, ast.BinOp):  # MODULE_PREFIX + "...": a module
                    modules.add(key.value)
    assert exported, f"{module} has no __all__"
    return [name for name in exported if name not in modules]


# --- the README and the home page ---------------------------------------------------------


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; keep it at most {README_MAX_LINES} and move depth to docs/"
    )


def test_the_home_page_carries_the_readmes_commands_and_first_test():
    """The site is read without the README: every command and code block of the README (the
    set-up, the first test, the vendor commands) is on the home page too, word for word."""
    home = (DOCS / "index.md").read_text()
    blocks = _fenced_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4, "the README lost its set-up commands or its first test"
    missing = [block for block in blocks if block not in home]
    assert not missing, "README code blocks not on docs/index.md:\n" + "\n---\n".join(missing)


def test_the_readmes_links_lead_into_the_site():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/") for t in local), "the README links to no page of the site"
    broken = [t for t in local if not (ROOT / t).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


# --- the site's organisation ---------------------------------------------------------------


def test_the_nav_has_the_four_kinds_of_page_and_the_results():
    nav = _nav()
    titles = [next(iter(entry)) for entry in nav]
    assert tuple(titles) == NAV_SECTIONS, titles
    for entry in nav[1:]:
        ((title, pages),) = entry.items()
        assert isinstance(pages, list) and pages, f"nav section {title!r} has no pages"
    results = _nav_files(nav[-1])
    assert all(path.startswith("results/") for path in results), results
    elsewhere = [path for entry in nav[:-1] for path in _nav_files(entry)]
    assert not [path for path in elsewhere if path.startswith("results/")], elsewhere


def test_every_page_is_in_the_nav():
    listed = set(_nav_files(_nav()))
    pages = {page.relative_to(DOCS).as_posix() for page in _pages()}
    assert pages == listed, (
        f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; "
        f"nav entries with no page: {sorted(listed - pages)}"
    )


def test_dated_measurements_live_only_in_the_results():
    """Guides, reference and explanations say how things work; a measurement, and so its date,
    belongs to a page under docs/results/ (the README is held to the same rule)."""
    dated = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in [*_pages(), ROOT / "README.md"]
        if RESULTS not in page.parents
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if DATE.search(line)
    ]
    assert not dated, "dated lines outside docs/results/:\n" + "\n".join(dated)


def test_rendered_tables_are_results_pages():
    tables = _tables()
    assert all(page.startswith("docs/results/") for page in tables.PAGES), tables.PAGES
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in [*_pages(), ROOT / "README.md"]
        if tables._TABLE.search(path.read_text())
    }
    assert marked <= set(tables.PAGES), (
        f"pages with rendered tables that benchmarks/tables.py does not render: "
        f"{sorted(marked - set(tables.PAGES))}"
    )


# --- generated pages -----------------------------------------------------------------------


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11),
    reason="docs/options.md is generated on Python 3.11, whose argparse help it holds",
)
def test_the_option_reference_is_generated_from_the_definitions():
    assert options_reference.main(["--check"]) == 0, (
        "docs/options.md is out of date: run python -m distconform.conformance.options_reference"
    )


def test_the_measurement_tables_are_rendered_from_the_benchmark_json():
    assert _tables().main(["--check"]) == 0, (
        "a table in docs/ differs from its JSON file: run python benchmarks/tables.py"
    )


def test_a_hand_edited_table_is_found():
    tables = _tables()
    page = (RESULTS / "benchmarks.md").read_text()
    marked = re.search(r"<!-- table: \S+harness_overhead\.json -->\n\n\| variant", page)
    assert marked is not None, "docs/results/benchmarks.md lost its harness_overhead table marker"
    edited = re.sub(
        r"(\| distconform warm pool \(--launcher process\) \| 301 \| )[\d.]+", r"\g<1>0.1", page
    )
    assert edited != page
    assert tables.render_page(edited) == page


# --- the built site --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is in the test extra")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_site_builds_with_warnings_as_errors(site):
    assert (site / "options" / "index.html").exists()
    assert (site / "index.html").exists()


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_the_api_reference_renders_every_public_name(site, module):
    html = (site / API_PAGES[module] / "index.html").read_text()
    missing = [name for name in _public_names(module) if f'id="{module}.{name}"' not in html]
    assert not missing, f"{API_PAGES[module]} does not render {missing} of {module}"
    # docs/_hooks/sphinx_roles.py turns the docstrings' Sphinx roles into plain code spans.
    raw_roles = re.findall(r":(?:func|class|meth|mod|data|attr):<code>[^<]*", html)
    assert not raw_roles, f"{API_PAGES[module]} shows Sphinx roles as text: {raw_roles[:5]}"
    if module == "distconform.api":
        assert 'id="distconform.api.run_on_ranks"' in html
