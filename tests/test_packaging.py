"""pyproject.toml: `pip install -e .[test]` brings everything the suite imports, each pinned in constraints.txt."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the suite runs: the tests, and the examples, benchmarks and tools (the conformance matrix) they run
FOLDERS = ("tests", "testsupport", "examples", "benchmarks", "tools")
SOURCES = [path for folder in FOLDERS for path in ROOT.glob(f"{folder}/*.py")]


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]).lower()


def _imported() -> set[str]:
    found = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    packages = {
        p.parent.name for folder in ("tests", "examples", "benchmarks") for p in ROOT.glob(f"{folder}/*/__init__.py")
    }
    local = {p.stem for p in SOURCES} | packages | {"torchshard", "tools", "testsupport"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in local}


@pytest.mark.slow
def test_the_test_extra_installs_everything_the_suite_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    providers = importlib.metadata.packages_distributions()
    missing = {m: providers.get(m) for m in _imported() if not {_name(d) for d in providers.get(m, [])} & declared}
    # a module a declared package brings with it (torchax's jax, orbax's tensorstore) counts as declared
    missing = {m: d for m, d in missing.items() if not _required_by(declared, d or [])}
    assert missing == {}, f"imported by the suite but not in dependencies or the test extra: {missing}"


def _required_by(declared: set[str], distributions: list[str]) -> bool:
    wanted = {_name(d) for d in distributions}
    for name in declared:
        requires = importlib.metadata.distribution(name).requires or []
        if wanted & {_name(r) for r in requires if "extra ==" not in r}:
            return True
    return False


def test_every_test_extra_package_is_pinned():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pinned = {_name(line) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert {_name(r) for r in extra} - pinned == set()


def test_the_distribution_is_the_torchshard_package_alone():
    """No start-up hook: nothing but ``torchshard*`` is packaged, and no ``.pth`` or ``setup.py`` ships one."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools) == {"packages", "package-data"}, setuptools
    assert setuptools["packages"] == {"find": {"include": ["torchshard*"]}}
    assert [p.name for p in (*ROOT.glob("*.pth"), ROOT / "setup.py") if p.exists()] == []
