"""A Llama train step written by hand in JAX: the baseline the Trainer's Llama step is measured against.

Same parameters (transformers' state_dict names, torch's ``[out, in]`` weights), shapes, loss
(shifted cross entropy, the last position ignored) and optax.adamw as torchshard's Trainer on
``transformers.LlamaForCausalLM``, in its best hand-written form: tokens flattened before each dot
(the weight-gradient dot then has one contracting dim), attention in ``[batch, heads, seq, dim]``.
"""

from __future__ import annotations

from typing import Any


def _rmsnorm(x, w, eps):
    import jax
    import jax.numpy as jnp

    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _linear(x, w):
    import jax

    y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (1,)), ((), ())))
    return y.reshape(*x.shape[:-1], w.shape[0])


def _rope(x, cos, sin):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _attention(q, k, v):
    """Causal attention on [batch, heads, seq, dim] (kv heads repeated to the query heads)."""
    import jax
    import jax.numpy as jnp

    s = q.shape[2]
    logits = jnp.einsum("bnqh,bnkh->bnqk", q * q.shape[-1] ** -0.5, k)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    return jnp.einsum("bnqk,bnkh->bnqh", jax.nn.softmax(logits, axis=-1), v)


def loss(params: dict[str, Any], ids, config) -> Any:
    """The causal LM loss of ``transformers.LlamaForCausalLM(config)`` with ``params`` on ``ids``."""
    import jax
    import jax.numpy as jnp
    import optax

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    b, s = ids.shape
    x = jnp.take(params["model.embed_tokens.weight"], ids, axis=0)
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], -1)
    cos, sin = jnp.cos(emb)[None, None], jnp.sin(emb)[None, None]
    eps = config.rms_norm_eps
    for i in range(config.num_hidden_layers):
        p = {k.removeprefix(f"model.layers.{i}."): v for k, v in params.items() if k.startswith(f"model.layers.{i}.")}
        h = _rmsnorm(x, p["input_layernorm.weight"], eps)
        q = _linear(h, p["self_attn.q_proj.weight"]).reshape(b, s, heads, dim).transpose(0, 2, 1, 3)
        k = _linear(h, p["self_attn.k_proj.weight"]).reshape(b, s, kv_heads, dim).transpose(0, 2, 1, 3)
        v = _linear(h, p["self_attn.v_proj.weight"]).reshape(b, s, kv_heads, dim).transpose(0, 2, 1, 3)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = jnp.repeat(k, heads // kv_heads, axis=1), jnp.repeat(v, heads // kv_heads, axis=1)
        a = _attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, s, heads * dim)
        x = x + _linear(a, p["self_attn.o_proj.weight"])
        h = _rmsnorm(x, p["post_attention_layernorm.weight"], eps)
        up = _linear(h, p["mlp.up_proj.weight"])
        x = x + _linear(jax.nn.silu(_linear(h, p["mlp.gate_proj.weight"])) * up, p["mlp.down_proj.weight"])
    logits = _linear(_rmsnorm(x, params["model.norm.weight"], eps), params["lm_head.weight"])
    labels = jnp.concatenate([ids[:, 1:], jnp.full((b, 1), -100, ids.dtype)], 1)
    valid = labels != -100
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.sum(ce * valid) / jnp.sum(valid)


def step_fn(trainer, optimizer, config):
    """A jitted, donated step with the Trainer's state shardings, and a copy of its state to run it on."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    shardings = trainer.state_shardings()

    def step(params, opt_state, ids):
        value, grads = jax.value_and_grad(loss)(params, ids, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return jax.tree.map(jnp.add, params, updates), opt_state, value

    out = (shardings.params, shardings.opt_state, NamedSharding(trainer.mesh, PartitionSpec()))
    jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=out)
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(trainer.state.params)
    return jitted, params, jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
