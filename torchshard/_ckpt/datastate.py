"""Data-loader state in a checkpoint: each process's ``state_dict()`` as pickle-free JSON in ``data/process_<i>.json``.

A loader's state is mostly ints and lists, but torchdata's `StatefulDataLoader` also keeps its
sampler's ``torch.Generator`` state as a tensor, and samplers keep tuples. JSON cannot hold those
as they are, and `torch.load` / `pickle` would run code named by the file. So the values JSON has
no type for are written as tagged objects (``{"__torchshard__": "tensor", "dtype": ..., "shape":
..., "data": <base64 of the raw bytes>}``, likewise tuples, bytes, numpy arrays and dicts with
keys that are not strings) and rebuilt exactly, bit for bit; reading a file constructs only those
types, never anything the file names. A value of any other type is an `ArgumentError` at `save`,
before anything is written.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
from typing import Any

import jax
import numpy as np
import torch

from torchshard._base.errors import ArgumentError, CheckpointError

DATA = "data"  # the folder of a step directory holding every process's data state
TAG = "__torchshard__"
_PLAIN = (str, int, float, bool, type(None))


def data_file(process: int) -> str:
    """The step-directory-relative file of ``process``'s data state.

    Examples:
        >>> data_file(3)
        'data/process_3.json'
    """
    return f"{DATA}/process_{process}.json"


def data_problems(data: Any) -> list[str]:
    """``data`` must have callable ``state_dict`` and ``load_state_dict`` methods (None: no data state).

    Examples:
        >>> data_problems([1, 2])[0].split(";")[0]
        'data=[1, 2] (a list) has no state_dict() and no load_state_dict()'
        >>> data_problems(None)
        []
    """
    missing = [f"{m}()" for m in ("state_dict", "load_state_dict") if not callable(getattr(data, m, None))]
    if data is None or not missing:
        return []
    return [
        f"data={data!r:.60} (a {type(data).__name__}) has no {' and no '.join(missing)}; pass an object with both, "
        f"e.g. torchdata's StatefulDataLoader or a sampler that defines them"
    ]


def _tensor(x: torch.Tensor) -> dict[str, Any]:
    flat = x.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {TAG: "tensor", "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape), "data": _b64(raw)}


def _ndarray(x: np.ndarray | np.generic) -> dict[str, Any]:
    array = np.asarray(x)  # tobytes() below copies in C order whatever the strides
    if array.dtype.hasobject:
        raise TypeError("a numpy array of Python objects")  # its items would need pickle
    scalar = isinstance(x, np.generic)
    return {
        TAG: "ndarray",
        "dtype": array.dtype.str,
        "shape": list(array.shape),
        "scalar": scalar,
        "data": _b64(array.tobytes()),
    }


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class _NoValues(Exception):
    """A tensor in the state that holds no values (on the meta device)."""


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        items = [[_encode(k, f"{where} key {k!r}"), _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
        return {TAG: "dict", "items": items}
    if isinstance(value, list | tuple):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {TAG: "tuple", "items": items}
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise _NoValues(f"a meta tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} at {where}")
        return _tensor(value)
    if isinstance(value, bytes):
        return {TAG: "bytes", "data": _b64(value)}
    if isinstance(value, np.ndarray | np.generic):
        return _ndarray(value)
    raise TypeError(f"a {type(value).__name__} at {where}")


def encode(state: Any, *, what: str = "state") -> bytes:
    """``state`` as pickle-free JSON (tensors, tuples, bytes, numpy arrays and non-string keys tagged).

    Raises:
        ArgumentError: a value of another type, naming where it is and the fix.
        CheckpointError: a tensor on the meta device (no values to save), naming where it is.

    Examples:
        >>> encode({"epoch": 1, "seen": (3, 4)})
        b'{"epoch": 1, "seen": {"__torchshard__": "tuple", "items": [3, 4]}}'
    """
    try:
        return json.dumps(_encode(state, "state")).encode()
    except TypeError as e:
        raise ArgumentError(
            f"{what} holds {e.args[0]}, which a checkpoint stores only as pickle-free JSON: ints, floats, strings, "
            f"bools, None, lists, tuples, dicts, bytes, torch tensors and numpy arrays; have state_dict() return "
            f"those (e.g. a torch.Generator as generator.get_state())"
        ) from None
    except _NoValues as e:
        raise CheckpointError(
            f"{what} holds {e.args[0]}, which has no values to save; have state_dict() return tensors that hold "
            f"their values (e.g. on the CPU)"
        ) from None
    except RecursionError:  # a container that holds itself
        raise ArgumentError(f"{what} holds itself; have state_dict() return a tree of plain values") from None


def _untensor(d: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {d['dtype']!r}")
    raw = base64.b64decode(d["data"], validate=True)
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(d["shape"]).clone()


def _unarray(d: dict[str, Any]) -> np.ndarray | np.generic:
    dtype = np.dtype(d["dtype"])
    if dtype.hasobject:
        raise ValueError("a numpy array of Python objects")
    array = np.frombuffer(base64.b64decode(d["data"], validate=True), dtype=dtype).reshape(d["shape"]).copy()
    return array[()] if d["scalar"] else array


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: _decode(v) for k, v in value.items()}
    if kind in ("tuple", "dict"):
        items = [_decode(v) for v in value["items"]]
        return tuple(items) if kind == "tuple" else {_hashable(k): v for k, v in items}
    decoders = {"tensor": _untensor, "ndarray": _unarray, "bytes": lambda d: base64.b64decode(d["data"])}
    if kind not in decoders:
        raise ValueError(f"unknown tag {kind!r}")
    return decoders[kind](value)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def decode(raw: bytes) -> Any:
    """The state `encode` wrote, rebuilt exactly; a malformed file raises ``ValueError`` (or ``KeyError``).

    Examples:
        >>> decode(encode({"epoch": 1, "seen": (3, 4)}))
        {'epoch': 1, 'seen': (3, 4)}
    """
    return _decode(json.loads(raw))


def write_data(tmp: pathlib.Path, blob: bytes | None) -> str:
    """Writes this process's encoded state into the save's hidden directory; returns its record ("" for none)."""
    if blob is None:
        return ""
    name = data_file(jax.process_index())
    os.makedirs(tmp / DATA, exist_ok=True)  # every process makes it; the first one wins
    with open(tmp / name, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())  # the primary commits the step on the strength of this file
    return json.dumps({"file": name, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()})


def data_entry(records: list[str]) -> dict[str, Any] | None:
    """The ``"data"`` entry of ``torchshard.json`` from every process's `write_data` record (None: no data state).

    Raises:
        CheckpointError: some processes passed ``data=`` and others did not (the same on every process).
    """
    given = [i for i, r in enumerate(records) if r]
    if not given:
        return None
    if len(given) < len(records):
        missing = [i for i, r in enumerate(records) if not r]
        raise CheckpointError(
            f"save(data=...) was given on process(es) {given} but not on {missing}; every process saves its own "
            f"data state, so pass data= on every process (or on none); nothing was saved, earlier steps are intact"
        )
    parsed = [json.loads(r) for r in records]
    return {"processes": len(records), "files": {p["file"]: {"size": p["size"], "sha256": p["sha256"]} for p in parsed}}


def _file_entry(f: Any) -> bool:
    return isinstance(f, dict) and type(f.get("size")) is int and isinstance(f.get("sha256"), str)


def data_entry_problems(entry: Any) -> list[str]:
    """Everything wrong with the ``"data"`` entry of a parsed ``torchshard.json`` (None: no data state)."""
    if entry is None:
        return []
    files = entry.get("files") if isinstance(entry, dict) else None
    processes = entry.get("processes") if isinstance(entry, dict) else None
    names_ok = (
        isinstance(files, dict) and type(processes) is int and set(files) == set(map(data_file, range(processes)))
    )
    if names_ok and all(_file_entry(f) for f in files.values()):  # type: ignore[union-attr]
        return []
    return [f"data {entry!r:.80} is not a process count and each process's file with its size and sha256"]


def data_sizes(meta: dict[str, Any]) -> dict[str, int]:
    """Step-directory-relative file → size of the data state ``meta`` records."""
    entry = meta.get("data")
    return {name: f["size"] for name, f in entry["files"].items()} if entry else {}


def read_data(step_dir: pathlib.Path, meta: dict[str, Any]) -> Any:
    """This process's data state from ``step_dir``, checked against its size and sha256.

    Raises:
        CheckpointError: the step holds no data state, was saved by another number of processes,
            or this process's file is damaged; each names the checkpoint and the fix.
    """
    entry = meta.get("data")
    if not entry:
        raise CheckpointError(
            f"checkpoint {step_dir} holds no data state (it was saved without data=); load it without data= "
            f"(the data loader then starts from its beginning), or resume from a step saved with save(..., data=...)"
        )
    count, index = entry["processes"], jax.process_index()
    if count != jax.process_count():
        raise CheckpointError(
            f"checkpoint {step_dir} holds the data state of {count} process(es), this run has {jax.process_count()}; "
            f"each process's loader resumes its own state, so resume with {count} process(es), or load without "
            f"data= and position the loaders yourself"
        )
    name = data_file(index)
    raw = (step_dir / name).read_bytes()
    if hashlib.sha256(raw).hexdigest() != entry["files"][name]["sha256"]:
        raise CheckpointError(
            f"{step_dir / name}: checksum mismatch, the stored data state is not the one saved; load an earlier step"
        )
    try:
        return decode(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{step_dir / name} is malformed ({type(e).__name__}: {e}); load an earlier step") from e


def restore_data(data: Any, state: Any, step_dir: pathlib.Path) -> None:
    """Hands ``state`` to ``data.load_state_dict``; its failure is a `CheckpointError` naming the step."""
    try:
        data.load_state_dict(state)
    except Exception as e:
        fix = "the model and optimizer were not changed; load it into the kind of loader (or sampler) that saved it"
        why = f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"{type(data).__name__}.load_state_dict rejected the data state of {step_dir} ({why}); {fix}"
        ) from e


def snapshot_data(data: Any) -> bytes | None:
    """``data.state_dict()`` encoded now, so a background save holds the state of the moment it was called.

    Raises:
        CheckpointError: ``data.state_dict()`` raised (its exception is the cause); nothing was written.
    """
    if data is None:
        return None
    what = f"data={type(data).__name__}.state_dict()"
    try:
        state = data.state_dict()
    except Exception as e:  # the user's loader: said which call failed, as restore_data says for load_state_dict
        raise CheckpointError(f"{what} raised {type(e).__name__}: {e}; nothing was saved: fix the loader") from e
    return encode(state, what=what)
