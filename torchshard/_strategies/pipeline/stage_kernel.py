"""What a pipeline tick runs on each stage: its layers' forward of a micro-batch and the backward from its residuals."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from torchshard._bridge.vmapped import vmapped_over
from torchshard._strategies.pipeline.loop import LayerFn, batch_axes
from torchshard._strategies.pipeline.residuals import Residuals
from torchshard._strategies.pipeline.stages import Stages


@dataclasses.dataclass(frozen=True)
class StageKernel:
    """One stage's chunk of layers on one micro-batch, as a tick runs it: the forward keeping its vjp residuals, the
    backward from them, each per shard of the batch axes with its own copy of the weights."""

    spec: Stages
    layer_fn: LayerFn
    trainable: frozenset[str]
    split_float: tuple[bool, ...]
    whole_float: tuple[bool, ...]
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    shards: int = 1  # copies of a stage's weights, one per shard of the batch axes (`loop.gathered_copies`)
    policy: Any = None  # remat of the blocks: what each layer keeps, the rest recomputed in the backward

    def stage(self, diff: Any, rest: Any) -> jax.Array:
        """One stage's chunk of layers on one micro-batch (its unbatched view): the output hidden state."""
        layers, h, dsplit, dwhole = diff
        fixed_layers, nsplit, nwhole, key = rest
        split, whole = _joined(dsplit, nsplit, self.split_float), _joined(dwhole, nwhole, self.whole_float)
        layer_fn = self.layer_fn
        if self.policy is not None:
            layer_fn = jax.checkpoint(layer_fn, policy=self.policy, prevent_cse=False)
        for layer, fixed in zip(layers, fixed_layers, strict=True):
            h, key = layer_fn({**layer, **fixed}, h, (*split, *whole), key)
        return h

    def inputs(
        self,
        weights: Mapping[str, jax.Array],
        h: jax.Array,
        split: Sequence[jax.Array],
        whole: Sequence[jax.Array],
        key: jax.Array,
    ) -> tuple[Any, Any]:
        """(diff, rest) of `stage` from one stage's weights ``[chunk, ...]`` and one micro-batch's arrays."""
        chunk = self.spec.chunk
        layers = [{k: w[i] for k, w in weights.items() if k in self.trainable} for i in range(chunk)]
        fixed = [{k: w[i] for k, w in weights.items() if k not in self.trainable} for i in range(chunk)]
        dsplit, nsplit = _parted(split, self.split_float)
        dwhole, nwhole = _parted(whole, self.whole_float)
        return (layers, h, dsplit, dwhole), (fixed, nsplit, nwhole, key)

    def forward(self, res: Residuals, weights: Any, h: jax.Array, split: Any, whole: Any, key: jax.Array):
        diff, rest = self.inputs(weights, h, split, whole, key)
        out, pull = jax.vjp(lambda d: self.stage(d, rest), diff)
        return out, res.split(jax.tree_util.tree_leaves(pull))[1]  # the micro-batch's own, to keep

    def vmapped(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self.context(), vmapped_over(self.spec.axis):
            return jax.vmap(fn, spmd_axis_name=self.spec.axis)(*args)

    def per_shard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn`` on each batch shard's rows with its own copy of the weights (inside `vmapped`): the weight
        gradient stays a partial sum per shard in the loop, reduced once after it."""
        if self.shards == 1:
            return jax.vmap(fn)(*args)
        axes = batch_axes(self.spec)
        with contextlib.ExitStack() as inside:
            for axis in axes:
                inside.enter_context(vmapped_over(axis))
            return jax.vmap(fn, spmd_axis_name=axes)(*args)

    def local(self, x: jax.Array) -> jax.Array:
        """A micro-batch's rows ``[mb, ...]`` as each shard's, ``[D, mb/D, ...]``."""
        return x.reshape(self.shards, x.shape[0] // self.shards, *x.shape[1:])

    def stage_forward(self, res: Residuals, weights: Any, h: jax.Array, split: Any, whole: Any, key: jax.Array):
        """One stage's forward of one micro-batch: (output, the residuals it keeps, ``[D, ...]``)."""
        keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(self.shards))
        one = lambda w, h, sp, k: self.forward(res, w, h, sp, whole, k)  # noqa: E731
        out, kept = self.per_shard(one, weights, self.local(h), [self.local(x) for x in split], keys)
        return _merge_shards(out), kept

    def pullbacks(self, weights: Any, h: jax.Array, split: Any, whole: Any, keys: jax.Array) -> Any:
        """Every stage's and shard's pullback of one micro-batch (leaves ``[S, D, ...]``), traced as the loop does."""

        def one_stage(w, h, sp, key):
            keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(self.shards))
            one = lambda w, h, sp, k: self.pullback(w, h, sp, whole, k)  # noqa: E731
            return self.per_shard(one, w, self.local(h), [self.local(x) for x in sp], keys)

        return self.vmapped(one_stage, weights, h, split, keys)

    def pullback(self, weights: Any, h: jax.Array, split: Any, whole: Any, key: jax.Array) -> Any:
        diff, rest = self.inputs(weights, h, split, whole, key)
        return jax.vjp(lambda d: self.stage(d, rest), diff)[1]

    def stage_backward(self, res: Residuals, fixed: Any, kept: Any, g: jax.Array):
        """One stage's backward of one micro-batch: (d weights ``[D, chunk, ...]``, d input, d split, d whole)."""
        layers, d_h, dsplit, dwhole = self.per_shard(
            lambda f, k, g: res.pullback(f, k)(g)[0], fixed, kept, self.local(g)
        )
        return _stacked(layers), _merge_shards(d_h), [_merge_shards(d) for d in dsplit], dwhole


def _stacked(layers: Sequence[Mapping[str, jax.Array]]) -> dict[str, jax.Array]:
    """The layers' weight gradients (each ``[D, ...]``) stacked by name: ``[D, chunk, ...]``."""
    return {k: jnp.stack([layer[k] for layer in layers], axis=1) for k in layers[0]} if layers else {}


def _merge_shards(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _parted(xs: Sequence[jax.Array], mask: Sequence[bool]) -> tuple[list[jax.Array], list[jax.Array]]:
    return [x for x, m in zip(xs, mask, strict=True) if m], [x for x, m in zip(xs, mask, strict=True) if not m]


def _joined(diff: Sequence[jax.Array], rest: Sequence[jax.Array], mask: Sequence[bool]) -> list[jax.Array]:
    d, r = iter(diff), iter(rest)
    return [next(d) if m else next(r) for m in mask]
