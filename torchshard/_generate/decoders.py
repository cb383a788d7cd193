"""What one decoding step runs: a transformers causal LM over a static KV cache, or any LM over a fixed window."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding

from torchshard._bridge.env import env
from torchshard._bridge.tensors import bound, unwrap, wrap
from torchshard._generate.decode_cache import KV, array_cache, cache_keyword, held

Arrays = dict[str, jax.Array]


def is_hf_causal_lm(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers model that generates (it has ``generate`` and a config)."""
    transformers = sys.modules.get("transformers")  # an HF model means transformers is already imported
    return transformers is not None and isinstance(model, transformers.GenerationMixin) and hasattr(model, "config")


def text_config(model: torch.nn.Module) -> Any:
    """A transformers model's (decoder) text config."""
    config: Any = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def max_positions(model: torch.nn.Module) -> int | None:
    """The positions a transformers model's config holds (``max_position_embeddings`` or ``n_positions``)."""
    text = text_config(model)
    for field in ("max_position_embeddings", "n_positions"):
        value = getattr(text, field, None)
        if isinstance(value, int):
            return value
    return None


@contextlib.contextmanager
def traced(model: torch.nn.Module, arrays: Mapping[str, jax.Array]) -> Iterator[None]:
    """Inside the block, ``model`` reads ``arrays`` (traced) and torch ops make jax tensors, in eval mode."""
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout off: decoding is inference
    try:
        with env(), torch.device("jax"), torch.no_grad(), bound(model, {k: wrap(v) for k, v in arrays.items()}):
            yield
    finally:
        for module, training in modes.items():
            module.training = training


def logits_of(out: Any) -> jax.Array:
    """A model output's logits [batch, seq, vocab] as a jax array (``out`` itself, or its ``.logits``).

    Raises:
        TypeError: the output holds no such tensor (the caller names the model).
    """
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        raise TypeError(
            f"the model returned {type(out).__name__}; generate needs logits [batch, seq, vocab] "
            f"(a tensor, or an output with .logits)"
        )
    return unwrap(logits)


@dataclasses.dataclass(frozen=True)
class Window:
    """Any causal LM mapping ids [B, T] to logits [B, T, V]: each step runs the whole fixed window of ids.

    Positions after the one read hold padding; a causal model's logits at a position do not see them.
    """

    model: torch.nn.Module
    prompt: int

    def _at(self, arrays: Arrays, tokens: jax.Array, at: jax.Array | int) -> jax.Array:
        with traced(self.model, arrays):
            logits = logits_of(self.model(wrap(tokens)))
        return jax.lax.dynamic_index_in_dim(logits, at, axis=1, keepdims=False)

    def prefill(self, arrays: Arrays, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, Any]:
        """Logits that choose the token after the prompt; no carry."""
        del mask
        return self._at(arrays, tokens, self.prompt - 1), ()

    def step(self, arrays: Arrays, carry: Any, tokens: jax.Array, mask: jax.Array, at: jax.Array):
        """Logits that choose the token after position ``at``."""
        del mask
        return self._at(arrays, tokens, at), carry


@dataclasses.dataclass(frozen=True)
class Cached:
    """A transformers causal LM over a KV cache of ``length`` positions: prefill once, then one token a step.

    ``tokens`` and ``mask`` span all ``length`` positions, the prompt's ``prompt`` first. ``kinds`` are
    the layers' cache kinds (`decode_cache.layer_kinds`): every attention layer, full or sliding,
    holds every position, and the model's mask picks each layer's window. The keys and values
    ([batch, kv heads, length, head dim]) are constrained to ``kv_sharding``. Positions follow
    transformers' ``generate``: the prompt's are its attention mask's running count (left padding
    gets 0), each new token's the last one's plus one.
    """

    model: torch.nn.Module
    prompt: int
    length: int
    kinds: tuple[str, ...]
    kv_sharding: NamedSharding | None = None

    def _kv(self, cache: Any) -> list[KV]:
        pin = (lambda a: jax.lax.with_sharding_constraint(a, self.kv_sharding)) if self.kv_sharding else (lambda a: a)
        return [None if kv is None else (pin(kv[0]), pin(kv[1])) for kv in held(cache)]

    def _forward(self, cache: Any, ids: jax.Array, mask: jax.Array, positions: jax.Array) -> Any:
        keyword = cache_keyword(self.model)  # transformers 5.24 renamed past_key_values to cache
        return self.model(
            input_ids=wrap(ids),
            attention_mask=wrap(mask),
            position_ids=wrap(positions),
            use_cache=True,
            **{keyword: cache},
        )

    def prefill(self, arrays: Arrays, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, Any]:
        """Logits that choose the first new token, and the carry: (keys and values, last prompt positions)."""
        prompt = mask[:, : self.prompt]
        positions = jnp.where(prompt == 0, 0, jnp.cumsum(prompt, axis=-1) - 1)
        with traced(self.model, arrays):
            cache = array_cache(self.kinds, self.length, jnp.int32(0))
            out = self._forward(cache, tokens[:, : self.prompt], mask, positions)
            kv = self._kv(cache)
        return logits_of(out)[:, -1], (kv, positions[:, -1])

    def step(self, arrays: Arrays, carry: Any, tokens: jax.Array, mask: jax.Array, at: jax.Array):
        """Logits that choose the token after position ``at`` (the cache holds positions before it)."""
        kv, last = carry
        token = jax.lax.dynamic_slice_in_dim(tokens, at, 1, axis=1)
        position = (last + (at - self.prompt + 1))[:, None]
        with traced(self.model, arrays):
            cache = array_cache(self.kinds, self.length, jnp.asarray(at, jnp.int32), kv)
            out = self._forward(cache, token, mask, position)
            kv = self._kv(cache)
        return logits_of(out)[:, -1], (kv, last)
