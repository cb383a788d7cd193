"""Small torch models used across the tests (plain torch; nothing torchshard-specific)."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class MLP(nn.Module):
    """Linear stack with ReLU, as in the torchax tutorial (sizes scaled down)."""

    def __init__(self, sizes=(32, 64, 64, 16)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Block(nn.Module):
    """Pre-norm residual MLP block: LayerNorm, GELU, optional dropout, residual."""

    def __init__(self, dim=32, hidden=64, dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.dropout = dropout

    def forward(self, x):
        h = nn.functional.gelu(self.up(self.norm(x)))
        if self.dropout:
            h = nn.functional.dropout(h, self.dropout, self.training)
        return x + self.down(h)


class TiedLM(nn.Module):
    """Embedding → block → LayerNorm → head tied to the embedding; a registered position buffer."""

    def __init__(self, vocab=64, dim=32, seq=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, seq * dim).reshape(seq, dim))

    def forward(self, ids):
        h = self.embed(ids) + self.pos[: ids.shape[-1]]
        return self.head(self.norm(self.block(h)))


class BlockStack(nn.Module):
    """Embedding → a ModuleList of identical pre-norm blocks (dropout inside them optional) → LayerNorm → head."""

    def __init__(self, vocab=64, dim=32, depth=4, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, 2 * dim, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def tiny_llama(*, layers=2, seed=0, meta=False, **overrides):
    """A small transformers Llama built from a config (no download), KV cache off for training."""
    import transformers

    config = dict(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        use_cache=False,
    )
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(config | overrides)))


class Rotary(nn.Module):
    """A projection under torchtitan's rotary embedding: a complex ``freqs_cis`` buffer (persistent, as there)."""

    def __init__(self, dim=16, seq=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):  # [batch, seq, dim]
        h = self.proj(x)
        pairs = torch.view_as_complex(h.float().reshape(*h.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.freqs_cis[: x.shape[1]]).flatten(-2)


class FusedQKV(nn.Module):
    """Attention's projections fused into one Linear, exported as separate q/k/v weights by a state_dict hook
    (as checkpoint-conversion code does); ``private_hook`` uses torch's older ``_register_state_dict_hook``."""

    def __init__(self, dim=16, private_hook=False):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        hook = lambda *args: FusedQKV._split(*args)  # noqa: E731  # torch marks a function registered publicly
        (self._register_state_dict_hook if private_hook else self.register_state_dict_post_hook)(hook)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(prefix + "qkv.weight")
        for name, part in zip("qkv", fused.chunk(3), strict=True):
            state_dict[f"{prefix}{name}.weight"] = part * 1.0  # tensor math, not only a view

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class DictStack(nn.Module):
    """torchtitan's layout: the blocks in an ``nn.ModuleDict`` keyed "0".."N-1", run in insertion order."""

    def __init__(self, vocab=64, dim=32, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, 2 * dim) for i in range(depth)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h))


class RoutedBlock(Block):
    """A block gated by a router, as a mixture of experts routes its tokens."""

    def __init__(self, dim=32, experts=4):
        super().__init__(dim, 2 * dim)
        self.router = nn.Linear(dim, experts, bias=False)

    def forward(self, x):
        return super().forward(x * torch.sigmoid(self.router(x).mean(-1, keepdim=True)))


class RoutedStack(nn.Module):
    """Routed blocks whose router logits a forward hook collects into a list during ``forward``, which then
    adds a load-balancing aux loss: how transformers' MoE models (``output_router_logits=True``) do it."""

    def __init__(self, vocab=64, dim=32, depth=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(RoutedBlock(dim) for _ in range(depth))
        for block in self.blocks:
            block.router.register_forward_hook(lambda module, args, out: self._collected.append(out))
        self.head = nn.Linear(dim, vocab)
        self._collected: list[torch.Tensor] = []

    def forward(self, ids):
        self._collected = []
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        aux = sum(torch.softmax(logits, -1).mean((0, 1)).square().sum() for logits in self._collected)
        return self.head(h), aux


class Experts(nn.Module):
    """Experts stacked on dim 0, called with the router's choice: the interface expert dispatch needs."""

    count, dim, hidden = 8, 16, 32

    def __init__(self):
        super().__init__()
        self.num_experts = self.count
        self.up = nn.Parameter(torch.randn(self.count, self.hidden, self.dim) * self.dim**-0.5)
        self.down = nn.Parameter(torch.randn(self.count, self.dim, self.hidden) * self.hidden**-0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):  # every expert sees every row, weighted 0 where not chosen
            weight = (top_k_weights * (top_k_index == e)).sum(-1, keepdim=True)
            out = out + weight * (torch.relu(hidden_states @ self.up[e].T) @ self.down[e].T)
        return out


class MoE(nn.Module):
    """A top-2 softmax router over `Experts`, plain torch, residual."""

    top_k = 2

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(Experts.dim, Experts.count, bias=True)
        self.experts = Experts()

    def forward(self, x):
        flat = x.reshape(-1, Experts.dim)
        weights, index = torch.topk(torch.softmax(self.router(flat), -1), self.top_k, dim=-1)
        return x + self.experts(flat, index, weights / weights.sum(-1, keepdim=True)).reshape(x.shape)


class MoEStack(nn.Module):
    """A Linear, then a ModuleList of `MoE` layers (or a variant): float inputs [B, T, Experts.dim] in and out."""

    def __init__(self, layers: int = 2, moe: type[nn.Module] = MoE):
        super().__init__()
        self.embed = nn.Linear(Experts.dim, Experts.dim)
        self.layers = nn.ModuleList(moe() for _ in range(layers))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention (grouped K/V heads, through ``F.scaled_dot_product_attention``) and MLP."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def attention(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        h = x + self.attention(self.attn_norm(x))
        return h + self.down(nn.functional.gelu(self.up(self.mlp_norm(h))))


class TinyTransformer(nn.Module):
    """Token + learned position embeddings → a ModuleList of `AttentionBlock` → LayerNorm → head."""

    def __init__(self, vocab=64, dim=32, depth=2, seq=16):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(AttentionBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def kernel_llama():
    """The attention-kernel tests' tiny Llama (4 query heads over 2 KV heads, 64 positions), seed 0."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def ids_loss(m, ids):
    """A causal LM's own loss on token ids that are their own labels."""
    return m(input_ids=ids, labels=ids).loss


def kernel_batches():
    """Three [8, 32] batches of token ids under 128, seed 3."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (8, 32), generator=g) for _ in range(3)]
