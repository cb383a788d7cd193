"""dev.py's compat lanes: --lane checked up front, --if-cached naming what it skips, pyproject's floors."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _dev(monkeypatch, tmp_path) -> dict:
    """dev.py's globals with both lanes' venvs under ``tmp_path`` (none built)."""
    monkeypatch.setenv("TORCHSHARD_FLOOR_VENV", str(tmp_path / "floor"))
    monkeypatch.setenv("TORCHSHARD_COMPAT_VENV", str(tmp_path / "newest"))
    return runpy.run_path(str(ROOT / "dev.py"), run_name="dev_check")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--lane", "pinned"], r"unknown lane 'pinned'; the lanes are floor, newest"),
        (["--lane"], r"unknown lane None; the lanes are floor, newest"),
        (["--if-cached", "--lane", "oldest", "-k", "x"], r"unknown lane 'oldest'"),
        (["--lane=Floor"], r"unknown lane 'Floor'"),
    ],
)
def test_an_unknown_lane_is_a_usage_error_before_anything_is_built(monkeypatch, tmp_path, capsys, argv, match):
    dev = _dev(monkeypatch, tmp_path)
    assert dev["main"](["compat", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(r"usage: python3 dev.py compat \[--lane floor\|newest\]", err) and re.search(match, err), err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "lanes", "left"),
    [
        ([], ["floor", "newest"], []),
        (["--lane", "floor", "-k", "x"], ["floor"], ["-k", "x"]),
        (["-x", "--lane", "newest", "--if-cached"], ["newest"], ["-x"]),
        (["--lane=floor", "-q"], ["floor"], ["-q"]),
    ],
)
def test_lanes_and_what_pytest_gets(monkeypatch, tmp_path, argv, lanes, left):
    assert _dev(monkeypatch, tmp_path)["_lane_args"](argv) == (lanes, left)


def test_if_cached_names_each_lane_it_skips(monkeypatch, tmp_path, capsys):
    dev = _dev(monkeypatch, tmp_path)
    assert dev["main"](["compat", "--if-cached"]) == 0
    out = capsys.readouterr().out
    assert out.count("SKIPPED") == 2 and "the floor lane" in out and "the newest lane" in out, out
    assert not any(tmp_path.iterdir())


def _floors() -> list[tuple[str, str]]:
    """Every ``name>=version`` of pyproject's dependencies and extras (one name may be in several)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    every = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [(m[1].lower(), m[2]) for r in every if (m := re.fullmatch(r"([\w.-]+)>=([\d.]+)", r))]


@pytest.mark.parametrize("name", ["torch", "transformers", "jax", "numpy", "optax", "torchax"])
def test_pyprojects_floors_are_the_lowest_versions_a_lane_runs(monkeypatch, tmp_path, name):
    dev = _dev(monkeypatch, tmp_path)
    floor = dict(r.split("==") for r in dev["lane_requirements"]("floor") if "==" in r)
    pinned = dict(r.split("==") for r in dev["_pins"]((name,)))
    lowest = min(Version(floor[name]), Version(pinned[name]))
    assert {Version(f) for n, f in _floors() if n == name} == {lowest}, (name, floor[name], pinned[name])
