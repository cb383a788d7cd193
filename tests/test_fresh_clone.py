"""Every shell command of the README and the first-run page runs as written in a fresh clone of this commit.

The clone is made right after the two set-up commands would have run: it shares this checkout's ``.venv`` (the
same pinned versions, so ``dev.py`` installs nothing) and CI runs ``python3 dev.py test`` itself. A command that
trains runs with short flags: ``--steps N`` becomes ``--steps N/20`` and a tiny model's sizes are appended
(argparse keeps a flag's last value), so a page's run-then-resume pair stays a run and its resume. A page that
repeats an earlier page's commands in other ``--out`` directories (the first-run page repeats the README's) is not
run twice.
"""

from __future__ import annotations

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


def _blank_out(command: str) -> tuple[tuple[str, ...], str]:
    """``command``'s words with the directory after ``--out`` blanked, and that directory."""
    words = shlex.split(command)
    outs = [i for i, w in enumerate(words) if i and words[i - 1] == "--out"]
    return tuple("" if i in outs else w for i, w in enumerate(words)), "".join(words[i] for i in outs)


def repeats(page: list[str], earlier: list[str]) -> bool:
    """Whether ``page`` runs ``earlier``'s commands in its order, each in its own ``--out`` directory for one of
    ``earlier``'s: the README and the first-run page show the same runs. One directory stands for one, so a page
    whose resume names another directory than its run is no repeat, and runs (and fails)."""
    if len(page) != len(earlier):
        return False
    renaming: dict[str, str] = {}
    for mine, theirs in zip(page, earlier, strict=True):
        (words, out), (their_words, their_out) = _blank_out(mine), _blank_out(theirs)
        if words != their_words or renaming.setdefault(out, their_out) != their_out:
            return False
    return len(set(renaming.values())) == len(renaming)


def test_a_page_repeats_another_only_under_a_one_to_one_renaming_of_its_out_directories():
    run, resume = (
        "python3 dev.py run examples/train_lm.py --steps 3 --out {}",
        "python3 dev.py run x.py --out {} --resume",
    )
    readme = [run.format("a"), resume.format("a"), run.format("cp")]
    assert repeats([run.format("b"), resume.format("b"), run.format("b-cp")], readme)
    assert not repeats([run.format("b"), resume.format("c"), run.format("b-cp")], readme)  # resumes another run
    assert not repeats([run.format("b"), resume.format("b"), run.format("b")], readme)  # two of the README's in one
    assert not repeats([run.format("b"), resume.format("b")], readme)
    assert not repeats(["python3 dev.py docs", resume.format("b"), run.format("b-cp")], readme)


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
    pages = [[c for c in shell_commands((clone / source).read_text()) if c not in SETUP] for source in SOURCES]
    assert all(pages)
    # No JAX compilation cache: on XLA:CPU (jaxlib 0.10) an executable it returns can deadlock, its devices
    # waiting in different collectives (docs/development.md, "Suite time").
    for i, page in enumerate(pages):
        if any(repeats(page, earlier) for earlier in pages[:i]):
            continue
        for command in page:
            run = subprocess.run(["bash", "-c", shortened(command)], cwd=clone, capture_output=True, text=True,
                                 timeout=600)  # fmt: skip
            output = f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
            assert run.returncode == 0, f"{command!r} failed ({run.returncode}):\n{output}"
