"""A real full disk for the tests of failed writes: a small tmpfs mounted under the test's folder and filled.

Mounting needs root (CAP_SYS_ADMIN), as in this project's containers; elsewhere the tests that use it skip
with that reason. Unlike an ``OSError`` patched into one function, every write of every library (torch's zip
writer, JAX's profiler, ``os.write``) meets the full disk as it would in a run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

FILLER = "filler"


@contextlib.contextmanager
def full_tmpfs(
    where: Path, *, size_kib: int = 256, before: Callable[[Path], object] | None = None, fill: bool = True
) -> Iterator[Path]:
    """A ``size_kib`` tmpfs at ``where``, filled to the last byte by a file named `FILLER` (unless not ``fill``:
    then a write larger than it fills it halfway); unmounted after.

    Args:
        where: a folder that does not exist yet (made here).
        size_kib: the filesystem's size.
        before: called with ``where`` on the empty filesystem before it is filled, e.g. an earlier save.
    """
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode:
        pytest.skip(f"a full disk is a small tmpfs, and mounting one needs root: {done.stderr.strip()}")
    try:
        if before is not None:
            before(where)
        if fill:
            _fill(where / FILLER)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)


def listing(root: Path) -> list[str]:
    """Every path under ``root`` (hidden ones included), relative, but the filler."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != FILLER)
