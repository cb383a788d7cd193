"""The KV cache decoding carries: each attention layer's keys and values over every position, written functionally."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchshard._bridge.tensors import unwrap, wrap

# a layer's kind: "full" and "sliding" layers hold keys and values; "none" layers have no attention
FULL, SLIDING, NONE = "full", "sliding", "none"
KV = tuple[jax.Array, jax.Array] | None


def cache_keyword(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its cache under: ``cache`` in transformers ≥ 5.24, else ``past_key_values``.

    transformers 5.24 renamed the argument and warns (``FutureWarning``) for the old name.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layer_kinds(model: torch.nn.Module) -> tuple[tuple[str, ...], list[str]]:
    """Each decoder layer's cache kind, as transformers' static cache for ``model``'s config lays it out,
    and why the model cannot be decoded over this cache exactly (empty when it can).

    Full attention and sliding windows (chunked attention too) hold every position here; the model's
    own attention mask does the windowing, so the result is transformers' for any window. Caches that
    hold other state (linear attention or convolution states, sparse-attention indexers, compressed
    keys, keys shared between layers) are refused: their updates are not ones this cache reproduces.
    """
    from transformers import StaticCache, cache_utils

    config: Any = model.config
    name = f"{type(model).__name__} ({getattr(config, 'model_type', '?')})"
    parameters = set(inspect.signature(model.forward).parameters)
    if not {"past_key_values", "cache"} & parameters:
        state = sorted(parameters & {"cache_params", "state", "mems"})  # mamba, rwkv, xlnet carry their own state
        kind = f"it carries a recurrent state of its own ({state[0]}=)" if state else "it keeps no KV cache"
        return (), [  # the decode step would feed one token with no state or keys and read garbage
            f"{name}: its forward takes no past_key_values ({kind}); generate decodes over full-attention and "
            f"sliding-window KV caches only, so it refuses this model"
        ]
    try:
        layers = StaticCache(config=config, max_cache_len=1).layers
    except Exception as err:  # any config transformers cannot lay a static cache out for
        return (), [
            f"{name}: transformers cannot lay out a static KV cache for its config ({type(err).__name__}: {err}); "
            f"generate decodes over full-attention and sliding-window caches only, so it refuses this model"
        ]
    kinds: dict[type, str] = {cache_utils.StaticLayer: FULL, cache_utils.StaticSlidingWindowLayer: SLIDING}
    # transformers < 5.23 has no DummyLayer: its static caches give every layer state (an "mlp" or "moe" layer a
    # linear-attention one, which is refused below) or leave KV-shared layers out, so no layer is "none" there
    if dummy := getattr(cache_utils, "DummyLayer", None):
        kinds[dummy] = NONE
    found = tuple(kinds.get(type(layer), type(layer).__name__) for layer in layers)
    others = sorted({k for k in found if k not in (FULL, SLIDING, NONE)})
    problems = []
    if others:
        problems.append(
            f"{name} keeps {', '.join(others)} state in its cache (layers "
            f"{[i for i, k in enumerate(found) if k in others][:8]}); generate decodes over full-attention and "
            f"sliding-window caches only, so it refuses this model rather than decode it differently"
        )
    text = config.get_text_config(decoder=True)
    # transformers < 5.23 has no kv_sharing_modes: it leaves the last num_kv_shared_layers out of the cache instead
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if (getattr(text, "kv_sharing_modes", None) and NONE in found) or shared > 0:
        problems.append(f"{name} shares keys and values between layers; generate does not decode such caches")
    return found, problems


@functools.cache
def _layer_class() -> type:
    from transformers.cache_utils import StaticLayer

    class ArrayLayer(StaticLayer):
        """A transformers cache layer over jax arrays of every position, written without in-place copies.

        transformers' sliding layers keep only the window, rolled and copied into a view in place,
        and branch on a Python count of the tokens seen; neither traces inside one compiled loop
        (torchax's ``copy_`` into a view fails). Keeping every position and reporting the whole
        cache to the mask makes the mask's sliding window (or chunk) pick the same keys.
        """

        def __init__(self, length: int, start: torch.Tensor, sliding: bool, kv: KV) -> None:
            super().__init__(max_cache_len=length)
            self.is_sliding = sliding
            self.cumulative_length = start
            if kv is not None:
                self._hold(*kv)

        def _hold(self, keys: jax.Array, values: jax.Array) -> None:
            self.keys, self.values = wrap(keys), wrap(values)
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.dtype, self.device = self.keys.dtype, self.keys.device
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            keys, values = unwrap(key_states), unwrap(value_states)
            zeros = lambda a: jnp.zeros((*a.shape[:2], self.max_cache_len, a.shape[-1]), a.dtype)  # noqa: E731
            self._hold(zeros(keys), zeros(values))

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start = unwrap(self.cumulative_length)
            write = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                unwrap(cache), unwrap(new).astype(unwrap(cache).dtype), start, axis=2
            )
            self._hold(write(self.keys, key_states), write(self.values, value_states))
            self.cumulative_length = wrap(start + key_states.shape[-2])
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0

        def get_seq_length(self) -> Any:
            return self.cumulative_length

    return ArrayLayer


def array_cache(kinds: tuple[str, ...], length: int, start: jax.Array, kv: list[KV] | None = None) -> Any:
    """A transformers ``Cache`` of ``length`` positions whose attention layers hold ``kv`` (None: empty), and
    whose next write is at position ``start``."""
    from transformers import cache_utils

    kv = kv if kv is not None else [None] * len(kinds)
    layer = _layer_class()
    layers = [
        cache_utils.DummyLayer() if kind == NONE else layer(length, wrap(start), kind == SLIDING, held)
        for kind, held in zip(kinds, kv, strict=True)
    ]
    return cache_utils.Cache(layers=layers)


def held(cache: Any) -> list[KV]:
    """Each layer's keys and values as jax arrays (None for a layer without attention)."""
    return [None if layer.keys is None else (unwrap(layer.keys), unwrap(layer.values)) for layer in cache.layers]
