"""The zero-bubble pipeline schedule: 1F1B with each backward cut in two and its weight half deferred.

A stage's backward is its input gradient ``B`` (the previous stage waits for it) and its weight
gradient ``W`` (nobody waits for it); `split_backward` cuts one from the other without computing
anything twice, from every stage's backward traced as the loop runs it. Tick ``t``: stage ``s``
runs the forward of micro-batch ``t - s`` and the ``B`` of ``t - (2S-2-s)``, as under 1F1B, and
the ``W`` of ``t - (2S-2)``: stage ``s`` defers its ``W`` by ``s`` ticks, keeping the ``B``'s
output cotangents (the *stash*) until then. In lockstep every stage runs every part of a tick,
so a part costs every stage a slot wherever one stage needs it.
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

from torchshard._strategies.pipeline import ticks as one_f_one_b
from torchshard._strategies.pipeline.split_backward import Split, split
from torchshard._strategies.pipeline.ticks import TickLoop, read_slot, write_slot


@dataclasses.dataclass(frozen=True)
class ZeroBubble(TickLoop):
    """1F1B's loop with the weight gradients deferred: four phases of ticks, the stash in a second ring."""

    @functools.cached_property
    def cut(self) -> tuple[Split, tuple[int | None, ...]]:
        """Every stage's backward (as the loop runs it, vmapped) cut at the input gradient, traced once from
        shapes; and each stashed array's stage dim (found by tracing again with twice the stages)."""
        with self.kernel.context():
            cut = split(self.backwards, *self.avals(self.spec.stages), at=self.at)
            twice = split(self.backwards, *self.avals(2 * self.spec.stages), at=self.at)
        dims = tuple(_grown(a.shape, b.shape) for a, b in zip(cut.stash_avals(), twice.stash_avals(), strict=True))
        return cut, dims

    def backwards(self, leaves: Any, g: jax.Array) -> Any:
        """Every stage's whole backward of one micro-batch each, from the residuals in the pullback's order."""
        bwd = lambda fixed, kept, g: self.kernel.stage_backward(self.res, fixed, kept, g)  # noqa: E731
        return self.kernel.vmapped(bwd, *self.res.split(leaves), g)

    def avals(self, stages: int) -> tuple[list[jax.ShapeDtypeStruct], jax.ShapeDtypeStruct]:
        lead = (stages, self.kernel.shards)
        leaves = [jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype) for a in self.res.avals]
        return leaves, jax.ShapeDtypeStruct((stages, *self.micro.shape[1:]), self.micro.dtype)

    @property
    def at(self) -> int:
        """The input gradient's leaf in `backwards`' output: after the weights' gradients."""
        return sum(1 for k in self.weights if k in self.kernel.trainable)

    @property
    def depth(self) -> int:
        """The stash ring's slots: stage ``s`` keeps ``s+1`` micro-batches' stash."""
        return self.spec.stages

    def initial(self) -> dict[str, Any]:
        carry = super().initial()
        cut, dims = self.cut
        carry["stash"] = [
            self.on_stages(jnp.zeros((self.spec.stages, self.depth, *_staged(a.shape, d)), a.dtype))
            for a, d in zip(cut.stash_avals(), dims, strict=True)
        ]
        return carry

    def ticks(self, carry: dict[str, Any]) -> dict[str, Any]:
        """Forwards (the fill), + input gradients, + weight gradients (from tick 2S-2, when stage 0 has its
        first), then no forwards (the drain): each part only in the ticks where some stage needs it."""
        s, m = self.spec.stages, self.spec.microbatches
        starts = (0, s - 1, 2 * s - 2, m + s - 1, m + 2 * s - 2)
        for start, stop in itertools.pairwise(starts):
            carry = self.phase(
                carry, start, stop, forward=start < m + s - 1, backward=start >= s - 1, weights=start >= 2 * s - 2
            )
        return carry

    def tick(self, carry: dict[str, Any], t: jax.Array, *, weights: bool = False, **flags: bool):
        carry, _ = super().tick(carry, t, **flags)
        if weights:
            carry = self.weight_gradients(carry, jnp.full(self.spec.stages, t - (2 * self.spec.stages - 2)))
        return carry, None

    def backward(self, carry: dict[str, Any], g: jax.Array, j: jax.Array) -> dict[str, Any]:
        """Stage s's input gradient of micro-batch ``j[s]``, handed back at once; its stash kept for the W."""
        (cut, dims), kept = self.cut, [read_slot(r, j % self.slots) for r in carry["ring"]]
        d_h, stash = cut.first(self.res.leaves(self.fixed, kept), g)
        valid = (j >= 0) & (j < self.spec.microbatches)
        carry["stash"] = [
            self.on_stages(write_slot(r, _to_front(x, d, self.spec.stages), j % self.depth, valid))
            for r, x, d in zip(carry["stash"], stash, dims, strict=True)
        ]
        return self.handed_back(carry, j, d_h)

    def weight_gradients(self, carry: dict[str, Any], j: jax.Array) -> dict[str, Any]:
        """Every stage's weight (and call-argument) gradients of micro-batch ``j[s]``, added up."""
        (cut, dims), kept = self.cut, [read_slot(r, j % self.slots) for r in carry["ring"]]
        stash = [_from_front(read_slot(r, j % self.depth), d) for r, d in zip(carry["stash"], dims, strict=True)]
        d_w, _, dsplit, dwhole = cut.second(self.res.leaves(self.fixed, kept), stash)
        return self.accumulated(carry, j, d_w, dsplit, dwhole)


def _grown(shape: tuple[int, ...], twice: tuple[int, ...]) -> int | None:
    """The dim of ``shape`` that doubles with the stages (None: the array is the same for every stage)."""
    grown = [i for i, (a, b) in enumerate(zip(shape, twice, strict=True)) if a != b]
    if not grown:
        return None
    if len(grown) > 1 or twice[grown[0]] != 2 * shape[grown[0]]:
        raise AssertionError(f"a stashed array {shape} has no one stage dim (with twice the stages: {twice})")
    return grown[0]


def _staged(shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    """A stashed array's shape without its stage dim."""
    return shape if dim is None else (*shape[:dim], *shape[dim + 1 :])


def _to_front(x: jax.Array, dim: int | None, stages: int) -> jax.Array:
    return jnp.broadcast_to(x, (stages, *x.shape)) if dim is None else jnp.moveaxis(x, dim, 0)


def _from_front(x: jax.Array, dim: int | None) -> jax.Array:
    return x[0] if dim is None else jnp.moveaxis(x, 0, dim)


# `one_f_one_b.run` under the zero-bubble schedule: the same arguments, the same result
run = functools.partial(one_f_one_b.run, loop=ZeroBubble)
