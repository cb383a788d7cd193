"""Every shell command of the README and the first-run page runs as written in a fresh clone of this commit.

The clone is made right after the two set-up commands would have run: it shares this checkout's ``.venv`` (the
same pinned versions, so ``dev.py`` installs nothing) and CI runs ``python3 dev.py test`` itself. A command that
trains runs with short flags: ``--steps N`` becomes ``--steps N/20`` and a tiny model's sizes are appended
(argparse keeps a flag's last value), so a page's run-then-resume pair stays a run and its resume.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/first-run.md")
SETUP = {"python3 dev.py demo", "python3 dev.py test"}  # the two set-up commands: CI runs them
# what makes a training script's run take seconds: one block of width 64 over 8 x 32 bytes
TINY = {"examples/train_lm.py": ["--batch", "8", "--seq", "32", "--layers", "1", "--d-model", "64", "--heads", "2"]}
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def shell_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks, one per line, comments dropped."""
    lines = (line.split(" #")[0].strip() for block in FENCE.findall(text) for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def shortened(command: str) -> str:
    """``command`` with a training script's steps cut twentyfold and its tiny sizes appended."""
    words = shlex.split(command)
    script = next((w for w in words if w in TINY), None)
    if script is None:
        return command
    words = [str(max(2, int(w) // 20)) if i and words[i - 1] == "--steps" else w for i, w in enumerate(words)]
    return shlex.join([*words, *TINY[script]])


def test_shortened_cuts_steps_and_appends_the_tiny_sizes():
    command = "python3 dev.py run examples/train_lm.py --steps 100 --out /tmp/x --resume"
    short = "python3 dev.py run examples/train_lm.py --steps 5 --out /tmp/x --resume --batch 8"
    assert shortened(command).startswith(short)
    assert shortened("python3 dev.py docs") == "python3 dev.py docs"


def test_the_pages_show_commands_and_write_them_for_this_environment():
    commands = [c for source in SOURCES for c in shell_commands((ROOT / source).read_text())]
    assert set(commands) >= SETUP
    # a bare `python script.py` fails in a fresh clone (the packages live in .venv): every page says dev.py run
    assert [c for c in commands if c.startswith("python ")] == []


def _clone(tmp_path: Path) -> Path:
    """A clone of this commit sharing the running venv, which must hold exactly the clone's pins: else dev.py
    would reinstall into it (and point its editable install at the clone)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    venv = Path(sys.prefix)
    stamp = venv / ".torchshard-installed"
    wanted = runpy.run_path(str(clone / "dev.py"), run_name="fresh_clone")["_fingerprint"]()
    if not stamp.is_file() or stamp.read_text() != wanted:
        pytest.skip(f"{venv} was not installed from this commit's pyproject.toml and constraints.txt")
    (clone / ".venv").symlink_to(venv)
    return clone


@pytest.mark.slow
def test_every_shell_command_runs_in_a_fresh_clone(tmp_path):
    clone = _clone(tmp_path)
    commands = [c for source in SOURCES for c in shell_commands((clone / source).read_text()) if c not in SETUP]
    assert commands
    # the commands compile the same tiny programs (a run and its resume, the same run under two --out): one JAX
    # compilation cache for them all compiles each once; what runs is the same executable either way
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    for command in commands:
        run = subprocess.run(["bash", "-c", shortened(command)], cwd=clone, env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
        output = f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        assert run.returncode == 0, f"{command!r} failed ({run.returncode}):\n{output}"
