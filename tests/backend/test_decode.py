"""Decoding with a KV cache (bench/decode_models.py): a decode step is one graph for every position
(fresh position tensors, no recompile), writes the cache in place, and equals eager's; transformers'
Llama with a StaticCache likewise. Each layer's K and V cache writes are one kernel that computes
k's RoPE too (lower/rules.py `_index_copy_`), not ATen's index_copy_ after a RoPE kernel."""
from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F

import fuselens
from fl_backend_testing import DEVICE, SDPA, tolerance  # (first: it puts bench/ on the path)
from decode_models import build_decoder, build_hf, cache_kwargs, config, decode_one, static_cache  # noqa: I001

PROMPT, STEPS, BATCH = 5, 4, 2


def strict(fn, *args, **kwargs):
    """fn(...) with any fallback to eager an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        return fn(*args, **kwargs)


def one_graph(cf):
    entries = fuselens.inspect(cf)
    assert [len(e.graphs) for e in entries] == [1] and entries[0].graph_break is None, entries


def cache_writes_fused(step, layers):
    """A decode step's wrapper writes each layer's K and V caches in one kernel with what it stores
    (k's RoPE): no extern call writes them (ATen's index_copy_ was called as `consts[i](cache, ...)`),
    and the writing kernel reads no buffer another kernel made (a RoPE result stored first)."""
    wrapper = fuselens.inspect(step)[0].graphs[0].wrapper
    assert "consts[" not in wrapper
    caches = dict(re.findall(r"^ +(buf\d+) = (arg\d+)  # written in place", wrapper, re.M))
    assert len(caches) == 2 * layers
    made_by_kernels = set(re.findall(r"^ +(buf\d+) = (?:empty\(|buf\d+\b)", wrapper, re.M))
    launches = [line.split("  #")[0] for line in wrapper.splitlines() if ".launch(" in line]
    writes = [line for line in launches if set(re.findall(r"\bbuf\d+\b", line)) & set(caches)]
    assert len(writes) == layers and all("_mul_" in line for line in writes), writes  # (RoPE's products)
    for line in writes:
        assert set(re.findall(r"\bbuf\d+\b", line)) & made_by_kernels == set(), line
        assert len(set(re.findall(r"\bbuf\d+\b", line)) & set(caches)) == 2, line  # K and V together


def test_decode_steps_equal_eager_and_write_the_cache_in_place():
    cfg = config("tiny")
    compiled_model, eager_model = (build_decoder(cfg, BATCH, PROMPT + STEPS, torch.float32, DEVICE) for _ in range(2))
    caches = [layer.attn.cache for layer in compiled_model.layers]
    where = [(c.k.data_ptr(), c.v.data_ptr()) for c in caches]
    prompt = torch.randint(0, cfg.vocab, (BATCH, PROMPT), device=DEVICE)
    step = fuselens.compile(compiled_model, dynamic=False)
    with torch.no_grad():
        tok = decode_one(compiled_model, prompt, torch.arange(PROMPT, device=DEVICE))
        decode_one(eager_model, prompt, torch.arange(PROMPT, device=DEVICE))
        for i in range(STEPS - 1):
            pos = torch.tensor([PROMPT + i], device=DEVICE)  # a fresh tensor each step, as a decode loop makes
            logits = strict(step, tok, pos)
            torch.testing.assert_close(logits, eager_model(tok, pos.clone()), **tolerance(torch.float32))
            tok = logits[:, -1:].argmax(-1)
    for c, e, (k, v) in zip(caches, (layer.attn.cache for layer in eager_model.layers), where):
        assert (c.k.data_ptr(), c.v.data_ptr()) == (k, v)  # written in place: the buffers never moved
        torch.testing.assert_close(c.k, e.k, **tolerance(torch.float32))
        torch.testing.assert_close(c.v, e.v, **tolerance(torch.float32))
    assert c.k[:, :, PROMPT + STEPS - 2].abs().sum() > 0  # (the last step's keys are there)
    one_graph(step)
    cache_writes_fused(step, cfg.layers)
    # grouped-query attention reads the cache's buffers themselves (no repeat of K and V)
    sdpa = [line for line in fuselens.inspect(step)[0].graphs[0].wrapper.splitlines() if re.search(SDPA, line)]
    assert len(sdpa) == cfg.layers and all("attn_mask" in line for line in sdpa)
    assert not [k.name for k in fuselens.inspect(step)[0].kernels if "expand" in k.name]


def test_hf_llama_static_cache_decodes_as_eager():
    model = build_hf("hf-llama", torch.float32, DEVICE, tiny=True)
    prompt = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), device=DEVICE)

    def decode(forward):
        cache = static_cache(model, PROMPT + STEPS)
        with torch.no_grad():
            tok = model(input_ids=prompt, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
            out = [tok]
            for i in range(STEPS - 1):
                pos = torch.full((BATCH, 1), PROMPT + i, device=DEVICE)
                tok = strict(forward, input_ids=tok, **cache_kwargs(model, cache), position_ids=pos).logits[:, -1:].argmax(-1)
                out.append(tok)
        return torch.cat(out, 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        expected = decode(model.forward)
        cf = fuselens.compile(model.forward, dynamic=False)
        got = decode(cf)
    assert torch.equal(got, expected)
    one_graph(cf)
    cache_writes_fused(cf, model.config.num_hidden_layers)


def test_a_one_row_product_with_a_looked_up_residual_in_its_epilogue():
    """A decoder's first layer: the residual is the token's embedding row (a position read from a
    tensor, the same for the whole block), added after the one-row product's reduction. The looked-
    up value is a column of the block ([XBLOCK, 1]), as the reduction's result is: Qwen2's decode
    step had broadcast it to the whole tile and its store failed (the graph ran eagerly)."""
    gen = torch.Generator().manual_seed(0)
    dim, vocab = 256, 1000
    emb, w = torch.randn(vocab, dim, generator=gen), torch.randn(dim, dim, generator=gen) / dim ** 0.5
    x = torch.randn(1, dim, generator=gen)
    emb, w, x = (t.to(DEVICE, torch.bfloat16) for t in (emb, w, x))
    ids = torch.tensor([[7]], device=DEVICE)
    fn = lambda ids, emb, w, x: F.embedding(ids, emb)[0] + F.linear(x, w)  # noqa: E731
    compiled = fuselens.compile(fn, dynamic=False)
    torch.testing.assert_close(strict(compiled, ids, emb, w, x), fn(ids, emb, w, x), **tolerance(torch.bfloat16))
    assert "linear(" not in fuselens.inspect(compiled)[0].graphs[0].wrapper


def test_one_row_products_are_reductions_fused_with_their_neighbours():
    """A Linear of one row (a decode step's projections) is a generated reduction along the
    weight's rows, not cuBLAS's GEMM (ops/decompositions/linalg.py `_as_reduction`): an RMSNorm's
    output is stored once for the projection reading it; SwiGLU's two projections of the same
    vector are one kernel, which stores their product once (not recomputed by each program of the
    third); the residual add is the last kernel's epilogue. Results are eager's (fp32 products)."""
    dim, hidden = 2048, 2048  # (the products broadcast their vectors to RECOMPUTE_MIN elements)
    norm = lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w

    def ffn(x, wn, w1, w3, w2):
        y = norm(x, wn)
        return x + F.linear(F.silu(F.linear(y, w1)) * F.linear(y, w3), w2)
    gen = torch.Generator().manual_seed(0)
    x, wn = torch.randn(1, dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
    w1, w3 = (torch.randn(hidden, dim, generator=gen) / dim ** 0.5 for _ in range(2))
    w2 = torch.randn(dim, hidden, generator=gen) / hidden ** 0.5
    args = [t.to(DEVICE, torch.bfloat16) for t in (x, wn, w1, w3, w2)]
    compiled = fuselens.compile(ffn, dynamic=False)
    torch.testing.assert_close(strict(compiled, *args), ffn(*args), **tolerance(torch.bfloat16))
    graph = fuselens.inspect(compiled)[0].graphs[0]
    assert "linear(" not in graph.wrapper and "mm(" not in graph.wrapper, graph.wrapper
    names = [k.name for k in graph.kernels]
    assert len(names) == 3, names  # the norm; w1 and w3 with the SwiGLU product; w2 with the add
    assert "sigmoid" in names[1] and "sigmoid" not in names[2] and "rsqrt" not in names[1], names
