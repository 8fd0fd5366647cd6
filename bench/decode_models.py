"""The models of the decoding benchmark (bench/decode.py): a decoder of our own in the manner of
gpt-fast (Llama's shape: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; the KV cache
as buffers written in place with index_copy_, so a decode step's graph has fixed shapes and one
compile serves every position), and transformers' LlamaForCausalLM and Qwen2ForCausalLM built from
published configurations with random weights (nothing downloaded)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    rope_base: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self):
        return self.dim // self.heads


CONFIGS = {
    # Llama 3.2 1B's shape (16 layers, 32 query heads sharing 8 key/value heads)
    "llama1b": Config(dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, vocab=128256),
    # a 7B of Mistral 7B's / Llama 3 8B's shape with a 32000-token vocabulary
    "llama7b": Config(dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, vocab=32000, rope_base=10000.0),
    # what the tests and --quick on a CPU run
    "tiny": Config(dim=64, layers=2, heads=4, kv_heads=2, hidden=128, vocab=256),
}


def config(name, layers=None, quick=False):
    """CONFIGS[name], cut to `layers` layers; `quick`: a quarter of the width and layers (at most 4)."""
    cfg = CONFIGS[name]
    if quick and name != "tiny":
        cfg = replace(cfg, dim=cfg.dim // 4, hidden=cfg.hidden // 4, layers=min(cfg.layers, 4), vocab=32000)
    return replace(cfg, layers=layers) if layers else cfg


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class KVCache(nn.Module):
    """Keys and values of every position so far, [batch, kv_heads, max_len, head_dim], written in
    place at `pos` (the buffers never move: a CUDA graph replays reading them where they are)."""

    def __init__(self, batch, max_len, kv_heads, head_dim, dtype):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, pos, k, v):
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return self.k, self.v


def rotary_table(cfg: Config, max_len):
    """cos and sin of each position's rotation, [max_len, head_dim / 2, 2]."""
    freqs = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(max_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def rotate(x, table):
    """x [B, L, H, D] rotated by table [L, D / 2, 2] (pairs of adjacent features, as gpt-fast's)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    t = table.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * t[..., 0] - xs[..., 1] * t[..., 1],
                       xs[..., 1] * t[..., 0] + xs[..., 0] * t[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cache = None

    def forward(self, x, table, mask, pos):
        c = self.cfg
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = rotate(q.view(b, n, c.heads, c.head_dim), table).transpose(1, 2)
        k = rotate(k.view(b, n, c.kv_heads, c.head_dim), table).transpose(1, 2)
        k, v = self.cache.update(pos, k, v.view(b, n, c.kv_heads, c.head_dim).transpose(1, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, c.dim))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn, self.attn_norm = Attention(cfg), RMSNorm(cfg.dim, cfg.eps)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)

    def forward(self, x, table, mask, pos):
        h = x + self.attn(self.attn_norm(x), table, mask, pos)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Transformer(nn.Module):
    """forward(tokens [B, L], pos [L]: their positions) -> logits [B, L, vocab]; `setup_caches`
    first. A position attends to every cached position up to its own (the causal mask's row)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def setup_caches(self, batch, max_len):
        p = self.output.weight
        for layer in self.layers:
            layer.attn.cache = KVCache(batch, max_len, self.cfg.kv_heads, self.cfg.head_dim, p.dtype).to(p.device)
        self.register_buffer("rope", rotary_table(self.cfg, max_len).to(p.device), persistent=False)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool, device=p.device).tril(),
                             persistent=False)

    def forward(self, tokens, pos):
        mask = self.causal[None, None, pos]
        table = self.rope[pos]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, table, mask, pos)
        return self.output(self.norm(x))


def decode_one(model, token, pos):
    """One greedy decode step (what is compiled): the next token of each sequence, [B, 1]."""
    return model(token, pos)[:, -1].argmax(-1, keepdim=True)


def build_decoder(cfg: Config, batch, max_len, dtype, device, seed=0):
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    for p in model.parameters():  # small weights: logits of a random model stay finite in bf16
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)
    model = model.to(dtype).eval().requires_grad_(False)
    model.setup_caches(batch, max_len)
    return model


def weight_bytes(model, batch):
    """Bytes of weights a decode step must read: every parameter, of the embedding table only the
    `batch` rows it looks up."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.embed
    tied = emb.weight is (model.get_output_embeddings().weight if hasattr(model, "get_output_embeddings")
                          else model.output.weight)
    if not tied:  # (a tied table is read whole by the output projection)
        total -= emb.weight.numel() * emb.weight.element_size() - batch * emb.weight[0].numel() * emb.weight.element_size()
    return total


# -- transformers ---------------------------------------------------------------------------------

HF_CONFIGS = {
    # meta-llama/Llama-3.2-1B
    "hf-llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rms_norm_eps=1e-5, head_dim=64)),
    # Qwen/Qwen2.5-1.5B
    "hf-qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        rms_norm_eps=1e-6)),
}
HF_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=256, head_dim=16)


def build_hf(name, dtype, device, layers=None, quick=False, tiny=False, seed=0):
    """transformers' model of HF_CONFIGS[name] with random weights, in eval mode, on `device`."""
    import transformers as T
    model_cls, config_cls, kw = HF_CONFIGS[name]
    kw = dict(kw)
    if tiny:
        kw.update(HF_TINY)
    elif quick:
        kw.update(num_hidden_layers=min(4, kw["num_hidden_layers"]), vocab_size=32000)
    if layers:
        kw["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    cfg = getattr(T, config_cls)(**kw)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = getattr(T, model_cls)(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def cache_kwargs(model, cache) -> dict:
    """`cache` as the keyword `model`'s forward takes it: `cache` in transformers 5.2x,
    `past_key_values` before (5.17 takes `cache=` into **kwargs and decodes without it)."""
    import inspect
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def static_cache(model, max_len):
    """A transformers StaticCache for `model`: its tensors are allocated by the first (eager) call
    that writes them, the prefill, outside any compiled step."""
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_len)
