"""Which sequence positions each device of a context axis holds inside the ring kernel, and the zig-zag reorder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """Which sequence positions a device's local rows hold: ``parts`` runs of ``run`` consecutive positions.

    Natural: device ``i`` holds ``[i·run, (i+1)·run)``. Balanced (zig-zag): the sequence is cut into
    ``2n`` chunks and device ``i`` holds chunks ``i`` and ``2n-1-i``, so under a causal mask every
    device has the same number of visible (query, key) pairs.

    Examples:
        >>> [int(s) for s in SequenceLayout(seq=16, devices=4, balanced=True).starts(1)]
        [2, 12]
    """

    seq: int
    devices: int
    balanced: bool

    @property
    def parts(self) -> int:
        return 2 if self.balanced else 1

    @property
    def run(self) -> int:
        return self.seq // (self.devices * self.parts)

    def starts(self, device: jax.Array | int) -> tuple[jax.Array, ...]:
        """First position of each run of ``device`` (a traced index inside the shard_map)."""
        if self.balanced:
            return jnp.asarray(device * self.run), jnp.asarray((2 * self.devices - 1 - device) * self.run)
        return (jnp.asarray(device * self.run),)


def _zigzag_target(chunk: int, devices: int) -> int:
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def to_zigzag(x: jax.Array, axis: str, devices: int, dim: int, me: jax.Array) -> jax.Array:
    """Local rows in natural order (device ``i``: chunks ``2i, 2i+1``) → zig-zag (chunks ``i, 2n-1-i``).

    Chunk ``2i`` goes to device ``z(2i)`` and chunk ``2i+1`` to ``z(2i+1)``, ``z(c) = min(c, 2n-1-c)``;
    each device receives one even and one odd chunk, so two ppermutes move everything once.
    """
    even, odd = jnp.split(x, 2, axis=dim)
    even = jax.lax.ppermute(even, axis, [(i, _zigzag_target(2 * i, devices)) for i in range(devices)])
    odd = jax.lax.ppermute(odd, axis, [(i, _zigzag_target(2 * i + 1, devices)) for i in range(devices)])
    # device j holds chunk j first: the even one when j is even
    j_even = me % 2 == 0
    return jnp.concatenate([jnp.where(j_even, even, odd), jnp.where(j_even, odd, even)], axis=dim)


def from_zigzag(x: jax.Array, axis: str, devices: int, dim: int, me: jax.Array) -> jax.Array:
    """The inverse of `to_zigzag`."""
    first, second = jnp.split(x, 2, axis=dim)
    j_even = me % 2 == 0
    even, odd = jnp.where(j_even, first, second), jnp.where(j_even, second, first)
    even = jax.lax.ppermute(even, axis, [(_zigzag_target(2 * i, devices), i) for i in range(devices)])
    odd = jax.lax.ppermute(odd, axis, [(_zigzag_target(2 * i + 1, devices), i) for i in range(devices)])
    return jnp.concatenate([even, odd], axis=dim)
