"""Evaluation: the model's forward on the train state in eval mode, compiled once per batch shape, nothing donated."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import torch

from torchshard._base.validate import raise_for_arguments
from torchshard._bridge.captures import Captures, changed, recording
from torchshard._bridge.tensors import is_jax_tensor, unwrap
from torchshard._bridge.view_infos import materialised
from torchshard._train.state import Arrays, TrainState
from torchshard._train.step import LossFn, Runtime, loss_and_aux

logger = logging.getLogger("torchshard")
CACHE_SIZE = 8  # compiled evaluations kept per Trainer (batch shapes × functions), least recently used dropped


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block every module is in eval mode (dropout off, BatchNorm on its running statistics)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _outputs(out: Any) -> dict[str, jax.Array]:
    """What ``fn`` returned as named arrays: a tensor is ``"output"``, a dict keeps its names."""
    named = {k: materialised(v) for k, v in (out if isinstance(out, Mapping) else {"output": out}).items()}
    problems = [
        f"fn returned {type(v).__name__} for {k!r}; return a tensor computed from the model's output, or a dict of them"
        for k, v in named.items()
        if not is_jax_tensor(v)
    ]
    problems += [f"fn returned a key {k!r}; names must be strings" for k in named if not isinstance(k, str)]
    raise_for_arguments(problems, header="evaluate(batch, fn): fn(model, batch) must return a tensor or a dict")
    return {k: unwrap(v) for k, v in named.items()}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """``fn(model, batch)`` (or the loss) on a train state, as a pure function the Trainer jits."""

    runtime: Runtime
    fn: LossFn | None  # None: the runtime's loss_fn, reported as "loss" (and its metrics)

    def __call__(self, state: TrainState, frozen: Arrays, batch: Any, base_key: jax.Array) -> dict[str, jax.Array]:
        key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(base_key), state.step))
        fn = self.fn or self.runtime.loss_fn
        out, _, reported = self.runtime.run(fn, state.params, state.buffers, frozen, batch, key)
        if self.fn is not None:
            return _outputs(out) | reported
        loss, aux = loss_and_aux(out)
        return {"loss": loss, **aux, **reported}


def _signature(args: Any) -> tuple[Any, ...]:
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None)) for x in leaves)


class Compiled:
    """Compiled evaluations by function and argument shapes, at most ``CACHE_SIZE`` of them."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def __call__(self, fn: LossFn | None, *args: Any) -> dict[str, jax.Array]:
        key = (fn, _signature(args))
        if key in self._cache and (what := changed(self._cache[key][1])) is not None:
            logger.info("%s was written in place since the evaluation was traced: tracing it again", what)
            del self._cache[key]
        if key not in self._cache:
            captures: Captures = []
            fresh = functools.partial(Evaluation(self.runtime, fn).__call__)  # a new function: JAX traces it anew
            try:
                with recording(captures):
                    self._cache[key] = (jax.jit(fresh).lower(*args).compile(), captures)
            except Exception as err:
                # kept as it is (callers may catch their own errors), with a note of which call raised it
                if fn is not None:
                    err.add_note(f"(raised while Trainer.evaluate traced fn={getattr(fn, '__qualname__', fn)!s:.60})")
                raise
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key][0](*args)

    def __len__(self) -> int:
        return len(self._cache)


def structure_problems(seen: Any, batch: Any) -> list[str]:
    """How ``batch`` differs in structure, ranks or dtype kinds from the batches the Trainer has trained on."""
    if seen is None:
        return []
    tree, kinds = seen
    leaves, got = jax.tree.flatten(batch)
    if got != tree:
        return [f"the batch is a {got}, the training batches were a {tree}; pass the same structure"]
    problems = []
    for i, (leaf, (rank, kind)) in enumerate(zip(leaves, kinds, strict=True)):
        if np.ndim(leaf) != rank or _kind(leaf) != kind:
            dtype = str(getattr(leaf, "dtype", np.asarray(leaf).dtype)).removeprefix("torch.")
            problems.append(
                f"batch leaf #{i} is {dtype}{list(np.shape(leaf))}; the training batches' leaf #{i} had rank {rank} "
                f"and {_KINDS.get(kind, kind)} values: pass the same kind of data"
            )
    return problems


_KINDS = {"f": "floating", "i": "signed integer", "u": "unsigned integer", "b": "bool", "c": "complex"}


def structure(batch: Any) -> tuple[Any, tuple[tuple[int, str], ...]]:
    """The structure, ranks and dtype kinds `structure_problems` compares against."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((int(np.ndim(x)), _kind(x)) for x in leaves)


def _kind(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
            return "b" if dtype == torch.bool else "f" if dtype.is_floating_point else "c"
        return "i" if dtype.is_signed else "u"
    held = np.asarray(x).dtype if dtype is None else np.dtype(dtype)
    return "f" if jax.numpy.issubdtype(held, jax.numpy.floating) else held.kind  # bfloat16's numpy kind is "V"
