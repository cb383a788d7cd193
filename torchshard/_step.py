"""The pure training step: bind arrays into the torch module, differentiate the loss, apply optax."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import torch
from jax.sharding import NamedSharding

from torchshard._errors import ShardingError
from torchshard._torchax import bound, env, is_jax_tensor, seeded, unwrap, wrap

LossFn = Callable[[torch.nn.Module, Any], Any]
Arrays = dict[str, jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes: trainable params, carried buffers, optimizer state, step."""

    params: Arrays
    buffers: Arrays
    opt_state: Any
    step: jax.Array


def state_shardings(opt_shapes: Any, params: Mapping[str, jax.Array], replicated: NamedSharding) -> Any:
    """Shards each optimizer-state leaf like the param it belongs to (same dict key and shape)."""

    def leaf_sharding(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> Any:
        for key in reversed(path):
            name = getattr(key, "key", None)
            if isinstance(name, str) and name in params and tuple(leaf.shape) == tuple(params[name].shape):
                return params[name].sharding
        return replicated

    return jax.tree_util.tree_map_with_path(leaf_sharding, opt_shapes)


def scalar_loss(loss: Any) -> jax.Array:
    """The loss ``loss_fn`` returned, as a scalar jax value."""
    value = unwrap(loss) if is_jax_tensor(loss) else jnp.asarray(loss)
    if value.shape != ():
        raise ShardingError(f"loss_fn must return a scalar loss tensor, got shape {tuple(value.shape)}.")
    return value


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Binds jax arrays into the torch module for one traced call and reads updated buffers back."""

    model: torch.nn.Module
    loss_fn: LossFn

    def loss(self, params: Arrays, buffers: Arrays, frozen: Arrays, batch: Any, key: jax.Array):
        """``loss_fn(model, batch)`` with the module bound to these arrays: (loss, (new buffers, aux))."""
        tx = env()
        # torch randomness (dropout) draws from torchax's key: give it this step's, for this trace only
        with seeded(key), tx:
            values = {k: wrap(v) for k, v in {**params, **frozen, **buffers}.items()}
            torch_batch = jax.tree.map(wrap, batch)
            with bound(self.model, values):
                out = self.loss_fn(self.model, torch_batch)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        new_buffers = {k: unwrap(values[k]) for k in buffers}
        aux = {k: unwrap(v) if is_jax_tensor(v) else jnp.asarray(v) for k, v in aux.items()}
        return scalar_loss(loss), (new_buffers, aux)


def micro_batches(batch: Any, k: int) -> Any:
    """[B, ...] → [k, B/k, ...] taking rows i, i+k, ...: each device keeps its own rows (no transfer)."""

    def split(x: jax.Array) -> jax.Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step as a pure function of (state, frozen params, batch, base key)."""

    runtime: Runtime
    optimizer: optax.GradientTransformation
    grad_accum_steps: int
    constrain_batch: Callable[[jax.Array], jax.Array]

    def grads(self, state: TrainState, frozen: Arrays, batch: Any, key: jax.Array):
        """(mean loss, mean grads, new buffers, mean aux) over ``grad_accum_steps`` micro-batches."""
        grad_fn = jax.value_and_grad(self.runtime.loss, has_aux=True)
        k = self.grad_accum_steps
        if k == 1:
            (loss, (buffers, aux)), grads = grad_fn(state.params, state.buffers, frozen, batch, key)
            return loss, grads, buffers, aux

        def micro(carry, xs):
            index, micro_batch = xs
            buffers, grad_sum, loss_sum = carry
            micro_batch = jax.tree.map(self.constrain_batch, micro_batch)
            micro_key = jax.random.fold_in(key, index)
            (loss, (buffers, aux)), grads = grad_fn(state.params, buffers, frozen, micro_batch, micro_key)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return (buffers, grad_sum, loss_sum + loss), aux

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        xs = (jnp.arange(k), micro_batches(batch, k))
        (buffers, grad_sum, loss_sum), aux = jax.lax.scan(micro, (state.buffers, zeros, 0.0), xs)
        aux = jax.tree.map(lambda a: a.mean(0), aux)
        return loss_sum / k, jax.tree.map(lambda g: g / k, grad_sum), buffers, aux

    def __call__(self, state: TrainState, frozen: Arrays, batch: Any, base_key: jax.Array):
        key = jax.random.fold_in(jax.random.wrap_key_data(base_key), state.step)
        loss, grads, buffers, aux = self.grads(state, frozen, batch, jax.random.key_data(key))
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return TrainState(params, buffers, opt_state, state.step + 1), metrics
