"""The step-directory protocol of checkpoints: names, listing, crash-safe commit, deletion and recovery (pure pathlib).

A checkpoint root holds complete ``step_<N>`` directories and, after a crash, hidden leftovers:

* ``.torchshard-tmp-step_<N>``: a save in progress; never listed.
* ``.torchshard-old-step_<N>``: the previous copy of a step being saved again. If the kill came
  between the two renames (``step_<N>`` missing), this complete copy *is* step N: it is listed
  and loaded in its place.
* ``.torchshard-trash-<name>``: something being deleted, already out of sight.

Every change to what a reader sees is one atomic rename, so a kill at any point leaves only
complete steps visible. Readers (`checkpoint_steps`, `resolve`) never change the directory: a
save may be running in another process. The writer (`begin`, before each save) puts leftovers
right: it renames a complete old copy back, finishes deletions and removes interrupted saves.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any

from torchshard._base.errors import ArgumentError, CheckpointError, raise_if_any
from torchshard._ckpt import pending

PathLike = str | os.PathLike[str]  # what every save, load, export and import takes as its path
META = "torchshard.json"  # written last: a step directory without it is not a checkpoint
STATE = "state"  # the orbax PyTree checkpoint inside a step directory
TMP = ".torchshard-tmp-"
OLD = ".torchshard-old-"
TRASH = ".torchshard-trash-"
_STEP = re.compile(r"step_(\d+)")
logger = logging.getLogger(__name__)


def step_name(step: int) -> str:
    """The directory name of ``step``.

    Examples:
        >>> step_name(100)
        'step_00000100'
    """
    return f"step_{step:08d}"


def path_problems(name: str, path: Any) -> list[str]:
    """``path`` must be a non-empty str or ``os.PathLike``.

    Examples:
        >>> path_problems("path", None)
        ["path=None must be a directory path (a non-empty str or os.PathLike), got NoneType; pass e.g. 'checkpoints/'"]
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if isinstance(text, str) and text:
        return []
    return [
        f"{name}={path!r} must be a directory path (a non-empty str or os.PathLike), got {type(path).__name__}; "
        f"pass e.g. 'checkpoints/'"
    ]


def as_path(path: Any, *, doing: str) -> pathlib.Path:
    """``path`` as a ``pathlib.Path``, or an `ArgumentError` from `path_problems`."""
    raise_if_any(path_problems("path", path), header=f"invalid {doing} arguments", error=ArgumentError)
    return pathlib.Path(path)


def _step(name: str, prefix: str = "") -> int | None:
    match = _STEP.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    return int(match.group(1)) if match else None


def _children(root: pathlib.Path) -> list[pathlib.Path]:
    try:
        return sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise CheckpointError(f"{root}: the directory cannot be read ({e.strerror}); check its permissions") from e


def size_problems(step_dir: pathlib.Path, sizes: dict[str, int]) -> list[str]:
    """Every recorded file (step-directory-relative) that is missing or has another size (a stat each; nothing read)."""
    problems = []
    for name, size in sizes.items():
        try:
            found: int | None = (step_dir / name).stat().st_size
        except OSError:
            found = None
        if found != size:
            problems.append(f"{name}: " + ("missing" if found is None else f"{found} bytes, saved {size}"))
    return problems


def recorded_sizes(meta: Any) -> dict[str, int]:
    """Step-directory-relative file → size of every file a parsed ``torchshard.json`` records.

    Those are the arrays' files (``files``, relative to ``state/``) and each process's data state
    (``data.files``, absent from checkpoints saved without ``data=``).

    Examples:
        >>> recorded_sizes({"files": {"manifest.ocdbt": 120}, "data": {"files": {"data/process_0.json": {"size": 9}}}})
        {'state/manifest.ocdbt': 120, 'data/process_0.json': 9}
    """
    sizes = meta["files"]
    if not isinstance(sizes, dict) or not all(isinstance(n, str) and type(s) is int for n, s in sizes.items()):
        raise TypeError("its 'files' entry is not a map of file name → size")
    data = (meta.get("data") or {}).get("files", {})
    if not isinstance(data, dict) or not all(isinstance(f, dict) and type(f.get("size")) is int for f in data.values()):
        raise TypeError("its 'data' entry is not a map of file name → size and checksum")
    return {f"{STATE}/{n}": s for n, s in sizes.items()} | {n: f["size"] for n, f in data.items()}


def incomplete(step_dir: pathlib.Path) -> list[str]:
    """Why ``step_dir`` is not a complete checkpoint; empty if it is.

    Complete: ``torchshard.json`` parses and every data file it records exists with its size.
    """
    try:
        sizes = recorded_sizes(json.loads((step_dir / META).read_text()))
    except FileNotFoundError:
        return [f"no {META} (an interrupted save, or not a checkpoint)"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{META} is unreadable or malformed ({type(e).__name__}: {e})"]
    return size_problems(step_dir, sizes)


def complete_steps(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """Step → the directory holding its complete copy: ``step_<N>``, else its complete hidden old copy."""
    children = _children(root)
    found: dict[int, pathlib.Path] = {}
    for prefix in ("", OLD):  # a visible copy wins: it is the newer one
        for d in children:
            step = _step(d.name, prefix)
            if step is not None and step not in found and not incomplete(d):
                found[step] = d
    return found


def checkpoint_steps(path: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints under ``path``, oldest first.

    A step is listed only if its ``torchshard.json`` parses and every data file it records is
    there with its size (a stat each, nothing read), so interrupted saves and half-deleted steps
    never are. A step whose re-save was killed between its two renames is listed (its complete
    previous copy is loaded). Listing changes nothing on disk; it waits for a background save
    (``save(..., background=True)``) still writing.

    Args:
        path: the checkpoint root given to `save`.

    Returns:
        Sorted step numbers; empty if there are none or ``path`` does not exist.

    Raises:
        ArgumentError: ``path`` is not a path.
        CheckpointError: ``path`` exists but cannot be read.

    Examples:
        >>> checkpoint_steps("no/such/dir")
        []
    """
    root = as_path(path, doing="checkpoint_steps()")
    pending.wait()
    return sorted(complete_steps(root))


def _incomplete_lines(root: pathlib.Path, newer_than: int = -1) -> list[str]:
    dirs = [(s, d) for d in _children(root) if (s := _step(d.name)) is not None and s > newer_than]
    return [f"{d.name}: {'; '.join(why)}" for _, d in dirs if (why := incomplete(d))]


def resolve(root: pathlib.Path, step: int | None) -> pathlib.Path:
    """The step directory `load` reads: ``root`` itself, its step ``step``, or its latest complete step."""
    if step is None and (root / META).is_file():
        return root
    if not root.exists():
        old = root.with_name(OLD + root.name)
        if _step(root.name) is not None and not incomplete(old):
            return old  # its re-save was killed between the renames: the complete old copy is this step
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist; check the path")
    steps = complete_steps(root)
    if step is not None:
        return _exact_step(root, step, steps)
    if not steps:
        found = _incomplete_lines(root) or [f"no step_<N>/{META} inside"]
        fix = "pass the checkpoint root that save() wrote, or save one first"
        raise_if_any(found, header=f"no complete checkpoint at {root}; {fix}", error=CheckpointError)
    skipped = _incomplete_lines(root, newer_than=max(steps))
    if skipped:
        newest = max(steps)
        lines = "; ".join(skipped)
        logger.warning("%s: loading step %d; newer step directories are incomplete: %s", root, newest, lines)
    return steps[max(steps)]


def _exact_step(root: pathlib.Path, step: int, steps: dict[int, pathlib.Path]) -> pathlib.Path:
    if step in steps:
        return steps[step]
    why = incomplete(root / step_name(step)) if (root / step_name(step)).exists() else ["no such step"]
    raise CheckpointError(
        f"no complete checkpoint for step {step} under {root} ({'; '.join(why)}); available steps: {sorted(steps)}"
    )


def file_sizes(directory: pathlib.Path) -> dict[str, int]:
    """Relative path → size of every file under ``directory``."""
    return {f.relative_to(directory).as_posix(): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()}


def check_files(step_dir: pathlib.Path, sizes: dict[str, int]) -> None:
    """Catches deleted and truncated files with a stat each, before anything is read."""
    problems = size_problems(step_dir, sizes)
    raise_if_any(problems, header=f"{step_dir} is incomplete or truncated; load an earlier step", error=CheckpointError)


def _delete(path: pathlib.Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def discard(path: pathlib.Path) -> None:
    """Deletes ``path`` crash-safely: an atomic rename out of sight, then the deletion (`begin` finishes a cut one)."""
    if not os.path.lexists(path):
        return
    trash = path if path.name.startswith(TRASH) else path.with_name(TRASH + path.name)
    if trash != path:
        _delete(trash)  # a leftover of the same name would block the rename
        os.replace(path, trash)
    _delete(trash)


def _hidden_base(name: str) -> str | None:
    """The entry a hidden leftover belongs to (``step_5`` for ``.torchshard-trash-.torchshard-old-step_5``)."""
    rest = name.removeprefix(TRASH)
    for prefix in (TMP, OLD):
        rest = rest.removeprefix(prefix)
    return rest if rest != name else None


def settle(final: pathlib.Path, *, complete: Callable[[pathlib.Path], bool]) -> None:
    """Puts a crash's leftovers of ``final`` right: deletions finished, an interrupted write removed, and its old
    copy renamed back if it is complete and ``final`` is not (a replacement cut between its renames), else deleted.
    """
    for prefix in (TRASH + TMP, TRASH + OLD, TRASH):
        _delete(final.with_name(prefix + final.name))
    discard(final.with_name(TMP + final.name))
    old = final.with_name(OLD + final.name)
    if not os.path.lexists(old):
        return
    if complete(old) and not complete(final):
        discard(final)
        os.replace(old, final)
    else:
        discard(old)


def _complete_step(step_dir: pathlib.Path) -> bool:
    return not incomplete(step_dir)


def recover(root: pathlib.Path) -> None:
    """`settle` for every step of ``root`` that has leftovers."""
    for name in sorted({b for d in _children(root) if (b := _hidden_base(d.name)) is not None}):
        settle(root / name, complete=_complete_step)


def begin(final: pathlib.Path) -> pathlib.Path:
    """Creates the root, recovers it, and returns a fresh hidden directory to write step ``final`` into."""
    os.makedirs(final.parent, exist_ok=True)
    recover(final.parent)
    tmp = final.with_name(TMP + final.name)
    os.mkdir(tmp)
    return tmp


def commit(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
    """Moves a finished save into place; returns where an existing copy of the step went, for `discard` after."""
    old = final.with_name(OLD + final.name)
    if os.path.lexists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    return old


def prune(root: pathlib.Path, keep_last: int | None, *, saved: int) -> None:
    """Deletes all but the newest ``keep_last`` complete steps (``saved`` always stays)."""
    if keep_last is None:
        return
    steps = complete_steps(root)
    others = sorted(s for s in steps if s != saved)
    for step in others[: max(0, len(others) - (keep_last - 1))]:
        discard(steps[step])


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
_NOT_DIR = (errno.EEXIST, errno.ENOTDIR)
_FULL_TEXT = ("RESOURCE_EXHAUSTED", "No space left", "os error 28", "os_error_code='28'", "Disk quota exceeded")
_DENIED_TEXT = ("PERMISSION_DENIED", "Permission denied", "Read-only file system", "os error 13", "os error 30")


def write_failure(path: pathlib.Path, error: BaseException, *, cleanup: str) -> CheckpointError:
    """The `CheckpointError` for a failed write under ``path``: full disk, no permission, a file in the way, or other.

    Args:
        path: what was being written (named in the message).
        error: the ``OSError`` (or a library's wrapper of one).
        cleanup: what was done about it, e.g. "the partial save was removed; earlier steps are intact".

    Examples:
        >>> str(write_failure(pathlib.Path("ckpt"), OSError(errno.ENOSPC, "No space left on device"), cleanup="x"))
        'ckpt: the disk is full (No space left on device); x. Free space or write elsewhere, then save again'
    """
    code = getattr(error, "errno", None)
    text = str(error)
    reason = getattr(error, "strerror", None) or (text.strip().splitlines() or [type(error).__name__])[0]
    if code in _FULL or any(t in text for t in _FULL_TEXT):
        what, fix = f"the disk is full ({reason})", "Free space or write elsewhere, then save again"
    elif code in _DENIED or any(t in text for t in _DENIED_TEXT):
        what, fix = f"not writable ({reason})", "write to a directory you may write to (not a read-only mount)"
    elif code in _NOT_DIR:
        what, fix = f"a file is in the way ({reason})", "pass a directory path, not a file (or a path inside a file)"
    else:
        what, fix = f"could not be written ({type(error).__name__}: {reason})", "check the path and the filesystem"
    return CheckpointError(f"{path}: {what}; {cleanup}. {fix}")
