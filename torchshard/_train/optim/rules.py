"""How each supported torch optimizer steps one parameter, in torch's order of operations (its single-tensor path).

Every rule is a pure function of the gradient, the parameter, torch's per-parameter state (under torch's field
names: ``exp_avg``, ``momentum_buffer``, ``step``...) and the group's hyperparameters as traced scalars, so a
scheduler's new values reach the compiled step without recompiling it. ``step`` is a float32 scalar as torch keeps
it; SGD keeps one too (torch's has none) to tell its first step, which starts the momentum buffer from the gradient.
Values are computed in float32 and cast back to the parameter's and the state's own dtypes by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

Shape = tuple[int, ...]
Slots = dict[str, jax.Array]
Hyper = Mapping[str, jax.Array]
Flags = Mapping[str, bool]
Update = Callable[[jax.Array, jax.Array, Slots, Hyper, Flags, tuple[int, ...]], tuple[jax.Array, Slots]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One torch optimizer class: what it reads from a param group, the state it keeps, and its update.

    Attributes:
        hyper: hyperparameter name → (param-group key, index into a tuple value such as ``betas``, or None):
            the values read from every group before each step.
        flags: the group's choices that change the program (``amsgrad``, ``nesterov``...), read from a group.
        fields: torch's state fields of a parameter and their shapes, from its flags, shape and per-layer axes.
        update: ``(grad, param, state, hyper, flags, layer axes) -> (param delta, new state)``.
        fills: state field → the optimizer default its fresh state is filled with (Adagrad's ``sum``).
        hidden: fields the translation keeps that torch's ``optimizer.state`` does not (SGD's ``step``).
    """

    hyper: Mapping[str, tuple[str, int | None]]
    flags: Callable[[Mapping[str, Any]], dict[str, bool]]
    fields: Callable[[Flags, Shape, tuple[int, ...]], dict[str, Shape]]
    update: Update
    fills: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hidden: frozenset[str] = frozenset()


def lerp(start: jax.Array, end: jax.Array, weight: jax.Array) -> jax.Array:
    """``torch.lerp`` as its CPU kernel computes it: from the nearer end, split at weight 0.5."""
    small = jnp.abs(weight) < 0.5
    return jnp.where(small, start + weight * (end - start), end - (end - start) * (1 - weight))


def _signed(grad: jax.Array, flags: Flags) -> jax.Array:
    return -grad if flags["maximize"] else grad


def _sgd(g: jax.Array, p: jax.Array, s: Slots, h: Hyper, f: Flags, axes: tuple[int, ...]):
    g = _signed(g, f) + h["weight_decay"] * p  # torch adds it only when non-zero: adding 0 * p is the same
    new = {"step": s["step"] + 1}
    if f["momentum"]:
        moved = s["momentum_buffer"] * h["momentum"] + (1 - h["dampening"]) * g
        buf = new["momentum_buffer"] = jnp.where(s["step"] == 0, g, moved)  # the first step clones the gradient
        g = g + h["momentum"] * buf if f["nesterov"] else buf
    return -h["lr"] * g, new


def _adam(g: jax.Array, p: jax.Array, s: Slots, h: Hyper, f: Flags, axes: tuple[int, ...]):
    step = s["step"] + 1
    g, lr, decay = _signed(g, f), h["lr"], h["weight_decay"]
    if not f["decoupled"]:
        g = g + decay * p
    exp_avg = lerp(s["exp_avg"], g, 1 - h["beta1"])
    exp_avg_sq = s["exp_avg_sq"] * h["beta2"] + (1 - h["beta2"]) * g * g
    new = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if f["amsgrad"]:
        second = new["max_exp_avg_sq"] = jnp.maximum(s["max_exp_avg_sq"], exp_avg_sq)
    denom = jnp.sqrt(second) / jnp.sqrt(1 - h["beta2"] ** step) + h["eps"]
    delta = -(lr / (1 - h["beta1"] ** step)) * (exp_avg / denom)
    return (delta - (lr * decay) * p if f["decoupled"] else delta), new


def _adagrad(g: jax.Array, p: jax.Array, s: Slots, h: Hyper, f: Flags, axes: tuple[int, ...]):
    step = s["step"] + 1
    g = _signed(g, f) + h["weight_decay"] * p
    total = s["sum"] + g * g
    clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
    return -clr * (g / (jnp.sqrt(total) + h["eps"])), {"step": step, "sum": total}


def _rmsprop(g: jax.Array, p: jax.Array, s: Slots, h: Hyper, f: Flags, axes: tuple[int, ...]):
    g, alpha = _signed(g, f) + h["weight_decay"] * p, h["alpha"]
    square_avg = s["square_avg"] * alpha + (1 - alpha) * g * g
    new = {"step": s["step"] + 1, "square_avg": square_avg}
    if f["centered"]:
        grad_avg = new["grad_avg"] = lerp(s["grad_avg"], g, 1 - alpha)
        avg = jnp.sqrt(square_avg - grad_avg * grad_avg) + h["eps"]
    else:
        avg = jnp.sqrt(square_avg) + h["eps"]  # torch adds eps outside the root; optax.rmsprop inside
    if f["momentum"]:
        buf = new["momentum_buffer"] = s["momentum_buffer"] * h["momentum"] + g / avg
        return -h["lr"] * buf, new
    return -h["lr"] * (g / avg), new


def _rms(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Root mean square over one layer's axes (all of them; a scanned stack's dim 0 is its layers)."""
    size = 1
    for axis in axes:
        size *= x.shape[axis]
    return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=True)) / jnp.sqrt(jnp.float32(size))


def _adafactor(g: jax.Array, p: jax.Array, s: Slots, h: Hyper, f: Flags, axes: tuple[int, ...]):
    step = s["step"] + 1
    g = _signed(g, f)
    eps1 = h["dtype_eps"] if f["eps1_none"] else h["eps1"]
    weight = step ** h["beta2_decay"]
    alpha = jnp.maximum(h["eps2"], _rms(p, axes)) * jnp.minimum(h["lr"], 1 / jnp.sqrt(step))
    new = {"step": step}
    if len(axes) > 1:  # factored over the layer's last two dims, as torch keeps it
        row = new["row_var"] = lerp(s["row_var"], jnp.mean(g * g, axis=-1, keepdims=True), weight)
        col = new["col_var"] = lerp(s["col_var"], jnp.mean(g * g, axis=-2, keepdims=True), weight)
        var = (row @ col) / jnp.maximum(jnp.mean(row, axis=-2, keepdims=True), eps1)
    else:
        var = new["variance"] = lerp(s["variance"], g * g, weight)
    update = jax.lax.rsqrt(jnp.maximum(var, eps1 * eps1)) * g
    scale = alpha / jnp.maximum(1.0, _rms(update, axes) / h["d"])
    return -(h["lr"] * h["weight_decay"]) * p - scale * update, new


def _sgd_fields(f: Flags, shape: Shape, axes: tuple[int, ...]) -> dict[str, Shape]:
    return {"step": (), **({"momentum_buffer": shape} if f["momentum"] else {})}


def _adam_fields(f: Flags, shape: Shape, axes: tuple[int, ...]) -> dict[str, Shape]:
    return {"step": (), "exp_avg": shape, "exp_avg_sq": shape, **({"max_exp_avg_sq": shape} if f["amsgrad"] else {})}


def _rmsprop_fields(f: Flags, shape: Shape, axes: tuple[int, ...]) -> dict[str, Shape]:
    fields = {"step": (), "square_avg": shape}
    fields |= {"momentum_buffer": shape} if f["momentum"] else {}
    return fields | ({"grad_avg": shape} if f["centered"] else {})


def _adafactor_fields(f: Flags, shape: Shape, axes: tuple[int, ...]) -> dict[str, Shape]:
    if len(axes) > 1:
        return {"step": (), "row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
    return {"step": (), "variance": shape}


def _flags(*names: str, **defaults: bool) -> Callable[[Mapping[str, Any]], dict[str, bool]]:
    def read(group: Mapping[str, Any]) -> dict[str, bool]:
        return {n: bool(group.get(n, defaults.get(n, False))) for n in names}

    return read


def _with(read: Callable[[Mapping[str, Any]], dict[str, bool]], **derived: Callable[[Any], bool]):
    def both(group: Mapping[str, Any]) -> dict[str, bool]:
        return read(group) | {name: how(group) for name, how in derived.items()}

    return both


def _adam_rule(decoupled: bool) -> Rule:
    hyper = {"lr": ("lr", None), "beta1": ("betas", 0), "beta2": ("betas", 1), "eps": ("eps", None)}
    flags = _flags("maximize", "amsgrad", decoupled_weight_decay=decoupled)
    read = _with(flags, decoupled=lambda g: bool(g.get("decoupled_weight_decay", decoupled)))
    return Rule(hyper | {"weight_decay": ("weight_decay", None)}, read, _adam_fields, _adam)


RULES: dict[str, Rule] = {
    "SGD": Rule(
        {k: (k, None) for k in ("lr", "momentum", "dampening", "weight_decay")},
        _with(_flags("maximize", "nesterov"), momentum=lambda g: float(g["momentum"]) != 0),
        _sgd_fields,
        _sgd,
        hidden=frozenset({"step"}),
    ),
    "Adam": _adam_rule(decoupled=False),
    "AdamW": _adam_rule(decoupled=True),
    "Adagrad": Rule(
        {k: (k, None) for k in ("lr", "lr_decay", "weight_decay", "eps")},
        _flags("maximize"),
        lambda f, shape, axes: {"step": (), "sum": shape},
        _adagrad,
        fills={"sum": "initial_accumulator_value"},
    ),
    "RMSprop": Rule(
        {k: (k, None) for k in ("lr", "alpha", "eps", "weight_decay", "momentum")},
        _with(_flags("maximize", "centered"), momentum=lambda g: float(g["momentum"]) > 0),
        _rmsprop_fields,
        _rmsprop,
    ),
    "Adafactor": Rule(
        {
            "lr": ("lr", None),
            "beta2_decay": ("beta2_decay", None),
            "eps1": ("eps", 0),
            "eps2": ("eps", 1),
            "d": ("d", None),
            "weight_decay": ("weight_decay", None),
        },
        _with(_flags("maximize"), eps1_none=lambda g: g["eps"][0] is None),
        _adafactor_fields,
        _adafactor,
    ),
}
