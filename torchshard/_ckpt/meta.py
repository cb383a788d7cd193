"""Checkpoint metadata (``torchshard.json``): names, shapes, dtypes and checksums, written last."""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from torchshard._base.errors import CheckpointError, raise_if_any
from torchshard._base.validate import describe_mesh
from torchshard._ckpt.checksum import checksums, finish_checksums, is_checksum, start_checksums
from torchshard._ckpt.datastate import data_entry_problems
from torchshard._ckpt.stepdir import META

FORMAT = "torchshard-checkpoint"
VERSION = 2  # 2 adds the digest; version 1 files (without one) still load


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


def metadata(
    module: str,
    names: Mapping[str, str],
    tree: dict[str, Any],
    step: int,
    *,
    stacks: Mapping[str, Any] | None = None,
    sums: Any = None,
) -> dict[str, Any]:
    """The metadata of a checkpoint of ``tree`` (`state_tree`'s), checksums included.

    ``stacks`` maps each stacked key of a scanned Trainer to the torch names of its layers;
    ``sums`` are the tree's `checksums` if already computed.
    """
    sums = checksums(tree) if sums is None else sums
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
        "stacks": {k: list(v) for k, v in (stacks or {}).items()},
        "tensors": _leaves_meta(tree["model"], sums["model"]),
        "trainer": trainer,
    }


def _digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_meta(directory: pathlib.Path, meta: dict[str, Any]) -> None:
    """Writes ``torchshard.json`` into ``directory``, with a digest of its content."""
    (directory / META).write_text(json.dumps(meta | {"digest": _digest(meta)}, indent=1))


def _is_shape(x: Any) -> bool:
    return isinstance(x, list) and all(type(d) is int and d >= 0 for d in x)


def _is_dtype(x: Any) -> bool:
    try:
        np.dtype(x)
    except (TypeError, ValueError):
        return False
    return isinstance(x, str)


def _leaf_problems(where: str, leaves: Any) -> list[str]:
    if not isinstance(leaves, dict):
        return [f"{where}: a {type(leaves).__name__}, not a map of name → shape, dtype and checksum"]
    problems = []
    for name, leaf in leaves.items():
        fields = leaf if isinstance(leaf, dict) else {}
        if not (
            _is_shape(fields.get("shape")) and _is_dtype(fields.get("dtype")) and is_checksum(fields.get("checksum"))
        ):
            problems.append(f"{where} {name!r}: {leaf!r:.80} is not a shape, dtype and checksum")
    return problems


def _structure_problems(meta: dict[str, Any]) -> list[str]:
    problems = []
    if type(meta.get("step")) is not int:
        problems.append(f"step {meta.get('step')!r} is not an int")
    names, tensors = meta.get("names"), meta.get("tensors")
    problems += _leaf_problems("tensors", tensors)
    if meta.get("trainer") is not None:
        problems += _leaf_problems("trainer", meta["trainer"])
    stacks = meta.get("stacks") or {}
    problems += _stack_problems(stacks, tensors)
    layers = {n for v in stacks.values() if isinstance(v, list) for n in v}
    if not isinstance(names, dict) or not all(isinstance(c, str) for c in names.values()):
        problems.append("names is not a map of name → stored name")
    elif isinstance(tensors, dict):
        stored = set(tensors) | layers
        problems += [f"names {n!r} → {c!r}: no such stored tensor" for n, c in names.items() if c not in stored]
    files = meta.get("files")
    if not isinstance(files, dict) or not all(type(size) is int for size in files.values()):
        problems.append("files is not a map of file name → size")
    return problems + data_entry_problems(meta.get("data"))


def _stack_problems(stacks: Any, tensors: Any) -> list[str]:
    if not isinstance(stacks, dict) or not all(isinstance(v, list) for v in stacks.values()):
        return ["stacks is not a map of stacked key → layer names"]
    tensors = tensors if isinstance(tensors, dict) else {}
    problems = [f"stacks {k!r}: no such stored tensor" for k in stacks if k not in tensors]
    return problems + [
        f"stacks {k!r}: {len(v)} layer names for a stack of {tensors[k]['shape'][:1]}"
        for k, v in stacks.items()
        if k in tensors and isinstance(tensors[k], dict) and tensors[k].get("shape", [None])[:1] != [len(v)]
    ]


def meta_problems(meta: Any) -> list[str]:
    """Everything wrong with a parsed ``torchshard.json``: format, version, digest and structure."""
    if not isinstance(meta, dict):
        return [f"its content is a {type(meta).__name__}, not an object"]
    if meta.get("format") != FORMAT or type(meta.get("version")) is not int or meta["version"] not in (1, VERSION):
        return [
            f"format {meta.get('format')!r} version {meta.get('version')!r}: expected {FORMAT!r} version ≤ {VERSION}"
        ]
    problems = _structure_problems(meta)
    if meta["version"] >= 2 and meta.get("digest") != _digest(meta):  # version 1 files carry no digest
        problems.append("its digest does not match its content: the file was changed or damaged after the save")
    return problems


def read_meta(step_dir: pathlib.Path) -> dict[str, Any]:
    """Reads and checks ``torchshard.json``; a damaged file is a `CheckpointError` naming it and every problem."""
    file = step_dir / META
    fix = f"the checkpoint is corrupted or not a torchshard checkpoint (version {VERSION}); load an earlier step"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable or malformed ({type(e).__name__}: {e}); {fix}") from None
    raise_if_any(meta_problems(meta), header=f"{file} is unreadable or malformed; {fix}", error=CheckpointError)
    return meta


def checksum_problems(meta: dict[str, Any], restored: dict[str, Any], local: list[Any] | None = None) -> list[str]:
    """Every restored array whose checksum differs from the saved one.

    ``local``: this process's host sums of each leaf as read (`read_state`'s), ``None`` where it has none.
    """
    sums = finish_checksums(start_checksums(restored), local)
    bad = [n for n, s in sums["model"].items() if s != meta["tensors"][n]["checksum"]]
    if "trainer" in restored:
        bad += [p for p, s in flat_sums(sums["trainer"]).items() if s != meta["trainer"][p]["checksum"]]
    return [f"{n}: checksum mismatch, the stored values are not the ones saved" for n in bad]
