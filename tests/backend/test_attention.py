"""softmax(Q K^T * scale) V runs as one scaled_dot_product_attention call (ops/attention.py) exactly
where that computes the same function; everything else keeps its matmuls and softmax kernel."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import fuselens
from fuselens.ops import primitives as prim
from fl_backend_testing import DEVICE, tolerance


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
    assert f"prims.sdpa(arg0, arg1, arg2, scale={scale!r})" in wrapper and "bmm" not in wrapper


def test_keys_values_of_another_length_and_width():
    q, k, v = inputs((2, 3, 8, 16), (2, 3, 12, 16), (2, 3, 12, 24))
    out, wrapper, _ = compiled(workload, q, k, v)
    close(out, workload(q, k, v))
    assert "prims.sdpa(" in wrapper and tuple(out.shape) == (2, 3, 8, 24)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_uses_torchs_attention_backward(dtype):
    args = inputs((2, 3, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16), dtype=dtype, grad=True)
    out, wrapper, kernels = compiled(workload, *args)
    expected = workload(*args)
    close(out, expected)
    forward, backward = wrapper.split("# backward")
    # the forward saves only q, k, v; the backward is one call, no kernel
    assert "prims.sdpa(" in forward and "bmm" not in forward and "return (buf0, arg0, arg1, arg2)" in forward
    assert kernels == []
    if DEVICE == "cuda":  # ATen's fused attention backward, called directly (no autograd re-run)
        assert "prims.sdpa_backward(" in backward and "call_torch_vjp" not in backward
    else:
        assert "prims.call_torch_vjp(torch.nn.functional.scaled_dot_product_attention" in backward
        assert "ensure_layout(buf0[1], (2, 3, 8, 16), (384, 128, 16, 1))" in backward  # dk in k's layout
    g = torch.randn_like(expected)
    for got, exp in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(expected, args, g)):
        torch.testing.assert_close(got, exp, **tolerance(dtype))


def heads_of_rows(q, k, v):
    """A transformer layer's attention: heads split from (B, S, H * D) rows, the result merged back
    into rows (BERT's and GPT-2's layout: q is a permuted view of (B, S, H, D))."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, 4, 16).transpose(1, 2) for t in (q, k, v))
    return workload(q, k, v).transpose(1, 2).reshape(b, s, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_attention_of_rows_runs_in_the_layout_the_kernel_returns(dtype, grad, monkeypatch):
    """SDPA's fused kernels (CUDA's flash, efficient and cuDNN attention, CPU's flash) return such
    q's (B, S, H, D) rows, not the contiguous result meta's math path gives: predicted as they
    return them, the result and the gradients are read in place, with no copy after the call."""
    copies = []

    def ensure_layout(t, size, stride):
        out = wrapper_module.ensure_layout.__wrapped__(t, size, stride)
        if out is not t:
            copies.append((tuple(t.stride()), stride))
        return out
    import fuselens.codegen.wrapper as wrapper_module
    ensure_layout.__wrapped__ = wrapper_module.ensure_layout
    monkeypatch.setattr(wrapper_module, "ensure_layout", ensure_layout)
    args = inputs((2, 8, 64), (2, 8, 64), (2, 8, 64), dtype=dtype, grad=grad)
    out, wrapper, _ = compiled(heads_of_rows, *args)
    expected = heads_of_rows(*args)
    close(out, expected)
    if grad:
        g = torch.randn_like(expected)
        for got, exp in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(expected, args, g)):
            torch.testing.assert_close(got, exp, **tolerance(dtype))
    assert "prims.sdpa(" in wrapper and copies == []


@pytest.mark.parametrize("backend", [1, 2, 3])  # SDPBackend: flash, efficient, cuDNN
def test_fused_attention_backward_arguments_follow_the_schema(backend):
    """The backward's arguments are found by name in this torch's schemas (their order and the
    forward's result names differ between versions); the meta functions give each gradient in
    the layout of its input, as the kernels return them."""
    q = torch.empty(2, 8, 4, 16, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    k = torch.empty(2, 4, 12, 16, dtype=torch.bfloat16, device="meta")
    grads = prim._fused_attention_backward(backend, torch.empty_like(q), q, k, k, 0.25)
    assert [tuple(t.shape) for t in grads] == [tuple(q.shape), tuple(k.shape), tuple(k.shape)]
