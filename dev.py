"""Bootstrap: `python3 dev.py demo` runs the main example, `python3 dev.py test` the tests; both set up .venv first.

`python3 dev.py run SCRIPT [ARGS]` runs any script (an example, a benchmark) in that environment, and
`python3 dev.py docs` builds the docs site with `mkdocs build --strict` (a broken link fails it).

`python3 dev.py compat [--lane floor|newest] [--if-cached]` runs the quick suite on the other two tested stacks,
each a cached Python 3.12 venv built once outside the clone: `floor`, the GPU machine's image (FLOOR's versions),
and `newest`, whatever an unconstrained `pip install` picks, then once more with the newest torchax pre-release
layered on top. No `--lane` runs both; `--if-cached` runs only the lanes already built and names the others.

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
import re
import shutil
import subprocess
import sys
import tomllib
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
    # the docs site into build/site; strict: a broken link or a docstring the reference cannot read fails
    "docs": [["-m", "mkdocs", "build", "--strict"]],
    # any script with this clone's torchshard and .venv's packages: `python3 dev.py run examples/train_lm.py ...`
    "run": [[]],
    # every transformers causal-LM family × every capability against eager torch (docs/conformance.md)
    "conformance": [["tools/conformance.py"]],
}
# the compat lanes' venvs: outside the clone so every clone (and CI) reuses the multi-GB installs
CACHE = Path.home() / ".cache" / "torchshard"
LANES = {
    "floor": Path(os.environ.get("TORCHSHARD_FLOOR_VENV", CACHE / "floor-py312")),
    "newest": Path(os.environ.get("TORCHSHARD_COMPAT_VENV", CACHE / "compat-py312")),
}
# the floor lane: the GPU machine's image exactly; pyproject declares these as its floors. optax and torchax as
# constraints.txt pins them; everything else unpinned.
FLOOR = ("torch==2.11.0", "jax==0.11.2", "jaxlib==0.11.2", "transformers==5.17.0", "numpy==2.5.2")
FLOOR_AT_PINS = ("optax", "torchax")
PINNED_PYTHON = "3.12"  # the GPU machine's image runs 3.12, and jax >= 0.11 needs it
COMPAT_PYTHON = PINNED_PYTHON
COMPAT_PRE = LANES["newest"] / "torchax-pre"  # the newest torchax pre-release, first on the path for a second run
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
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def _venv_version() -> str | None:
    """The Python version .venv was made with ("3.12"), or None when there is no .venv."""
    cfg = VENV / "pyvenv.cfg"
    if not cfg.exists():
        return None
    fields = dict(map(str.strip, line.split("=", 1)) for line in cfg.read_text().splitlines() if "=" in line)
    full = fields.get("version_info") or fields.get("version") or ""
    return ".".join(full.split(".")[:2]) or None


def ensure_venv() -> None:
    """Creates .venv with the pinned Python and installs the pinned dependencies unless that is already done."""
    if _venv_version() not in (None, PINNED_PYTHON):
        # a .venv from before the pinned stack moved to Python 3.12: nothing in it can be reused
        print(f"dev.py: .venv is Python {_venv_version()}; the pinned stack is {PINNED_PYTHON}: rebuilding it")
        shutil.rmtree(VENV)
    if STAMP.exists() and STAMP.read_text() == _fingerprint():
        return
    if not PY.exists():
        exe, env = _interpreter(PINNED_PYTHON)
        print(f"dev.py: creating .venv with Python {PINNED_PYTHON} ({exe})", flush=True)
        subprocess.run([exe, "-m", "venv", str(VENV)], env=env, check=True)
    print("dev.py: installing pinned dependencies (first run only; torch's Linux wheel is several GB)", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-c", "constraints.txt", "-e", f".[{','.join(EXTRAS)}]"], cwd=ROOT, check=True)
    STAMP.write_text(_fingerprint())


def _requirements() -> list[str]:
    """What `pip install -e .[test,examples,hf]` asks for, less torchshard (the tests import it from the clone)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in COMPAT_EXTRAS for r in project["optional-dependencies"][extra]]
    return sorted(set(project["dependencies"] + extras))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def lane_requirements(lane: str) -> list[str]:
    """What ``lane``'s venv installs: the requirements, with the floor lane's versions in place of their ranges."""
    wanted = _requirements()
    if lane == "newest":
        return wanted
    pins = [*FLOOR, *_pins(FLOOR_AT_PINS)]
    pinned = {_name(p) for p in pins}
    return sorted([*pins, *(r for r in wanted if _name(r) not in pinned)])


def _runs_as(exe: str, version: str, env: dict[str, str]) -> bool:
    """Whether ``exe`` starts and is Python ``version`` (a pyenv shim exists for versions it does not have)."""
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        done = subprocess.run([exe, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == version


def _interpreter(version: str) -> tuple[str, dict[str, str]]:
    """A python<version> to build a venv with, and the environment it needs (pyenv picks by PYENV_VERSION).

    Looks at $TORCHSHARD_PYTHON, the Python running dev.py, ``python<version>`` on PATH (pyenv's included) and
    uv's managed Pythons, in that order; exits with how to get one when none is there.
    """
    env = dict(os.environ)
    if pyenv := shutil.which("pyenv"):
        bare = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True).stdout.split()
        if found := [v for v in bare if v.startswith(f"{version}.")]:
            env["PYENV_VERSION"] = found[-1]
    uv_pythons = sorted((Path.home() / ".local" / "share" / "uv" / "python").glob(f"cpython-{version}.*/bin/python3"))
    chosen = os.environ.get("TORCHSHARD_PYTHON")
    candidates = [chosen] if chosen else [sys.executable, shutil.which(f"python{version}"), *map(str, uv_pythons)]
    for exe in filter(None, candidates):
        if _runs_as(exe, version, env):
            return exe, env
    where = f"$TORCHSHARD_PYTHON ({chosen}) is not" if chosen else "found no"
    raise SystemExit(
        f"dev.py: {where} Python {version}, which torchshard's tested stacks run on (jax >= 0.11 needs it).\n"
        f"Get one, then run the same command again; any of these works:\n"
        f"  pyenv install {version}            (dev.py finds pyenv's versions)\n"
        f"  uv python install {version}        (dev.py finds uv's Pythons)\n"
        f"  apt install python{version} python{version}-venv   (Debian/Ubuntu; or python.org's installer)\n"
        f"or point TORCHSHARD_PYTHON at a python{version} that is already there."
    )


def _stamp(lane: str) -> Path:
    return LANES[lane] / ".torchshard-requirements"


def ensure_lane(lane: str) -> Path:
    """Builds ``lane``'s venv once; rebuilt only when its requirements change. Returns its python."""
    venv_dir = LANES[lane]
    python, stamp = venv_dir / "bin" / "python", _stamp(lane)
    wanted = json.dumps(lane_requirements(lane))
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        exe, env = _interpreter(COMPAT_PYTHON)
        print(f"dev.py compat: creating {venv_dir} with Python {COMPAT_PYTHON}", flush=True)
        subprocess.run([exe, "-m", "venv", str(venv_dir)], env=env, check=True)
    # No constraints, and no machine-wide pip configuration either (one may pin or cap versions): a lane is
    # exactly its own pins, and what an unconstrained install picks today for the rest.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--upgrade"]
    print(f"dev.py compat: installing the {lane} lane (first run only; torch may be several GB)", flush=True)
    subprocess.run([*pip, *json.loads(wanted)], env=env, check=True)
    if lane == "newest":
        subprocess.run([*pip, "--pre", "--no-deps", "--target", str(COMPAT_PRE), "torchax"], env=env, check=True)
    stamp.write_text(wanted)
    return python


def _versions(python: Path, env: dict[str, str]) -> str:
    names = ("torch", "torchax", "jax", "optax", "transformers", "numpy")
    code = f"import importlib.metadata as m; print(', '.join(n + ' ' + m.version(n) for n in {names!r}))"
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def _lane_args(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """The lanes ``argv`` asks for and the arguments left for pytest; None (after a usage line) when it is wrong."""
    usage = f"usage: python3 dev.py compat [--lane {'|'.join(LANES)}] [--if-cached] [pytest args]"
    rest = [w for a in argv if a != "--if-cached" for w in (a.split("=", 1) if a.startswith("--lane=") else [a])]
    if "--lane" not in rest:
        return list(LANES), rest
    at = rest.index("--lane")
    lane = rest[at + 1] if at + 1 < len(rest) else None
    if lane not in LANES:
        print(f"{usage}\ndev.py compat: unknown lane {lane!r}; the lanes are {', '.join(LANES)}", file=sys.stderr)
        return None
    return [lane], rest[:at] + rest[at + 2 :]


def compat(argv: list[str]) -> int:
    """The quick suite on each lane asked for (the newest once more with the newest torchax pre-release)."""
    if (parsed := _lane_args(argv)) is None:
        return 2
    lanes, extra = parsed
    if "--if-cached" in argv:
        for lane in (lane for lane in lanes if not _stamp(lane).exists()):
            print(f"dev.py compat: SKIPPED the {lane} lane: no venv cached at {LANES[lane]} (dev.py compat builds it)")
        lanes = [lane for lane in lanes if _stamp(lane).exists()]
    pythons = {lane: ensure_lane(lane) for lane in lanes}
    os.chdir(ROOT)
    codes = {}  # every run, even after one fails: each says something the others do not
    for lane, python in pythons.items():
        runs = [("releases", [str(ROOT)])]
        if lane == "newest":
            runs.append(("torchax pre-release", [str(COMPAT_PRE), str(ROOT)]))
        for label, path in runs:
            env = _cached_bytecode({**os.environ, "PYTHONPATH": os.pathsep.join(path)})
            print(f"dev.py compat: quick suite, {lane} lane ({label}): {_versions(python, env)}", flush=True)
            codes[f"{lane} lane ({label})"] = subprocess.call([str(python), *COMPAT_TESTS, *extra], env=env)
    for run, code in codes.items():
        print(f"dev.py compat: {run}: {'passed' if code == 0 else f'FAILED (exit {code})'}")
    return next((code for code in codes.values() if code), 0)


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
