"""The step-directory protocol of checkpoints: names, listing, atomic commit and pruning (pure pathlib)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil

from torchshard._errors import CheckpointError, raise_if_any

META = "torchshard.json"  # written last: a step directory without it is not a checkpoint
STATE = "state"  # the orbax PyTree checkpoint inside a step directory
TMP = ".torchshard-tmp-"  # a save in progress (or interrupted); never loaded
OLD = ".torchshard-old-"  # a step being replaced by a new save of the same step
_STEP = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    """The directory name of ``step``.

    Example:
        >>> step_name(100)
        'step_00000100'
    """
    return f"step_{step:08d}"


def checkpoint_steps(path: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints under ``path``, oldest first.

    Interrupted saves (hidden temporary directories, step directories without
    ``torchshard.json``) are never listed.

    Args:
        path: the checkpoint root given to `save`.

    Returns:
        Sorted step numbers; empty if there are none or ``path`` does not exist.

    Example:
        >>> checkpoint_steps("no/such/dir")
        []
    """
    root = pathlib.Path(path)
    if not root.is_dir():
        return []
    found = (_STEP.fullmatch(d.name) for d in root.iterdir() if (d / META).is_file())
    return sorted(int(m.group(1)) for m in found if m)


def resolve(root: pathlib.Path, step: int | None) -> pathlib.Path:
    """The step directory `load` reads: ``root`` itself, its step ``step``, or its latest step."""
    if step is None and (root / META).is_file():
        return root
    if not root.exists():
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist; check the path")
    steps = checkpoint_steps(root)
    if step is not None and step not in steps:
        raise CheckpointError(f"no complete checkpoint for step {step} under {root}; available steps: {steps}")
    if not steps:
        found = "an interrupted save" if _STEP.fullmatch(root.name) else f"no step_<N>/{META} inside"
        raise CheckpointError(
            f"no complete checkpoint at {root} ({found}); pass the checkpoint root that save() wrote, or save one first"
        )
    return root / step_name(steps[-1] if step is None else step)


def remove(path: pathlib.Path) -> None:
    """Deletes a file or directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def file_sizes(directory: pathlib.Path) -> dict[str, int]:
    """Relative path → size of every file under ``directory``."""
    return {f.relative_to(directory).as_posix(): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}


def check_files(step_dir: pathlib.Path, sizes: dict[str, int]) -> None:
    """Catches deleted and truncated files with a stat each, before anything is read."""
    problems = []
    for name, size in sizes.items():
        file = step_dir / STATE / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            problems.append(f"{STATE}/{name}: " + ("missing" if found is None else f"{found} bytes, saved {size}"))
    raise_if_any(problems, header=f"{step_dir} is incomplete or truncated; load an earlier step", error=CheckpointError)


def commit(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Moves a finished save into place by renames: readers see a complete old or new step, never half."""
    old = final.with_name(OLD + final.name)
    remove(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    remove(old)


def prune(root: pathlib.Path, keep_last: int | None, *, saved: int) -> None:
    """Deletes leftovers of interrupted saves, then all but the newest ``keep_last`` steps."""
    for d in root.iterdir():
        if d.name.startswith((TMP, OLD)):
            remove(d)
    if keep_last is None:
        return
    others = [s for s in checkpoint_steps(root) if s != saved]
    for step in others[: max(0, len(others) - (keep_last - 1))]:
        remove(root / step_name(step))
