"""The zero-bubble pipeline schedule: 1F1B with each backward cut in two and its weight half deferred.

A stage's backward is its input gradient ``B`` (the previous stage waits for it) and its weight
gradient ``W`` (nobody waits for it); `split_backward` cuts one from the other without computing
anything twice. Tick ``t``: stage ``s`` runs the forward of micro-batch ``t - s`` and the ``B`` of
``t - (2S-2-s)``, as under 1F1B, and the ``W`` of ``t - (2S-2)``: stage ``s`` defers its ``W`` by
``s`` ticks, keeping the ``B``'s output cotangents (the *stash*) until then. In lockstep every
stage runs every part of a tick, so a part costs every stage a slot wherever one stage needs it.
The deferral lines the ``W`` up across stages: all stages have one to run in each of the ``M``
ticks that have a ``W`` part, so no ``W`` is a placeholder, where 1F1B's whole backward runs
``M+S-1`` times per stage. The forwards and input gradients keep their ``S-1`` placeholders each,
which no lockstep schedule of one chunk per stage avoids (the first micro-batch reaches stage ``s``
at tick ``s``; interleaved chunks would make each placeholder a chunk's work, not a stage's): the
wasted FLOPs are ``(S-1)(F+B)`` per stage against 1F1B's and gpipe's ``(S-1)(F+B+W)``, 2/3 of
theirs when the three cost alike (as a matmul's three products do).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp

from torchshard._base.errors import ShardingError
from torchshard._parallel import one_f_one_b
from torchshard._parallel.one_f_one_b import _Loop, _merge_shards, _read, _stacked, _write
from torchshard._parallel.split_backward import Split, split


@dataclasses.dataclass(frozen=True)
class ZeroBubble(_Loop):
    """1F1B's loop with the weight gradients deferred: four phases of ticks, the stash in a second ring."""

    @functools.cached_property
    def cut(self) -> Split:
        """One stage's pullback (one shard's rows) cut at the input gradient, traced once from shapes."""
        g = jax.ShapeDtypeStruct((self.micro.shape[1] // self.kernel.shards, *self.micro.shape[2:]), self.micro.dtype)
        pullback = lambda leaves, g: self.res.pullback(*self.res.split(leaves))(g)[0]  # noqa: E731
        with self.kernel.context():
            layers = jax.eval_shape(pullback, list(self.res.avals), g)[0]
            cut = split(pullback, self.res.avals, g, at=len(jax.tree.leaves(layers)))
        if cut.manual:
            raise ShardingError(
                "Pipeline(schedule='zero_bubble'): the pipelined layers run a shard_map of their own (ContextParallel "
                "attention, ExpertDispatch's all-to-all), whose backward the zero-bubble cut cannot defer in part; "
                "use schedule='1f1b'"
            )
        return cut

    @property
    def depth(self) -> int:
        """The stash ring's slots: stage ``s`` keeps ``s+1`` micro-batches' stash."""
        return self.spec.stages

    def initial(self) -> dict[str, Any]:
        carry = super().initial()
        s, d = self.spec.stages, self.kernel.shards
        carry["stash"] = [self.on_stages(jnp.zeros((s, self.depth, d, *a.shape), a.dtype), None, self.shard_dim)
                          for a in self.cut.stash_avals()]  # fmt: skip
        return carry

    def ticks(self, carry: dict[str, Any]) -> dict[str, Any]:
        """Forwards (the fill), + input gradients, + weight gradients (from tick 2S-2, when stage 0 has its
        first), then no forwards (the drain): each part only in the ticks where some stage needs it."""
        s, m = self.spec.stages, self.spec.microbatches
        starts = (0, s - 1, 2 * s - 2, m + s - 1, m + 2 * s - 2)
        for start, stop in itertools.pairwise(starts):
            carry = self.phase(carry, start, stop, forward=start < m + s - 1, backward=start >= s - 1,
                               weights=start >= 2 * s - 2)  # fmt: skip
        return carry

    def tick(self, carry: dict[str, Any], t: jax.Array, *, weights: bool = False, **flags: bool):
        carry, _ = super().tick(carry, t, **flags)
        if weights:
            carry = self.weight_gradients(carry, jnp.full(self.spec.stages, t - (2 * self.spec.stages - 2)))
        return carry, None

    def backward(self, carry: dict[str, Any], g: jax.Array, j: jax.Array) -> dict[str, Any]:
        """Stage s's input gradient of micro-batch ``j[s]``, handed back at once; its stash kept for the W."""
        kept = [_read(r, j % self.slots) for r in carry["ring"]]
        d_h, stash = self.kernel.vmapped(self.stage_first, self.fixed, kept, g)
        valid = (j >= 0) & (j < self.spec.microbatches)
        carry["stash"] = [self.on_stages(_write(r, x, j % self.depth, valid), None, self.shard_dim)
                          for r, x in zip(carry["stash"], stash, strict=True)]  # fmt: skip
        return self.handed_back(carry, j, d_h)

    def weight_gradients(self, carry: dict[str, Any], j: jax.Array) -> dict[str, Any]:
        """Every stage's weight (and call-argument) gradients of micro-batch ``j[s]``, added up."""
        kept = [_read(r, j % self.slots) for r in carry["ring"]]
        stash = [_read(r, j % self.depth) for r in carry["stash"]]
        d_w, dsplit, dwhole = self.kernel.vmapped(self.stage_second, self.fixed, kept, stash)
        return self.accumulated(carry, j, d_w, dsplit, dwhole)

    def stage_first(self, fixed: Any, kept: Any, g: jax.Array) -> tuple[jax.Array, Any]:
        """One stage's input gradient of one micro-batch (its rows merged) and its stash ``[D, ...]``."""
        first = lambda f, k, g: self.cut.first(self.res.leaves(f, k), g)  # noqa: E731
        d_h, stash = self.kernel.per_shard(first, fixed, kept, self.kernel.local(g))
        return _merge_shards(d_h), stash

    def stage_second(self, fixed: Any, kept: Any, stash: Any):
        """One stage's deferred half: (d weights ``[D, chunk, ...]``, d split, d whole)."""
        second = lambda f, k, st: self.cut.second(self.res.leaves(f, k), st)  # noqa: E731
        layers, _, dsplit, dwhole = self.kernel.per_shard(second, fixed, kept, stash)
        return _stacked(layers), [_merge_shards(d) for d in dsplit], dwhole


# `one_f_one_b.run` under the zero-bubble schedule: the same arguments, the same result
run = functools.partial(one_f_one_b.run, loop=ZeroBubble)
