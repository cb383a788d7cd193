"""dev.py: its compat lanes (--lane checked up front, --if-cached naming what it skips, pyproject's floors) and the
pinned Python it finds, or says how to get."""

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


def _fake_python(tmp_path: Path, name: str, version: str) -> str:
    """An executable that answers ``-c ...`` as a Python ``version`` would (dev.py asks only for the version)."""
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return str(exe)


def _no_python_but(monkeypatch, tmp_path, dev: dict, running: str) -> None:
    """No python3.12 on PATH, no pyenv, no uv Pythons; dev.py itself runs as ``running``."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHSHARD_PYTHON", raising=False)
    monkeypatch.setattr(dev["sys"], "executable", _fake_python(tmp_path, "python3", running))
    monkeypatch.setattr(dev["Path"], "home", lambda: tmp_path / "home")


def test_the_pinned_python_is_found_where_torchshard_python_points(monkeypatch, tmp_path):
    dev = _dev(monkeypatch, tmp_path)
    _no_python_but(monkeypatch, tmp_path, dev, running="3.11")
    monkeypatch.setenv("TORCHSHARD_PYTHON", good := _fake_python(tmp_path, "mine", "3.12"))
    assert dev["_interpreter"]("3.12")[0] == good


def test_uvs_pythons_are_found(monkeypatch, tmp_path):
    dev = _dev(monkeypatch, tmp_path)
    _no_python_but(monkeypatch, tmp_path, dev, running="3.11")
    uv = tmp_path / "home" / ".local" / "share" / "uv" / "python" / "cpython-3.12.9-linux-x86_64-gnu" / "bin"
    uv.mkdir(parents=True)
    found = _fake_python(uv, "python3", "3.12")
    assert dev["_interpreter"]("3.12")[0] == found


@pytest.mark.parametrize(
    ("chosen", "match"),
    [
        (None, r"dev.py: found no Python 3.12"),
        ("3.11", r"dev.py: \$TORCHSHARD_PYTHON \(.*wrong\) is not Python 3.12"),
        ("3.13", r"dev.py: \$TORCHSHARD_PYTHON \(.*wrong\) is not Python 3.12"),
    ],
)
def test_without_a_python_312_dev_py_says_how_to_get_one(monkeypatch, tmp_path, chosen, match):
    dev = _dev(monkeypatch, tmp_path)
    _no_python_but(monkeypatch, tmp_path, dev, running="3.11")
    if chosen:
        monkeypatch.setenv("TORCHSHARD_PYTHON", _fake_python(tmp_path, "wrong", chosen))
    with pytest.raises(SystemExit) as stop:
        dev["_interpreter"]("3.12")
    message = str(stop.value.code)
    assert re.search(match, message), message
    for way in ("pyenv install 3.12", "uv python install 3.12", "apt install python3.12", "TORCHSHARD_PYTHON"):
        assert way in message, (way, message)


def test_a_venv_of_another_python_is_rebuilt_before_anything_is_installed(monkeypatch, tmp_path, capsys):
    dev = _dev(monkeypatch, tmp_path)
    old = tmp_path / ".venv"
    old.mkdir()
    (old / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.11.7\n")
    (old / ".torchshard-installed").write_text(dev["_fingerprint"]())  # even one stamped as up to date
    live = dev["ensure_venv"].__globals__  # runpy hands back a copy of dev.py's globals; its functions read these
    for name, value in {"VENV": old, "PY": old / "bin" / "python", "STAMP": old / ".torchshard-installed"}.items():
        monkeypatch.setitem(live, name, value)

    def no_python(version: str) -> tuple[str, dict]:
        raise SystemExit(f"no python {version} here")

    monkeypatch.setitem(live, "_interpreter", no_python)
    with pytest.raises(SystemExit, match=r"no python 3\.12 here"):
        dev["ensure_venv"]()
    assert not old.exists()
    assert ".venv is Python 3.11; the pinned stack is 3.12: rebuilding it" in capsys.readouterr().out


def test_a_venv_of_the_pinned_python_is_kept(monkeypatch, tmp_path):
    dev = _dev(monkeypatch, tmp_path)
    kept = tmp_path / ".venv"
    kept.mkdir()
    (kept / "pyvenv.cfg").write_text("home = /usr/bin\nversion_info = 3.12.1\n")
    monkeypatch.setitem(dev["_venv_version"].__globals__, "VENV", kept)
    assert dev["_venv_version"]() == "3.12"
    monkeypatch.setitem(dev["_venv_version"].__globals__, "VENV", tmp_path / "none")
    assert dev["_venv_version"]() is None
