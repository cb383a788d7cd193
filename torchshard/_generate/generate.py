"""Compiled decoding on the mesh: prefill, then one token per step, from a Trainer or a sharded module."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torchshard._base.errors import ArgumentError, raise_if_any
from torchshard._bridge.layer_view import LayerView
from torchshard._bridge.module_tensors import canonical_names, named_tensors
from torchshard._bridge.ops import kernels
from torchshard._bridge.tensors import is_jax_tensor, unwrap
from torchshard._generate.decoders import Cached, Window, is_hf_causal_lm, text_config
from torchshard._generate.generate_checks import (
    ACCEPTS,
    id_problems,
    kind_problems,
    length_problems,
    setting_problems,
    vocab_problems,
)
from torchshard._generate.sampling import Sampling, choose, finish
from torchshard._generate.untraceable import TRACING_ERRORS, untraceable_message
from torchshard._trainer.trainer import Trainer

Loop = Literal["fused", "stepped"]
# one jitted call runs prefill and every step in a lax.while_loop: measured faster than a compiled
# step called once per token (benchmarks/generate.py prints both; README "Evaluation and generation")
DEFAULT_LOOP: Loop = "fused"
_CACHE_SIZE = 8  # compiled programs kept per module (one per batch shape and setting)


@dataclasses.dataclass(frozen=True)
class Program:
    """Decoding ``new`` tokens after a ``prompt``-token prompt as pure functions of the module's arrays."""

    decoder: Cached | Window
    prompt: int
    new: int
    sampling: Sampling

    def first(self, arrays: dict[str, jax.Array], ids: jax.Array, mask: jax.Array, key: jax.Array):
        """Prefill and the first new token: (tokens [B, prompt + new], done [B], decoder carry)."""
        tokens = jnp.full((ids.shape[0], self.prompt + self.new), self.sampling.pad, jnp.int32)
        tokens = tokens.at[:, : self.prompt].set(ids)
        logits, carry = self.decoder.prefill(arrays, tokens, mask)
        done = jnp.zeros(ids.shape[0], jnp.bool_)
        token, done = finish(choose(logits, key, jnp.int32(0), self.sampling), done, self.sampling)
        return tokens.at[:, self.prompt].set(token), done, carry

    def next(self, arrays, tokens, done, carry, mask, key, index):
        """New token number ``index`` (from 0) of every row."""
        at = self.prompt + index - 1
        logits, carry = self.decoder.step(arrays, carry, tokens, mask, at)
        token, done = finish(choose(logits, key, index, self.sampling), done, self.sampling)
        return jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], at + 1, axis=1), done, carry

    def fused(self, arrays: dict[str, jax.Array], ids: jax.Array, mask: jax.Array, key: jax.Array):
        """Every token in one call: (tokens, how many new tokens were made before every row was done)."""
        tokens, done, carry = self.first(arrays, ids, mask, key)

        def body(state):
            index, tokens, done, carry = state
            return (index + 1, *self.next(arrays, tokens, done, carry, mask, key, index))

        keep_going = lambda state: (state[0] < self.new) & ~state[2].all()  # noqa: E731
        made, tokens, _, _ = jax.lax.while_loop(keep_going, body, (jnp.int32(1), tokens, done, carry))
        return tokens, made


def compiled_for(model: torch.nn.Module, key: Any, build: Callable[[], Any]) -> Any:
    """``build()``'s programs for ``model`` and ``key``, reused while at most `_CACHE_SIZE` others are newer."""
    # kept on the module: the programs hold the module, so a table keyed by it would keep it alive
    programs = model.__dict__.setdefault("_torchshard_generate", collections.OrderedDict())
    if key not in programs:
        programs[key] = build()
        while len(programs) > _CACHE_SIZE:
            programs.popitem(last=False)
    programs.move_to_end(key)
    return programs[key]


def _jitted(program: Program) -> dict[str, Any]:
    return {
        "fused": jax.jit(program.fused),
        "first": jax.jit(program.first),
        "next": jax.jit(program.next, donate_argnums=(1, 2, 3)),
    }


def _run(jitted: dict[str, Any], program: Program, loop: Loop, *args: Any) -> tuple[jax.Array, int]:
    arrays, _, mask, key = args
    if loop == "fused":
        tokens, made = jitted["fused"](*args)
        return tokens, int(made)
    tokens, done, carry = jitted["first"](*args)
    made = 1
    while made < program.new and not bool(done.all()):
        tokens, done, carry = jitted["next"](arrays, tokens, done, carry, mask, key, jnp.int32(made))
        made += 1
    return tokens, made


@dataclasses.dataclass(frozen=True)
class ResolvedTarget:
    """What `generate` and `score` run on: the module, the mesh its tensors are on, and the lock a Trainer holds."""

    model: torch.nn.Module
    mesh: Mesh | None
    lock: contextlib.AbstractContextManager[Any]


def resolve_target(target: Any) -> ResolvedTarget:
    """A Trainer's or a placed module's `ResolvedTarget`.

    Raises:
        ArgumentError: ``target`` is neither, or some of its tensors are not on the mesh (named).
    """
    if isinstance(target, Trainer):
        return ResolvedTarget(target.model, target.mesh, target.lock)
    if not isinstance(target, torch.nn.Module):
        raise ArgumentError(f"target is a {type(target).__name__}; pass a ts.Trainer or a module placed by ts.shard")
    tensors = named_tensors(target)
    unplaced = [n for n, t in tensors.items() if not is_jax_tensor(t)]
    if unplaced:
        raise ArgumentError(
            f"target: {len(unplaced)} tensor(s) are not on the mesh ({', '.join(unplaced[:3])}); place the module "
            f"with ts.shard(model, plan) first, or pass its Trainer"
        )
    meshes = [s.mesh for t in tensors.values() if isinstance(s := unwrap(t).sharding, NamedSharding)]
    mesh = meshes[0] if meshes and isinstance(meshes[0], Mesh) else None
    return ResolvedTarget(target, mesh, contextlib.nullcontext())


def _eos(model: torch.nn.Module, eos_token_id: Any) -> tuple[int, ...]:
    if eos_token_id is None:  # as transformers: the model's generation config says
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def _pad(model: torch.nn.Module, pad_token_id: int | None, eos: tuple[int, ...]) -> int:
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:  # transformers pads finished rows with the first eos token
        pad_token_id = eos[0] if eos else 0
    return int(pad_token_id)


def _kv_heads(model: torch.nn.Module) -> int | None:
    text = text_config(model)
    for field in ("num_key_value_heads", "num_attention_heads", "n_head"):
        value = getattr(text, field, None)
        if isinstance(value, int):
            return value
    return None


def _axes_size(mesh: Mesh, axes: Any) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in names)


def kv_sharding(model: torch.nn.Module, mesh: Mesh | None, rows: int) -> NamedSharding | None:
    """Keys and values [batch, kv heads, positions, dim] sharded like the key projection's heads, rows over the rest.

    The head axis is the one the plan put a ``k_proj`` weight's output dim on (``"model"`` under
    `presets.hf_rules`); the batch is split over the other mesh axes when its rows divide evenly.
    """
    if mesh is None:
        return None
    heads, kv = None, _kv_heads(model)
    for name, tensor in named_tensors(model).items():
        sharding = unwrap(tensor).sharding
        if name.endswith("k_proj.weight") and isinstance(sharding, NamedSharding) and len(sharding.spec):
            heads = sharding.spec[0]
            break
    if heads is None or kv is None or kv % _axes_size(mesh, heads) != 0:
        heads = None
    used = set(heads if isinstance(heads, tuple) else (heads,))
    rest = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    batch = rest if rest and rows % _axes_size(mesh, rest) == 0 else None
    return NamedSharding(mesh, PartitionSpec(batch, heads, None, None))


def _decoder(model: torch.nn.Module, mesh: Mesh | None, kinds: tuple[str, ...], rows: int, prompt: int, length: int):
    if kinds:
        return Cached(model, prompt, length, kinds, kv_sharding(model, mesh, rows))
    return Window(model, prompt)


def generate(
    target: Trainer | torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    seed: int = 0,
    pad_token_id: int | None = None,
    loop: Loop = DEFAULT_LOOP,
    attention_kernel: str = "auto",
) -> torch.Tensor:
    """Continues each prompt by ``max_new_tokens`` tokens, compiled on the mesh the model's tensors are on.

    A transformers causal LM decodes over a static KV cache whose keys and values are sharded like
    the attention heads: the prompt is prefilled once, then each step feeds one token. Full-attention,
    sliding-window and hybrid (both kinds of layer) caches are supported; caches holding other state
    (linear attention, sparse-attention indexers, compressed or shared keys) are refused. Any other
    module mapping ids [B, T] to logits [B, T, V] (a tensor, or an output with ``.logits``) reruns
    the whole window of ``T + max_new_tokens`` ids each step, which a causal model's earlier
    positions do not see past. Greedy output equals transformers'
    ``model.generate(do_sample=False)`` token for token. The model runs in eval mode.

    Args:
        target: a `Trainer` (its latest parameters; built without ``scan_layers`` or ``pipeline``)
            or a module placed by `shard`.
        input_ids: token ids [batch, seq], the same on every process.
        max_new_tokens: how many tokens to add to each row.
        temperature: 0 picks the most likely token; above 0 samples from softmax(logits / temperature).
        top_k: when sampling, only the ``top_k`` most likely tokens.
        top_p: when sampling, only the most likely tokens whose probabilities add up to ``top_p``.
        eos_token_id: a row stops after one of these tokens and is padded with ``pad_token_id``;
            None takes a transformers model's ``generation_config.eos_token_id``, ``[]`` never stops.
        attention_mask: 1 for tokens, 0 for left padding, shaped like ``input_ids`` (transformers models).
        seed: sampled tokens are the same for the same seed, prompt and settings.
        pad_token_id: fills rows after they stop; None takes the model's, else the first eos token.
        loop: ``"fused"`` runs every step in one jitted call; ``"stepped"`` calls one compiled step per token.
        attention_kernel: the prefill's and decode steps' attention kernel, as ``Trainer(attention_kernel=)``.

    Returns:
        A CPU int64 tensor [batch, seq + n]: the prompts and ``n ≤ max_new_tokens`` new tokens, fewer
        only when every row has stopped (as transformers returns).

    Raises:
        ArgumentError: names every bad argument: ``max_new_tokens`` ≤ 0, ids that are not an integer
            [batch, seq] tensor or lie outside the vocabulary, a prompt and ``max_new_tokens`` longer
            than the model's positions, a mask that is not left padding, a target not placed on a
            mesh, a model that is not a causal LM, whose cache is refused or whose output is not logits.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
        >>> model = ts.shard(model, ts.plan(model, ts.make_mesh({"data": 8})))
        >>> ts.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4).shape
        torch.Size([1, 7])
    """
    found, kinds, problems = _checked(target, input_ids, max_new_tokens, attention_mask)
    problems = setting_problems(max_new_tokens, temperature, top_k, top_p, eos_token_id, seed) + problems
    if loop not in ("fused", "stepped"):
        problems.append(f"loop={loop!r}: 'fused' or 'stepped'")
    problems += kernels.check_kernel(attention_kernel, what="attention_kernel")
    raise_if_any(problems, header=f"generate: {len(problems)} bad argument(s)", error=ArgumentError)
    assert found is not None  # a target that was not found is a problem raised above
    model, (rows, prompt) = found.model, tuple(input_ids.shape)
    eos = _eos(model, eos_token_id)
    sampling = Sampling(float(temperature), top_k, top_p, eos, _pad(model, pad_token_id, eos))
    length = prompt + max_new_tokens
    mask = torch.ones(rows, length, dtype=torch.int32)
    if attention_mask is not None:
        mask[:, :prompt] = attention_mask.detach().cpu().to(torch.int32)
    with found.lock, jax.set_mesh(found.mesh) if found.mesh is not None else contextlib.nullcontext():
        tensors = named_tensors(model)
        _refuse_stacked(tensors)
        canonical = canonical_names(model)
        arrays = {n: unwrap(t) for n, t in tensors.items() if canonical[n] == n}
        decoder = _decoder(model, found.mesh, kinds, rows, prompt, length)
        program = Program(decoder, prompt, max_new_tokens, sampling)
        jitted = compiled_for(model, (program, attention_kernel), lambda: _jitted(program))
        inputs = _placed(found.mesh, input_ids.detach().cpu().to(torch.int32).numpy(), mask.numpy(), seed)
        with kernels.choosing(_kernel_policy(attention_kernel, found.mesh)):
            tokens, made = _traced_run(model, not kinds, lambda: _run(jitted, program, loop, arrays, *inputs))
        out = np.asarray(jax.device_get(tokens))
    return torch.from_numpy(out[:, : prompt + made].astype(np.int64))


def _kernel_policy(requested: str, mesh: Mesh | None) -> kernels.Policy:
    if mesh is None:
        return kernels.Policy(requested, jax.default_backend())
    return kernels.Policy(requested, mesh.devices.flat[0].platform, mesh.devices.size)


def _checked(target: Any, input_ids: Any, new: Any, attention_mask: Any):
    """The target, its layers' cache kinds (none for a model decoded over a window) and every problem
    with it and its inputs."""
    problems = id_problems(input_ids, attention_mask)
    try:
        found = resolve_target(target)
    except ArgumentError as err:
        return None, (), [*problems, *err.problems]
    model = found.model
    kinds, refused = kind_problems(model)
    problems += refused
    if not id_problems(input_ids, None):  # an integer [batch, seq] tensor: its values can be checked
        problems += vocab_problems(model, input_ids)
        problems += length_problems(model, is_hf_causal_lm(model), int(input_ids.shape[1]), new, attention_mask)
    return found, kinds, problems


def _refuse_stacked(tensors: dict[str, torch.Tensor]) -> None:
    stacked = [n for n, t in tensors.items() if isinstance(t, LayerView)]
    if stacked:
        raise ArgumentError(
            f"generate: the module's layers are stacked by a Trainer built with scan_layers= or pipeline= "
            f"({stacked[0]}, ...); generate from a Trainer without them, or from a module placed by ts.shard"
        )


def _placed(mesh: Mesh | None, ids: np.ndarray, mask: np.ndarray, seed: int) -> tuple[jax.Array, ...]:
    key = jax.random.key_data(jax.random.key(seed))
    if mesh is None:
        return jnp.asarray(ids), jnp.asarray(mask), key
    replicated = NamedSharding(mesh, PartitionSpec())
    return tuple(jax.device_put(x, replicated) for x in (ids, mask, key))


def _traced_run(model: torch.nn.Module, windowed: bool, run: Callable[[], Any]) -> Any:
    """``run()``, with the errors tracing the model raises said as what to change.

    A module decoded over a window is only known to be an LM once it is called on token ids: what
    tracing it raises (before anything runs) says it is not one. A transformers causal LM is one:
    what it raises while traced names the construct in its code that generate cannot trace.
    """
    try:
        return run()
    except ArgumentError:
        raise
    except jax.errors.JaxRuntimeError:
        raise  # the device's, not the model's: running, not tracing, failed
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError, NotImplementedError) as err:
        if is_hf_causal_lm(model) and isinstance(err, TRACING_ERRORS):
            raise ArgumentError(untraceable_message(model, err)) from err
        if not windowed and not isinstance(err, TypeError):
            raise
        raise ArgumentError(
            f"generate could not decode with {type(model).__name__}: it is not a causal LM generate can decode "
            f"(called on token ids it raised {type(err).__name__}: {err}); {ACCEPTS}"
        ) from err
