"""Each token's log-probability given the ones before it, on the mesh: one compiled forward per batch shape."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ArgumentError
from torchshard._bridge.layer_view import LayerView
from torchshard._bridge.module_tensors import canonical_names, named_tensors
from torchshard._bridge.tensors import unwrap, wrap
from torchshard._generate.decoders import logits_of, traced
from torchshard._generate.generate import compiled_for, kv_sharding, resolve_target
from torchshard._trainer.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Row ``ids`` [B, T + 1] → (log p(ids[:, t + 1] | ids[:, :t + 1]), whether it is the argmax), each [B, T]."""

    model: torch.nn.Module

    def __call__(self, arrays: dict[str, jax.Array], ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        inputs, targets = ids[:, :-1], ids[:, 1:]
        with traced(self.model, arrays):
            logits = logits_of(self.model(wrap(inputs))).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets


def batch_axes(model: torch.nn.Module, mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over: those the attention heads are not on (all, for other models)."""
    if mesh is None:
        return ()
    spec = kv_sharding(model, mesh, math.prod(mesh.shape.values())).spec  # type: ignore[union-attr]
    rows = spec[0]
    return () if rows is None else rows if isinstance(rows, tuple) else (rows,)


def stacked(target: Trainer | torch.nn.Module) -> list[str]:
    """Names of tensors a Trainer built with ``scan_layers=`` or ``pipeline=`` keeps stacked (`score` refuses them)."""
    return [n for n, t in named_tensors(resolve_target(target).model).items() if isinstance(t, LayerView)]


def row_multiple(target: Trainer | torch.nn.Module) -> int:
    """How many rows a batch of `score` must be a multiple of (the size of its `batch_axes`)."""
    found = resolve_target(target)
    axes = batch_axes(found.model, found.mesh)
    return math.prod(found.mesh.shape[a] for a in axes) if found.mesh is not None else 1


def score(target: Trainer | torch.nn.Module, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities (float32) and greedy flags of ``ids[:, 1:]``, each [B, T], from one compiled forward.

    ``ids`` is [B, T + 1] with B a multiple of `row_multiple`; the rows are split over `batch_axes`.
    A causal model's scores at a position do not depend on the ids after it, so rows may be right-padded.
    """
    found = resolve_target(target)
    model = found.model
    with found.lock, jax.set_mesh(found.mesh) if found.mesh is not None else contextlib.nullcontext():
        tensors = named_tensors(model)
        canonical = canonical_names(model)
        arrays = {n: unwrap(t) for n, t in tensors.items() if canonical[n] == n}
        placed = _placed(model, found.mesh, np.asarray(ids, np.int32))
        scoring = Scoring(model)
        jitted = compiled_for(model, scoring, lambda: jax.jit(scoring))
        try:
            picked, greedy = jitted(arrays, placed)
        except TypeError as err:
            raise ArgumentError(
                f"could not score with {type(model).__name__}: {err}; it needs a model mapping ids "
                f"[batch, seq] to logits [batch, seq, vocab]"
            ) from err
        return np.asarray(jax.device_get(picked)), np.asarray(jax.device_get(greedy))


def _placed(model: torch.nn.Module, mesh: Mesh | None, ids: np.ndarray) -> Any:
    if mesh is None:
        return jnp.asarray(ids)
    axes = batch_axes(model, mesh)
    return jax.device_put(ids, NamedSharding(mesh, PartitionSpec(axes or None, None)))
