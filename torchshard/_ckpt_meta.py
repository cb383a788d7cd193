"""Checkpoint metadata (``torchshard.json``): names, shapes, dtypes and checksums, written last."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax

from torchshard._checksum import checksums, is_checksum
from torchshard._errors import CheckpointError
from torchshard._stepdir import META
from torchshard._validate import describe_mesh

FORMAT = "torchshard-checkpoint"
VERSION = 1


def flat(tree: Any) -> dict[str, Any]:
    """keystr path → leaf, e.g. ``"[0].mu['fc.weight']"`` for an optax state."""
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def flat_sums(sums: Any) -> dict[str, list[int]]:
    """`flat` for a tree of `checksums` (whose leaves are lists)."""
    leaves = jax.tree_util.tree_leaves_with_path(sums, is_leaf=is_checksum)
    return {jax.tree_util.keystr(p): s for p, s in leaves}


def _leaves_meta(arrays: Mapping[str, jax.Array], sums: Mapping[str, list[int]]) -> dict[str, Any]:
    return {k: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": sums[k]} for k, x in arrays.items()}


def _mesh_of(arrays: Mapping[str, jax.Array]) -> str | None:
    mesh = next((getattr(a.sharding, "mesh", None) for a in arrays.values()), None)
    return describe_mesh(mesh) if mesh is not None else None


def metadata(module: str, names: Mapping[str, str], tree: dict[str, Any], step: int) -> dict[str, Any]:
    """The metadata of a checkpoint of ``tree`` (`state_tree`'s), checksums included."""
    sums = checksums(tree)
    trainer = None
    if "trainer" in tree:
        trainer = _leaves_meta(flat(tree["trainer"]), flat_sums(sums["trainer"]))
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "module": module,
        "mesh": _mesh_of(tree["model"]),
        "names": dict(names),
        "tensors": _leaves_meta(tree["model"], sums["model"]),
        "trainer": trainer,
    }


def write_meta(directory: pathlib.Path, meta: dict[str, Any]) -> None:
    """Writes ``torchshard.json`` into ``directory``."""
    (directory / META).write_text(json.dumps(meta, indent=1))


def read_meta(step_dir: pathlib.Path) -> dict[str, Any]:
    """Reads and checks ``torchshard.json``; a damaged file is a `CheckpointError` naming it."""
    file = step_dir / META
    try:
        meta = json.loads(file.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}")
        if not isinstance(meta["files"], dict) or not all(c in meta["tensors"] for c in meta["names"].values()):
            raise ValueError("a name refers to no stored tensor")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{file} is unreadable or malformed ({type(e).__name__}: {e}); the checkpoint is corrupted "
            f"or not a torchshard checkpoint (version {VERSION}); load an earlier step"
        ) from None
    return meta


def checksum_problems(meta: dict[str, Any], restored: dict[str, Any]) -> list[str]:
    """Every restored array whose checksum differs from the saved one."""
    sums = checksums(restored)
    bad = [n for n, s in sums["model"].items() if s != meta["tensors"][n]["checksum"]]
    if "trainer" in restored:
        bad += [p for p, s in flat_sums(sums["trainer"]).items() if s != meta["trainer"][p]["checksum"]]
    return [f"{n}: checksum mismatch, the stored values are not the ones saved" for n in bad]
