"""Bootstrap: `python3 dev.py demo` runs the main example, `python3 dev.py test` the tests; both set up .venv first.

`python3 dev.py run SCRIPT [ARGS]` runs any script (an example, a benchmark) in that environment, and
`python3 dev.py docs` builds the docs site with `mkdocs build --strict` (a broken link fails it).

`python3 dev.py compat` runs the quick suite on today's newest stack instead: a cached Python 3.12 venv
(built once outside the clone) with whatever an unconstrained `pip install` picks, then once more with the
newest torchax pre-release layered on top.

`python3 dev.py gpu [--smoke]` runs the prepared device check (benchmarks/gpu.py) with the Python that runs
dev.py when that Python has torch, jax and transformers (a GPU machine's image: it reaches no package index, so
no .venv is made there), else in .venv as the other commands do. `python3 dev.py gpu --wheels DIR` fetches the
pure-Python packages it needs that such an image may lack, at constraints.txt's versions, as wheels into DIR.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".torchshard-installed"
PTH = "torchshard-lm_eval.pth"  # lm_eval's start-up hook (setup.py)
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
    # the docs site into build/site; strict: a broken link or a docstring the reference cannot read fails
    "docs": [["-m", "mkdocs", "build", "--strict"]],
    # any script with this clone's torchshard and .venv's packages: `python3 dev.py run examples/train_lm.py ...`
    "run": [[]],
    # every transformers causal-LM family × every capability against eager torch (docs/conformance.md)
    "conformance": [["tools/conformance.py"]],
}
# the newest-stack job: outside the clone so every clone (and CI) reuses the multi-GB venv
COMPAT_VENV = Path(os.environ.get("TORCHSHARD_COMPAT_VENV", Path.home() / ".cache" / "torchshard" / "compat-py312"))
COMPAT_PYTHON = "3.12"
COMPAT_PRE = COMPAT_VENV / "torchax-pre"  # the newest torchax pre-release, put first on the path for the second run
COMPAT_EXTRAS = ("test", "examples", "hf")
EXTRAS = (*COMPAT_EXTRAS, "docs")  # what .venv holds: the compat job needs no docs toolchain
# the quick suite (the README's blocks are in it) and the stack's own checks, slow or not
COMPAT_TESTS = ["-m", "pytest", "-n", "2", "-m", "not slow or compat", "-q"]
ALL_COMMANDS = (*COMMANDS, "compat", "gpu")
# what the device check imports that a GPU image may lack (pure Python: one wheel fits every machine)
GPU_WHEELS = ("torchax", "optax", "absl-py")
GPU_NEEDS = ("torch", "jax", "transformers")  # what it cannot carry: the image's own builds for its GPU


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt", "setup.py"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def _install_lm_eval_hook() -> None:
    """Puts setup.py's ``.pth`` in .venv's site-packages: a wheel ships it, an editable install leaves it out.

    It lets a bare ``lm_eval --model torchshard`` find torchshard's model (lm_eval discovers no plugins).
    """
    for site_packages in VENV.glob("lib/python3*/site-packages"):
        if not (site_packages / PTH).exists():
            shutil.copyfile(ROOT / PTH, site_packages / PTH)


def ensure_venv() -> None:
    """Creates .venv and installs the pinned dependencies unless that is already done."""
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        _install_lm_eval_hook()
        return
    if not PY.exists():
        print("dev.py: creating .venv", flush=True)
        venv.create(VENV, with_pip=True)
    print("dev.py: installing pinned dependencies (first run only)", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-c", "constraints.txt", "-e", f".[{','.join(EXTRAS)}]"], cwd=ROOT, check=True)
    _install_lm_eval_hook()
    STAMP.write_text(_fingerprint())


def _requirements() -> list[str]:
    """What `pip install -e .[test,examples,hf]` asks for, less torchshard (the tests import it from the clone)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in COMPAT_EXTRAS for r in project["optional-dependencies"][extra]]
    return sorted(set(project["dependencies"] + extras))


def _interpreter(version: str) -> tuple[str, dict[str, str]]:
    """A python<version> to build the venv with, and the environment it needs (pyenv picks by PYENV_VERSION)."""
    env = dict(os.environ)
    if pyenv := shutil.which("pyenv"):
        bare = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True).stdout.split()
        if found := [v for v in bare if v.startswith(f"{version}.")]:
            env["PYENV_VERSION"] = found[-1]
    exe = shutil.which(f"python{version}")
    if exe is None or subprocess.run([exe, "--version"], env=env, capture_output=True).returncode:
        raise SystemExit(f"dev.py compat: needs python{version} on PATH (e.g. `pyenv install {version}`)")
    return exe, env


def ensure_compat_venv() -> Path:
    """Builds the newest-stack venv once; rebuilt only when the requirements change. Returns its python."""
    python = COMPAT_VENV / "bin" / "python"
    stamp = COMPAT_VENV / ".torchshard-requirements"
    wanted = json.dumps(_requirements())
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        exe, env = _interpreter(COMPAT_PYTHON)
        print(f"dev.py compat: creating {COMPAT_VENV} with Python {COMPAT_PYTHON}", flush=True)
        subprocess.run([exe, "-m", "venv", str(COMPAT_VENV)], env=env, check=True)
    # No constraints, and no machine-wide pip configuration either (one may pin or cap versions): the
    # point of this job is exactly what an unconstrained install picks today.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--upgrade"]
    print("dev.py compat: installing the newest releases (first run only; torch may be several GB)", flush=True)
    subprocess.run([*pip, *json.loads(wanted)], env=env, check=True)
    subprocess.run([*pip, "--pre", "--no-deps", "--target", str(COMPAT_PRE), "torchax"], env=env, check=True)
    stamp.write_text(wanted)
    return python


def _versions(python: Path, env: dict[str, str]) -> str:
    names = ("torch", "torchax", "jax", "optax", "transformers")
    code = f"import importlib.metadata as m; print(', '.join(n + ' ' + m.version(n) for n in {names!r}))"
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def compat(argv: list[str]) -> int:
    """The quick suite on the newest releases, then again with the newest torchax pre-release."""
    if "--if-cached" in argv and not (COMPAT_VENV / ".torchshard-requirements").exists():
        print(f"dev.py compat: SKIPPED: no newest-stack venv cached at {COMPAT_VENV} (dev.py compat builds one)")
        return 0
    python = ensure_compat_venv()
    os.chdir(ROOT)
    extra = [a for a in argv if a != "--if-cached"]
    for label, path in (("releases", [str(ROOT)]), ("torchax pre-release", [str(COMPAT_PRE), str(ROOT)])):
        env = _cached_bytecode({**os.environ, "PYTHONPATH": os.pathsep.join(path)})
        print(f"dev.py compat: quick suite on the newest {label}: {_versions(python, env)}", flush=True)
        if code := subprocess.call([str(python), *COMPAT_TESTS, *extra], env=env):
            return code
    return 0


def _pins(names: tuple[str, ...]) -> list[str]:
    """``name==version`` for each of ``names`` as constraints.txt pins it."""
    pins = dict(ln.split("==") for ln in (ROOT / "constraints.txt").read_text().splitlines() if "==" in ln)
    return [f"{name}=={pins[name]}" for name in names]


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def gpu(argv: list[str]) -> int:
    """The device check with this Python where it has the stack (a GPU image), else with .venv; or, with
    ``--wheels DIR``, the wheels it carries there."""
    if "--wheels" in argv:
        if argv.index("--wheels") + 1 >= len(argv):
            print("usage: python3 dev.py gpu --wheels DIR", file=sys.stderr)
            return 2
        target = Path(argv[argv.index("--wheels") + 1]).resolve()
        ensure_venv()
        pip = [str(PY), "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps"]
        code = subprocess.call([*pip, "--only-binary=:all:", "-d", str(target), *_pins(GPU_WHEELS)], cwd=ROOT)
        if not code:
            print(f"dev.py gpu: {', '.join(sorted(p.name for p in target.glob('*.whl')))} in {target}")
        return code
    python = sys.executable
    if missing := [m for m in GPU_NEEDS if importlib.util.find_spec(m) is None]:
        if _has_gpu():  # a device machine reaches no index: building .venv there would only fail, slowly
            print(f"dev.py gpu: {python} cannot import {', '.join(missing)}; run dev.py with the image's "
                  "python3 that has torch, jax and transformers", file=sys.stderr)  # fmt: skip
            return 2
        ensure_venv()
        python = str(PY)
    # the caller's directory stays, as with `run`: a relative --out is theirs
    return subprocess.call([python, str(ROOT / "benchmarks" / "gpu.py"), *argv], env=_env())


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compat":
        return compat(argv[1:])
    if argv and argv[0] == "gpu":
        return gpu(argv[1:])
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python3 dev.py {{{'|'.join(ALL_COMMANDS)}}} [extra args]", file=sys.stderr)
        return 2
    if argv[0] == "run" and len(argv) < 2:
        print("usage: python3 dev.py run SCRIPT [ARGS]  (e.g. examples/train_lm.py --steps 60)", file=sys.stderr)
        return 2
    ensure_venv()
    if argv[0] == "run":  # the caller's directory stays: the script's relative paths are theirs
        return subprocess.call([str(PY), *argv[1:]], env=_env())
    os.chdir(ROOT)
    steps = COMMANDS[argv[0]]
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        cmd = [str(PY), *step, *(argv[1:] if last else [])]  # extra arguments go to the last step
        print(f"dev.py: {' '.join(step)}", flush=True)
        code = subprocess.call(cmd, env=_env())
        if code:
            return code
    return 0


def _cached_bytecode(env: dict[str, str]) -> dict[str, str]:
    """``env`` without PYTHONDONTWRITEBYTECODE: a machine that sets it (ours does) makes every pytest worker
    re-rewrite the asserts of ~190 test modules (5 s each time) and every launched process recompile torchshard."""
    return {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _env() -> dict[str, str]:
    # this clone's torchshard first, whichever clone's .venv this is; mkdocs-material's banner about its
    # successor is news, not a build problem
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return _cached_bytecode({**os.environ, "PYTHONPATH": path, "NO_MKDOCS_2_WARNING": "1"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
