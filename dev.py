"""Bootstrap: `python3 dev.py demo` runs the main example, `python3 dev.py test` the tests; both set up .venv first."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".torchshard-installed"
# each command is a list of steps; a step that fails stops the command
CHECKS = [
    ["-m", "ruff", "check", "."],
    ["-m", "ruff", "format", "--check", "."],
    ["-m", "mypy"],
]
COMMANDS = {
    "demo": [["examples/train_mlp.py"]],
    # lint, format, types, then the docstring examples and the tests on two workers
    "test": [*CHECKS, ["-m", "pytest", "-n", "2", "--durations=40"]],
    # the same without the tests marked slow (real models, multi-process runs, benchmark smoke runs)
    "quick": [*CHECKS, ["-m", "pytest", "-n", "2", "-m", "not slow"]],
    "lint": CHECKS,
    "bench": [["benchmarks/step_time.py"]],
}


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def ensure_venv() -> None:
    """Creates .venv and installs the pinned dependencies unless that is already done."""
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    if not PY.exists():
        print("dev.py: creating .venv", flush=True)
        venv.create(VENV, with_pip=True)
    print("dev.py: installing pinned dependencies (first run only)", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-c", "constraints.txt", "-e", ".[test,examples,hf]"], cwd=ROOT, check=True)
    STAMP.write_text(_fingerprint())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python3 dev.py {{{'|'.join(COMMANDS)}}} [extra args]", file=sys.stderr)
        return 2
    ensure_venv()
    os.chdir(ROOT)
    steps = COMMANDS[argv[0]]
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        cmd = [str(PY), *step, *(argv[1:] if last else [])]  # extra arguments go to the last step
        print(f"dev.py: {' '.join(step)}", flush=True)
        code = subprocess.call(cmd)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
