"""softmax(Q K^T * scale) V runs as one scaled_dot_product_attention call (ops/attention.py) exactly
where that computes the same function; everything else keeps its matmuls and softmax kernel."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fuselens
from fuselens.ops import primitives as prim
from fl_backend_testing import CPP, DEVICE, SDPA, tolerance


def workload(q, k, v):  # bench/workloads.py
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v


def manual(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return (e / e.sum(dim=-1, keepdim=True)) @ v


def unscaled(q, k, v):
    return torch.softmax(q @ k.mT, dim=-1) @ v


def also_probs(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return p @ v, p


def other_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v


def masked(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    mask = torch.full(s.shape[-2:], float("-inf"), device=s.device).triu(1)
    return torch.softmax(s + mask, dim=-1) @ v


def unstabilized(q, k, v):  # no max subtracted: overflows where SDPA does not
    e = torch.exp(q @ k.transpose(-2, -1))
    return (e / e.sum(-1, keepdim=True)) @ v


def compiled(fn, *args):
    """(outputs, wrapper source, kernel names) of fuselens's first call; an eager fallback fails."""
    cf = fuselens.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cf(*args)
    (entry,) = fuselens.inspect(cf)
    return out, "\n".join(entry.wrappers), [k.name for k in entry.kernels]


def inputs(*shapes, dtype=torch.float32, grad=False):
    return [torch.randn(*s, dtype=dtype, device=DEVICE, requires_grad=grad) for s in shapes]


def close(got, expected):
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected, strict=True):
        torch.testing.assert_close(g, e, **tolerance(e.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn, shape, scale", [(workload, (2, 3, 8, 16), 0.25), (manual, (2, 3, 8, 16), 0.25),
                                              (unscaled, (4, 8, 16), 1.0), (manual, (2, 2, 2, 5, 9), 1 / 3)])
def test_attention_is_one_sdpa_call(fn, shape, scale, dtype):
    args = inputs(shape, shape, shape, dtype=dtype)
    out, wrapper, kernels = compiled(fn, *args)
    close(out, fn(*args))
    assert kernels == []
    assert re.search(SDPA + rf"arg0, arg1, arg2, scale={re.escape(repr(scale))}[,)]", wrapper) and "bmm" not in wrapper


def test_keys_values_of_another_length_and_width():
    q, k, v = inputs((2, 3, 8, 16), (2, 3, 12, 16), (2, 3, 12, 24))
    out, wrapper, _ = compiled(workload, q, k, v)
    close(out, workload(q, k, v))
    assert re.search(SDPA, wrapper) and tuple(out.shape) == (2, 3, 8, 24)


def negative_scale(q, k, v):  # flash subtracts the scaled row max: a row minimum when scale < 0
    return torch.softmax((q @ k.transpose(-2, -1)) / -8.0, dim=-1) @ v


@pytest.mark.parametrize("fn", [also_probs, other_dim, masked, unstabilized, negative_scale])
def test_not_rewritten_where_sdpa_differs(fn):
    args = inputs((2, 3, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16))
    out, wrapper, kernels = compiled(fn, *args)
    close(out, fn(*args))
    assert "sdpa" not in wrapper and "torch.bmm(" in wrapper and kernels


def test_broadcast_batch_not_rewritten():
    q, k, v = inputs((2, 3, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16))
    out, wrapper, _ = compiled(workload, q, k, v)
    close(out, workload(q, k, v))
    assert "sdpa" not in wrapper


def test_training_uses_torchs_attention_backward():
    dtype = torch.float32
    args = inputs((2, 3, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16), dtype=dtype, grad=True)
    out, wrapper, kernels = compiled(workload, *args)
    expected = workload(*args)
    close(out, expected)
    forward, backward = wrapper.split("# backward")
    assert "bmm" not in forward and kernels == []  # the backward is one call, no kernel
    # the fused kernel's forward saves its logsumexp; ATen's backward reads it (no second forward,
    # no autograd re-run): CUDA's kernels and the CPU's flash kernel alike
    assert "prims.sdpa_saving(" in forward and "prims.sdpa_saving_backward(" in backward
    assert "call_torch_vjp" not in backward and not re.search(SDPA, backward)
    g = torch.randn_like(expected)
    for got, exp in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(expected, args, g)):
        torch.testing.assert_close(got, exp, **tolerance(dtype))


def test_half_attention_trained_stays_as_written():
    """bf16 attention with a gradient stays bmm, softmax, bmm: the fused backward's sum(dO * O)
    reads O rounded to bf16, and keys sharing a mean (LayerNorm'd tokens) sum that error into dQ
    coherently: its dQ was 10-60x further from float64's than eager's (MobileViT training)."""
    torch.manual_seed(0)
    common = torch.randn(32, dtype=torch.float64, device=DEVICE)
    exact = [torch.randn(2, 2, 128, 32, dtype=torch.float64, device=DEVICE) * s + common
             for s in (0.3, 0.3, 0.05)]
    exact[0] -= common
    g = torch.randn(2, 2, 128, 32, dtype=torch.float64, device=DEVICE)

    def grads(fn, dtype):
        args = [t.to(dtype).requires_grad_() for t in exact]
        return fn(*args), torch.autograd.grad(fn(*args), args, g.to(dtype))

    out, wrapper, _ = compiled(workload, *[t.to(torch.bfloat16).requires_grad_() for t in exact])
    assert "sdpa" not in wrapper and "torch.bmm(" in wrapper
    want = grads(workload, torch.float64)[1]
    error = lambda got: [((a.double() - w).norm() / w.norm()).item() for a, w in zip(got, want)]  # noqa: E731
    for fl, eager in zip(error(grads(fuselens.compile(workload), torch.bfloat16)[1]),
                         error(grads(workload, torch.bfloat16)[1])):
        assert fl <= 2 * eager + 1e-3, (fl, eager)


def heads_of_rows(attention):
    """A transformer layer's attention: heads split from (B, S, H * D) rows, the result merged back
    into rows (BERT's and GPT-2's layout: q is a permuted view of (B, S, H, D))."""
    def fn(q, k, v):
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, 4, 16).transpose(1, 2) for t in (q, k, v))
        return attention(q, k, v).transpose(1, 2).reshape(b, s, 64)
    return fn


def padding_mask(q, k, v):  # HF's masks: boolean, (B, 1, L, S), True where attended
    keep = torch.arange(k.shape[-2], device=q.device) < torch.tensor([[5], [8]], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].expand(-1, 1, q.shape[-2], -1))


ATTENTIONS = {
    "matmuls": workload,
    "sdpa": F.scaled_dot_product_attention,
    "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
    "bool_mask": padding_mask,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("attention", ATTENTIONS.values(), ids=ATTENTIONS.keys())
def test_attention_of_rows_runs_in_the_layout_the_kernel_returns(attention, dtype, grad, monkeypatch):
    """SDPA's fused kernels (CUDA's flash, efficient and cuDNN attention, CPU's flash) return such
    q's (B, S, H, D) rows, not the contiguous result meta's math path gives: predicted as they
    return them, the result and the gradients are read in place, with no copy after the call."""
    import fuselens.codegen.wrapper as wrapper_module
    copies, ensure_layout = [], wrapper_module.ensure_layout

    def counted(t, size, stride):
        out = ensure_layout(t, size, stride)
        if out is not t:
            copies.append((tuple(t.stride()), stride))
        return out
    monkeypatch.setattr(wrapper_module, "ensure_layout", counted)
    fn = heads_of_rows(attention)
    args = inputs((2, 8, 64), (2, 8, 64), (2, 8, 64), dtype=dtype, grad=grad)
    out, wrapper, _ = compiled(fn, *args)
    expected = fn(*args)
    close(out, expected)
    if grad:
        g = torch.randn_like(expected)
        for got, exp in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(expected, args, g)):
            torch.testing.assert_close(got, exp, **tolerance(dtype))
    assert copies == []
    if attention is workload and grad and dtype == torch.bfloat16:  # test_half_attention_trained_stays_as_written
        assert "sdpa" not in wrapper
    elif grad:  # ATen's fused attention backward, called directly (CUDA's kernels, the CPU's flash)
        assert "prims.sdpa_saving(" in wrapper and "prims.sdpa_saving_backward(" in wrapper
        assert "call_torch_vjp" not in wrapper
    else:
        assert re.search(SDPA, wrapper)


@pytest.mark.parametrize("grad", [False, True])
def test_a_boolean_mask_becomes_one_bias_for_every_layer(grad):
    """HF's decoders give each layer's SDPA call the same boolean mask; torch turns it into an
    additive bias on every call (three kernels a layer on a GPU). The graph makes the bias once,
    in the kernel that computes the mask, and gives every attention that bias: results and
    gradients equal eager's, a query row that sees no key included."""
    def layers(q, k, v, lengths):
        keep = torch.arange(8, device=q.device) < lengths[:, None]
        mask = keep[:, None, None, :] & torch.ones(8, 8, dtype=torch.bool, device=q.device).tril()
        for _ in range(2):
            q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + q
        return q
    q, k, v = inputs((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), dtype=torch.bfloat16, grad=grad)
    lengths = torch.tensor([0, 5], device=DEVICE)  # the first sequence: every key hidden
    out, wrapper, _ = compiled(layers, q, k, v, lengths)
    expected = layers(q, k, v, lengths)
    torch.testing.assert_close(out, expected, equal_nan=True, **tolerance(torch.bfloat16))
    if grad:
        g = torch.randn_like(expected)
        for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
            torch.testing.assert_close(got, exp, equal_nan=True, **tolerance(torch.bfloat16))
    bias = re.search(r"(buf\d+) = empty\(\(2, 1, 8, 8\), \([^)]*\), torch.bfloat16\)", wrapper)
    assert bias, wrapper
    attentions = re.findall(r"(?:prims.sdpa(?:_saving)?|decode_attention)\(.*attn_mask=(\w+)", wrapper)
    assert attentions == [bias.group(1)] * 2


def test_a_mask_broadcast_along_its_rows_is_decided_as_the_kernel_gets_it(monkeypatch):
    """HF's masks come broadcast ((B, 1, L, S) expanded from fewer dims, stride 0 along a row).
    CUDA's efficient attention takes no such mask (torch picks its math path for it); the graph
    stores the mask whole, so the kernel gets one it does take. The kernel is chosen, the bias made
    and the result laid out for the mask as stored: no copy after each call (BERT's twelve layers
    each copied their result twice, and converted the mask again). Here torch's choice is made
    CUDA's on any device."""
    from fuselens.codegen import wrapper as W
    choose = torch._fused_sdp_choice

    def as_cuda(q, k, v, mask=None, **kw):  # (0: math)
        return 0 if mask is not None and mask.stride(-1) != 1 else choose(q, k, v, mask, **kw)
    monkeypatch.setattr(torch, "_fused_sdp_choice", as_cuda)
    copied, real = [], W.ensure_layout

    def ensure_layout(t, size, stride):
        copied.append(t is not None and t.numel() > 1 and t.stride() != tuple(stride))
        return real(t, size, stride)
    monkeypatch.setattr(W, "ensure_layout", ensure_layout)

    def layers(x, n):
        rows = torch.arange(8, device=x.device) < n  # a condition on the query row only
        mask = rows[None, None, :, None].expand(2, 1, 8, 8)
        for _ in range(2):
            q = x.view(2, 8, 4, 16).transpose(1, 2)
            x = F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(2, 8, 64) + x
        return x
    x, n = inputs((2, 8, 64))[0], torch.tensor(5, device=DEVICE)
    out, wrapper, _ = compiled(layers, x, n)
    close(out, layers(x, n))
    assert not any(copied)
    bias = re.search(r"(buf\d+) = empty\(\(2, 1, 8, 8\), \([^)]*\), torch.float32\)", wrapper)
    assert bias and re.findall(SDPA + r".*attn_mask=(\w+)", wrapper) == [bias.group(1)] * 2, wrapper


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 8), (2, 1, 8, 8), (2, 4, 8, 8)], ids=str)
def test_a_float_mask_with_a_gradient_runs_the_kernel_torch_chooses(shape, dtype):
    """An additive mask with a gradient of its own (a trained relative position bias): where
    torch's chooser gives such a trained attention a fused kernel, one sdpa call, the bias's
    gradient from efficient attention's backward summed to its broadcast shape; where it gives
    the math path (a CPU; T5's bias on an H200), that path as primitives, in fp32 as eager's."""
    q, k, v, bias = (t.to(dtype).detach().requires_grad_()
                     for t in inputs((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), shape))
    fn = lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # noqa: E731
    out, wrapper, _ = compiled(fn, q, k, v, bias)
    expected = fn(q, k, v, bias)
    close(out, expected)
    math_path = prim.sdpa_choice(q, k, v, bias, False, None, DEVICE, grad=True, mask_grad=True) == 0
    assert bool(re.search(r"prims\.sdpa|decode_attention\(", wrapper)) != math_path, wrapper
    assert "torch.nn.functional.scaled_dot_product_attention(" not in wrapper
    g = torch.randn_like(expected)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v, bias), g), torch.autograd.grad(expected, (q, k, v, bias), g)):
        torch.testing.assert_close(got, exp, **tolerance(dtype))


def test_grouped_query_heads_are_one_sdpa_call():
    """enable_gqa: each key/value head serves its group of query heads, repeated before one sdpa."""
    q, k, v = inputs((2, 8, 6, 16), (2, 2, 6, 16), (2, 2, 6, 16), grad=True)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    out, wrapper, _ = compiled(fn, q, k, v)
    expected = fn(q, k, v)
    close(out, expected)
    assert re.search(r"prims\.sdpa|decode_attention\(", wrapper) and \
        "torch.nn.functional.scaled_dot_product_attention(" not in wrapper
    g = torch.randn_like(expected)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(got, exp, **tolerance(torch.float32))


def test_dropout_stays_torchs_call():
    """Dropout draws torch's random numbers: the call stays F.scaled_dot_product_attention."""
    q, k, v = inputs((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # noqa: E731
    _, wrapper, _ = compiled(fn, q, k, v)
    assert not re.search(SDPA, wrapper) and "torch.nn.functional.scaled_dot_product_attention(" in wrapper


@pytest.mark.parametrize("backend, masked", [(1, False), (2, False), (2, True), (3, False), (3, True)])
# (flash, efficient, cuDNN)
def test_fused_attention_backward_arguments_follow_the_schema(backend, masked):
    """The backward's arguments are found by name in this torch's schemas (their order and the
    forward's result names differ between versions); the meta functions give each gradient in
    the layout of its input, as the kernels return them."""
    q = torch.empty(2, 8, 4, 16, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    k = torch.empty(2, 4, 12, 16, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(2, 1, 8, 12, dtype=torch.bool, device="meta") if masked else None
    grads = prim._fused_attention_backward(backend, torch.empty_like(q), q, k, k, mask, False, 0.25)
    assert [tuple(t.shape) for t in grads] == [tuple(q.shape), tuple(k.shape), tuple(k.shape)]


@pytest.mark.parametrize("backend", [1, 2, 3])  # flash, efficient, cuDNN
@pytest.mark.parametrize("masked", [False, True])
def test_trained_attention_saves_the_fused_forwards_statistics(backend, masked, monkeypatch):
    """A GPU graph to be differentiated (torch's kernel choice stubbed; meta tensors): each fused
    attention saves its logsumexp for the backward, which runs no second forward."""
    from fuselens.autograd.joint import build_joint
    from fuselens.ops.attention import save_attention_statistics
    from fuselens.ops.trace import to_primitive_graph
    monkeypatch.setattr(prim, "sdpa_backend", lambda *args, **kwargs: backend)
    monkeypatch.setattr(prim, "_cudnn_mask_fill", lambda device: -math.inf)  # asked of a GPU

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None)
    q = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(2, 1, 8, 8, dtype=torch.bool, device="meta")
    gm = torch.fx.symbolic_trace(fn)
    graph = to_primitive_graph(gm, [q, q, q, mask], "cuda")
    save_attention_statistics(graph, "cuda", [True, True, True, False])
    (saving,) = [n for n in graph.nodes if n.target is prim.sdpa_saving]
    assert saving.kwargs["backend"] == backend
    joint = build_joint(graph, [True, True, True, False], "cuda")
    calls = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    assert calls.count(prim.sdpa_saving) == 1 and prim.sdpa not in calls
    (bw,) = [n for n in joint.graph.nodes if n.target is prim.sdpa_saving_backward]
    # out, logsumexp, seed, offset: items of the forward's call
    assert [(a.args[0].target, a.args[1]) for a in bw.args[4]] == [(prim.sdpa_saving, i) for i in range(4)]
    assert [tuple(n.meta["val"].shape) for n in bw.users] == [(2, 4, 8, 16)] * 3


@pytest.mark.parametrize("backend", [2, 3])  # efficient, cuDNN: the two that take masks
def test_a_trained_bias_saves_statistics_where_efficient_attention_gives_its_gradient(backend, monkeypatch):
    """A float mask that requires grad: efficient attention's backward gives the bias's gradient
    (summed to the mask's shape); with another kernel the attention stays sdpa, differentiated by
    torch's autograd."""
    from fuselens.autograd.joint import build_joint
    from fuselens.ops.attention import save_attention_statistics
    from fuselens.ops.trace import to_primitive_graph
    monkeypatch.setattr(prim, "sdpa_backend", lambda *args, **kwargs: backend)
    q = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16, device="meta")
    bias = torch.empty(4, 8, 8, dtype=torch.bfloat16, device="meta")
    gm = torch.fx.symbolic_trace(lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    graph = to_primitive_graph(gm, [q, q, q, bias], "cuda")
    save_attention_statistics(graph, "cuda", [True, True, True, True])
    joint = build_joint(graph, [True, True, True, True], "cuda")
    calls = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    if backend == 3:
        assert prim.sdpa in calls and prim.sdpa_saving not in calls and prim.call_torch_vjp in calls
        return
    (bw,) = [n for n in joint.graph.nodes if n.target is prim.sdpa_saving_backward]
    assert bw.kwargs["mask_grad"] and prim.call_torch_vjp not in calls
    *_, out = joint.graph.nodes
    assert tuple(out.args[0][-1].meta["val"].shape) == (4, 8, 8)


@pytest.mark.parametrize("backend", [1, 2, 3])  # flash, efficient, cuDNN
def test_fused_attention_layouts(backend, monkeypatch):
    """The layouts predicted for a CUDA graph where torch picks each fused kernel (its meta
    functions run, torch's choice stubbed): flash and cuDNN return q's stride order, efficient
    attention (B, S, H, D) rows whatever q's; the gradients come in their inputs' layouts."""
    monkeypatch.setattr(prim, "sdpa_backend", lambda *args: backend)
    rows = torch.empty(2, 8, 4, 16, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    heads = torch.empty(2, 4, 8, 16, dtype=torch.bfloat16, device="meta")
    for q in (rows, heads):
        out = prim.sdpa_meta(q, q, q, is_causal=True, scale=0.25, device="cuda")
        assert out.stride() == (rows.stride() if backend == 2 else q.stride())
        grads = prim.sdpa_backward_meta(out, q, q, q, is_causal=True, scale=0.25, device="cuda")
        assert [g.stride() for g in grads] == [out.stride()] * 3


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's fused kernels")
@pytest.mark.parametrize("backend", [2, 3])  # efficient, cuDNN: the two that take masks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saving_forward_with_a_mask_equals_torchs_kernel(backend, dtype):
    """sdpa_saving's forward gives the fused kernel the mask as torch does (efficient: -inf,
    padded and expanded; cuDNN: the fill this torch uses, as each dtype rounds it), wholly
    masked query rows included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 4, 16, 64, device=DEVICE, dtype=dtype) for _ in range(3))
    mask = torch.rand(2, 1, 16, 16, device=DEVICE) > 0.3
    mask[:, :, 3] = False  # a query row that sees no key
    kernel = {2: SDPBackend.EFFICIENT_ATTENTION, 3: SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([kernel]):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = prim.sdpa_saving(q, k, v, mask, backend=backend)[0]
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=0, atol=0)


def transposed_heads(qs, ks, vs):
    # (B, S, H, D) in, heads transposed out; the keys computed on the way (stored in the layout the
    # trace gives them, the transposed one)
    q, k, v = qs.transpose(1, 2), (ks.transpose(1, 2) * 2)[..., :16], vs.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("grad", [False, True])
def test_attention_results_come_in_the_layout_predicted(grad, monkeypatch):
    """Attention's result layouts are the device's kernels' (prim.sdpa_meta): the wrapper's check
    after each call copies nothing (a prediction from the math path's meta run did, every call)."""
    from fuselens.codegen import wrapper as W
    copied = []
    real = W.ensure_layout

    def ensure_layout(t, size, stride):
        copied.append(t is not None and t.numel() > 1 and t.stride() != tuple(stride))
        return real(t, size, stride)
    monkeypatch.setattr(W, "ensure_layout", ensure_layout)
    args = inputs((2, 8, 4, 16), (2, 8, 4, 24), (2, 8, 4, 16), grad=grad)
    got = fuselens.compile(transposed_heads)(*args)
    close(got, transposed_heads(*args))
    if grad:
        got.sum().backward()
    assert not any(copied)


def repeat_kv(t, n):  # transformers' spelling of grouped-query heads
    b, h, s, d = t.shape
    return t[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def repeated(q, k, v, mask):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n), attn_mask=mask)


@pytest.mark.parametrize("fn", [gqa, repeated])
@pytest.mark.parametrize("rows, mask", [(1, None), (1, "keys"), (6, None), (6, "rows"), (6, "heads"), (6, "bool")])
def test_grouped_query_heads_fold_into_rows(fn, rows, mask):
    """Hq = 4 * Hkv query heads read as Hkv heads of 4x the rows against K and V as they are: no
    kernel repeats K or V (the sdpa call takes the inputs themselves), forward and backward equal
    eager's, for decode (one row) and prefill, with masks shared by the group or one per head."""
    q = torch.randn(2, 6, 8, 16, device=DEVICE).transpose(1, 2)[:, :, :rows]  # (B, H, L, D) as HF's
    k, v = inputs((2, 2, 6, 16), (2, 2, 6, 16))
    m = {None: None, "keys": torch.randn(2, 1, 1, 6, device=DEVICE), "rows": torch.randn(2, 1, rows, 6, device=DEVICE),
         "heads": torch.randn(2, 8, rows, 6, device=DEVICE),
         "bool": torch.rand(2, 1, rows, 6, device=DEVICE) > 0.3}[mask]
    if m is not None and m.dtype == torch.bool:
        m[..., 0] = True  # (a row hiding every key is NaN in eager)
    out, wrapper, kernels = compiled(fn, q, k, v, m)
    close(out, fn(q, k, v, m))
    assert re.search(SDPA + r".*, arg1, arg2[,)]", wrapper), wrapper
    # (what is left: q's copy into rows, the mask's over the group, a boolean mask's bias, and on
    # CUDA the result's copy back into heads: its kernels lay the heads inside the rows, so the
    # folded result [B, Hkv, n * L, D] is no view of [B, Hq, L, D] there)
    assert len(kernels) <= (rows > 1) + (mask in ("rows", "bool")) + (mask == "bool") + (DEVICE == "cuda"), kernels
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fuselens.compile(fn)(q, k, v, m)
    expected = fn(q, k, v, m)
    close(out, expected)
    g = torch.randn_like(expected)
    for got, exp in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(expected, (q, k, v), g)):
        torch.testing.assert_close(got, exp, **tolerance(torch.float32))


def test_grouped_heads_stay_repeated_where_folding_differs():
    """A causal mask aligns rows by position (folding the group into rows would move them): K and
    V are repeated, and the result is eager's."""
    q, k, v = inputs((1, 4, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)  # noqa: E731
    out, wrapper, kernels = compiled(fn, q, k, v)
    close(out, fn(q, k, v))
    assert not re.search(SDPA + r"[^,]+, arg1, arg2", wrapper) and kernels


@pytest.mark.skipif(CPP, reason="C++ graphs call ATen's attention")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bias", "bool", "per_head"])
def test_few_query_rows_run_fuselens_decode_attention(dtype, mask):
    """A decode step's attention (one query row a head, grouped heads folded into rows: 4 here;
    keys of a length no multiple of the kernel's block) runs codegen/attention.py's kernel, which
    reads K, V and the mask as they are, and equals eager's; a masked tail of positions and a
    batch row hiding some positions included."""
    b, hkv, group, s, d = 2, 2, 4, 70, 16
    q = torch.randn(b, hkv * group, 1, d, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(b, hkv, s, d, device=DEVICE, dtype=dtype) for _ in range(2))
    m = {None: None, "bias": torch.zeros(1, 1, 1, s, device=DEVICE, dtype=dtype),
         "bool": torch.ones(b, 1, 1, s, device=DEVICE, dtype=torch.bool),
         "per_head": torch.randn(b, hkv * group, 1, s, device=DEVICE, dtype=dtype)}[mask]
    if mask == "bias":
        m[..., 50:] = float("-inf")
    elif mask == "bool":
        m[0, ..., 33:] = False
    out, wrapper, kernels = compiled(gqa, q, k, v, m)
    close(out, gqa(q, k, v, m))
    assert re.search(r"decode_attention\(.*, arg1, arg2, ", wrapper) and "prims.sdpa" not in wrapper, wrapper


@pytest.mark.skipif(CPP, reason="C++ graphs call ATen's attention")
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_split_over_positions_equals_eager(splits):
    """The decode kernel with its positions split (a GPU with idle SMs: one program per split, then
    a kernel combining them by their running maxima): a split whose positions are all hidden and a
    query row hiding every position (0, as torch's kernels) included."""
    from fuselens.codegen.attention import decode_attention
    q = torch.randn(2, 2, 5, 32, device=DEVICE)
    k, v = (torch.randn(2, 2, 150, 32, device=DEVICE) for _ in range(2))
    mask = torch.zeros(2, 1, 5, 150, device=DEVICE)
    mask[0, :, :, 40:] = float("-inf")  # (splits of 64 positions: the last two hide every position)
    mask[1, :, 2] = float("-inf")
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = decode_attention(q, k, v, mask, shape=expected.shape, stride=expected.stride(), splits=splits)
    close(got, expected)


MHA_CONFIGS = {  # nn.MultiheadAttention(embed, heads, **kwargs), its call's kwargs
    "packed, no weights": ({"batch_first": True}, {"need_weights": False}),
    "averaged weights": ({}, {}),
    "weights per head, causal": ({}, {"average_attn_weights": False, "causal": True}),
    "padding mask": ({"batch_first": True}, {"key_padding_mask": True}),
    "float mask": ({}, {"attn_mask": "float"}),
    "keys and values of other widths": ({"kdim": 6, "vdim": 10, "bias": False}, {"need_weights": False}),
    "bias and zero attention": ({"add_bias_kv": True, "add_zero_attn": True}, {}),
}


@pytest.mark.parametrize("module_kwargs, call", MHA_CONFIGS.values(), ids=MHA_CONFIGS.keys())
def test_multihead_attention_is_captured_through_its_python(module_kwargs, call):
    """`F.multi_head_attention_forward` (torchvision's ViT, any nn.MultiheadAttention) has no
    decomposition: captured as one extern, it ran unfused and its backward re-ran it under torch's
    autograd (1.5 ms of host time a layer). Its Python is captured instead, as torch.compile does:
    projections, attention and their gradients are ops, equal to eager in every configuration."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, **module_kwargs).to(DEVICE)
    first = module_kwargs.get("batch_first", False)
    shape = lambda width: (2, 5, width) if first else (5, 2, width)  # noqa: E731
    q = torch.randn(shape(16), device=DEVICE, requires_grad=True)
    k = torch.randn(shape(module_kwargs.get("kdim", 16)), device=DEVICE, requires_grad=True)
    v = torch.randn(shape(module_kwargs.get("vdim", 16)), device=DEVICE, requires_grad=True)
    kwargs = dict(call)
    if kwargs.pop("causal", False):
        kwargs["attn_mask"] = torch.ones(5, 5, dtype=torch.bool, device=DEVICE).triu(1)
        kwargs["is_causal"] = True
    if isinstance(kwargs.get("attn_mask"), str):
        kwargs["attn_mask"] = torch.randn(5, 5, device=DEVICE)
    if kwargs.pop("key_padding_mask", False):
        kwargs["key_padding_mask"] = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=DEVICE)

    def f(q, k, v):
        out, weights = mha(q, k, v, **kwargs)
        return (out, weights) if weights is not None else out
    out, wrapper, _ = compiled(f, q, k, v)
    expected = f(q, k, v)
    close(out, expected)
    assert "multi_head_attention_forward" not in wrapper and "call_torch_vjp" not in wrapper, wrapper
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    exp = expected if isinstance(expected, tuple) else (expected,)
    params = [q, k, v, *mha.parameters()]
    for got, want in zip(torch.autograd.grad(outs, params, grads), torch.autograd.grad(exp, params, grads)):
        torch.testing.assert_close(got, want, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal", "boolean", "float"])
def test_a_trained_attention_on_torchs_math_path_is_that_path(mask, dtype, monkeypatch):
    """Where torch's chooser gives a trained attention its math path, fuselens computes that path
    (attention._math_attention): results and gradients equal to eager's math path for each kind
    of mask, a scale given or not, and no sdpa call left."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    monkeypatch.setattr(prim, "sdpa_choice", lambda *args, **kwargs: 0)
    q, k, v = (t.to(dtype).detach().requires_grad_() for t in inputs((2, 3, 8, 16), (2, 3, 6, 16), (2, 3, 6, 16)))
    options = {"none": {"scale": 0.3}, "causal": {"is_causal": True},
               "boolean": {"attn_mask": torch.rand(8, 6, device=DEVICE) > 0.3},
               "float": {"attn_mask": torch.randn(3, 8, 6, device=DEVICE, dtype=dtype, requires_grad=True)}}[mask]
    leaves = [q, k, v] + [t for t in options.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **options)  # noqa: E731
    out, wrapper, _ = compiled(fn, q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):
        expected = fn(q, k, v)
    close(out, expected)
    assert not re.search(r"prims\.sdpa|scaled_dot_product_attention\(", wrapper), wrapper
    g = torch.randn_like(expected)
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.autograd.grad(expected, leaves, g)
    for got, exp in zip(torch.autograd.grad(out, leaves, g), want):
        torch.testing.assert_close(got, exp, **tolerance(dtype))
