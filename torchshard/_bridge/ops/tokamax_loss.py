"""tokamax's fused ``linear_softmax_cross_entropy_loss`` per token, and whether it can take a fused loss' call.

``Trainer(fused_loss="tokamax")`` asks for it; `choose` takes tokamax's implementations in its own
order (Mosaic TPU, chunked XLA), the first that takes the call and passes its probe
(`probes.probed`), else torchshard's own chunked loss (`CHUNKED`), with why. tokamax's ``xla``
implementation is never taken: it holds the whole [tokens, vocab] logits, which a fused loss exists
not to. tokamax's loss knows no ``ignore_index``: it is asked for each token's loss (``reduction=
"none"``), with ignored and out-of-range labels replaced by 0, and `linear_cross_entropy` masks and
reduces them as its own loop does (its nan edges included).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torchshard._bridge.ops import probes, tokamax_attention
from torchshard._bridge.ops.kernels import Choice, first_taken

IMPLEMENTATIONS = ("mosaic_tpu", "chunked_xla")  # tokamax's order, its logit-holding "xla" left out
CHUNKED = "chunked"  # torchshard's own chunked loss (`linear_cross_entropy.loss_jax`)
LANES = 128  # the chunked XLA loss' blocks are multiples of it
MAX_VOCAB_BLOCK, MAX_TOKEN_BLOCK = 2048, 1024  # tokamax's default blocks
TOKENS, WIDTH = 256, 128  # the tiny case's
TOLERANCE = {"float32": 2e-2, "bfloat16": 1e-1, "float16": 1e-1}  # loose: it catches garbage, not rounding

Probe = Callable[[str], str | None]  # ``tokamax:<implementation>`` -> why it failed its probe on this call, or None


@dataclasses.dataclass(frozen=True)
class LossCall:
    """One fused loss, known at trace time: ``tokens`` hidden states of ``width`` against a ``vocab``-row head."""

    site: str  # the LM head's name in the model
    tokens: int
    width: int
    vocab: int
    dtype: np.dtype


def blocks(tokens: int, vocab: int) -> tuple[int, int]:
    """The chunked XLA loss' (token block, vocabulary block): the vocabulary's block divides it.

    tokamax 0.0.17 pads the vocabulary to a whole number of blocks with zero weights, whose logits (0)
    then enter the softmax; a block that divides the vocabulary pads nothing.

    Examples:
        >>> blocks(16_384, 128_256), blocks(100, 32_000), blocks(5_000, 256)
        ((1024, 768), (128, 1280), (1024, 256))
    """
    lanes = vocab // LANES
    per = max(d for d in range(1, MAX_VOCAB_BLOCK // LANES + 1) if lanes % d == 0)
    return min(MAX_TOKEN_BLOCK, -(-tokens // LANES) * LANES), per * LANES


def _op(implementation: str, tokens: int, vocab: int) -> Any:
    # private to tokamax: its public function takes no block sizes, and its default ones pad the vocabulary
    from tokamax._src.ops.linear_softmax_cross_entropy_loss import api

    op = api.IMPLEMENTATIONS[implementation]
    if implementation == "chunked_xla":
        token_block, vocab_block = blocks(tokens, vocab)
        op = dataclasses.replace(op, config=op.config_cls(b_block_size=token_block, v_block_size=vocab_block))
    return op


def per_token(implementation: str, hidden: jax.Array, weight: jax.Array, labels: jax.Array) -> jax.Array:
    """Each token's ``logsumexp(hidden @ weight.T) − logit[label]`` by tokamax's ``implementation``, in float32.

    Args:
        implementation: one of `IMPLEMENTATIONS`.
        hidden: ``[tokens, width]``.
        weight: ``[vocab, width]``, as ``nn.Linear`` keeps it.
        labels: ``[tokens]``, each in ``[0, vocab)``.
    """
    op = _op(implementation, hidden.shape[0], weight.shape[0])
    return op(hidden, labels.astype(jnp.int32), weight.T, reduction="none").astype(jnp.float32)


def summed(implementation: str, hidden: jax.Array, weight: jax.Array, labels: jax.Array, ignore_index: int):
    """Σ of `per_token` over tokens whose label is not ``ignore_index`` (float32); the others add nothing, nor
    to any gradient. A label outside ``[0, vocab)`` is asked as 0 (the caller makes the loss nan)."""
    valid = labels != ignore_index
    asked = jnp.where(valid & (labels >= 0) & (labels < weight.shape[0]), labels, 0)
    return jnp.sum(jnp.where(valid, per_token(implementation, hidden, weight, asked), 0.0))


def _problem(implementation: str, call: LossCall, platform: str, devices: int) -> str | None:
    """Why tokamax's ``implementation`` cannot take the call, known before tracing it (tokamax says the rest)."""
    if implementation == "mosaic_tpu":
        if platform != "tpu":
            return f"a TPU kernel; this step runs on {platform}"
        if devices > 1:
            return f"a mesh of {devices} devices (a Pallas kernel runs per device; torchshard does not shard_map it)"
        return None
    if call.dtype != np.dtype(jnp.float32):
        return f"{call.dtype} inputs (its logits and per-token losses stay {call.dtype}; the fused loss' are float32)"
    if call.vocab % LANES:
        return f"a vocabulary of {call.vocab}, no multiple of {LANES} (the padding of its blocks enters the softmax)"
    return None


def choose(call: LossCall, platform: str, *, devices: int = 1, probe: Probe | None = None) -> Choice:
    """The loss ``call`` gets under ``fused_loss="tokamax"``, on ``platform`` and a mesh of ``devices``.

    Args:
        call: the fused loss' call.
        platform: where the step runs.
        devices: the mesh's size.
        probe: why ``tokamax:<implementation>`` failed its probe on this call, or None where it passed
            (`failure`); by default every implementation passes.

    Examples:
        >>> call = LossCall("lm_head", 256, 64, 50_257, np.dtype("float32"))
        >>> print(choose(call, "cpu", probe=lambda kernel: None))  # doctest: +ELLIPSIS
        chunked (tokamax: ...)
    """
    if (missing := tokamax_attention.missing()) is not None:
        return Choice(CHUNKED, f"tokamax: {missing}")
    probe = probe or (lambda kernel: None)
    found = first_taken(IMPLEMENTATIONS, lambda impl: _problem(impl, call, platform, devices), probe)
    return found if isinstance(found, Choice) else Choice(CHUNKED, found)


def failure(kernel: str, *, call: LossCall, platform: str) -> str | None:
    """Why ``kernel`` (``tokamax:<implementation>``) fails ``call`` on ``platform``, or None where it passes.

    Its forward and backward are traced at the call's shapes, then a tiny case (`TOKENS` tokens of
    `WIDTH`, the call's vocabulary and dtype, a quarter of the labels ignored) runs on the platform's
    first device against the plain float32 loss, values and gradients (`probes.probed`).
    """
    implementation = kernel.removeprefix("tokamax:")
    trace = functools.partial(_traces, implementation, call)
    tiny = functools.partial(_tiny, implementation, call)
    signature = (str(call.dtype), call.vocab)
    shapes = dataclasses.replace(call, site="")
    return probes.probed(kernel, shapes, trace, signature, platform, tiny, TOLERANCE.get(str(call.dtype), 1e-1))


Loss = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (hidden, weight, labels) -> the summed loss


def _traces(implementation: str, call: LossCall) -> None:
    hidden = jax.ShapeDtypeStruct((call.tokens, call.width), call.dtype)
    weight = jax.ShapeDtypeStruct((call.vocab, call.width), call.dtype)
    labels = jax.ShapeDtypeStruct((call.tokens,), jnp.int32)
    loss = functools.partial(summed, implementation, ignore_index=-100)
    jax.eval_shape(lambda h, w, y: jax.grad(loss, (0, 1))(h, w, y), hidden, weight, labels)


def plain(hidden: jax.Array, weight: jax.Array, labels: jax.Array, ignore_index: int = -100) -> jax.Array:
    """The tiny case's reference: the summed loss over valid tokens from the whole logits, in float32."""
    logits = hidden.astype(jnp.float32) @ weight.astype(jnp.float32).T
    picked = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(labels != ignore_index, jax.nn.logsumexp(logits, axis=1) - picked, 0.0))


def tiny_case(call: LossCall, device: jax.Device) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`TOKENS` hidden states of `WIDTH` against the call's vocabulary, in its dtype, a quarter of them ignored."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((TOKENS, WIDTH), dtype=np.float32)
    weight = rng.standard_normal((call.vocab, WIDTH), dtype=np.float32) / np.sqrt(WIDTH)
    labels = np.where(np.arange(TOKENS) % 4 == 3, -100, rng.integers(0, call.vocab, TOKENS))
    put = lambda x, dtype: jax.device_put(jnp.asarray(x, dtype), device)  # noqa: E731
    return put(hidden, call.dtype), put(weight, call.dtype), put(labels, jnp.int32)


def run_case(loss: Loss, inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Compiles and runs ``loss`` forward and backward on ``inputs``: the probe's runner (tests make it raise)."""
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(*inputs)


def _tiny(implementation: str, call: LossCall, device: jax.Device) -> list[float]:
    inputs = tiny_case(call, device)
    value, grads = run_case(functools.partial(summed, implementation, ignore_index=-100), inputs)
    want, want_grads = run_case(plain, inputs)
    return [probes.error(a, b) for a, b in zip((value, *grads), (want, *want_grads), strict=True)]
