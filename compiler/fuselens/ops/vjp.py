"""VJP rules of the primitives that are not pointwise (a pointwise primitive's is in its declaration,
ops/primitives.py), written with the builder's helpers.

A rule is `rule(g, out, *args, **params) -> tuple` with one entry per positional argument: the
gradient for it, or None. Arguments and `out` are the forward TVals (or constants). For pointwise
primitives the autograd engine reduces broadcast gradients to each argument's shape and casts them
to its dtype, so their rules ignore broadcasting.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import builder as P
from . import primitives as prim
from .builder import TVal, emit


def rule(*prims, with_needs=False):
    """`fn` is the VJP rule of `prims`. `with_needs`: it is also given `needs`, whether each
    positional argument needs a gradient (a primitive whose gradients come from one call)."""
    def deco(fn):
        for p in prims:
            p.vjp = fn
            p.vjp_with_needs = with_needs
        return fn
    return deco


rule(prim.full, prim.iota, prim.rand, prim.randn, prim.argmax, prim.argmin)(prim.no_grad)


# --- reductions (keepdim: `g` has the reduced shape with 1s) --------------------------------------
rule(prim.sum)(lambda g, out, x, dims: (P.expand(g, x.shape),))
rule(prim.prod)(lambda g, out, x, dims: (P.div(P.mul(g, out), x),))


@rule(prim.amax, prim.amin)
def _extreme_reduce(g, out, x, dims):
    # as ATen: ties share the gradient evenly
    hit = P.cast(P.eq(x, out), g.dtype)
    return (P.mul(P.div(g, emit(prim.sum, hit, dims)), hit),)


# --- views ----------------------------------------------------------------------------------------
rule(prim.reshape)(lambda g, out, x, shape: (P.reshape(g, x.shape),))
rule(prim.permute)(lambda g, out, x, dims: (P.permute(g, [dims.index(i) for i in range(len(dims))]),))
rule(prim.expand)(lambda g, out, x, shape: (P.sum_to(g, x.shape),))
rule(prim.slice)(lambda g, out, x, dim, start, end, step:
                 (emit(prim.slice_backward, g, x.shape, dim, start, end, step),))
rule(prim.slice_backward)(lambda g, out, x, shape, dim, start, end, step: (P.slice(g, dim, start, end, step),))


def _stride_order(t) -> tuple:
    """t's dims outermost first (row-major where its strides are symbolic)."""
    if not all(isinstance(s, int) for s in t.stride()):
        return tuple(range(t.dim()))
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


# --- extern ---------------------------------------------------------------------------------------
def _rhs_grad(g, a, b):
    """The gradient of b in a @ b, in b's own layout (one in another is copied by autograd):
    column-major (a linear's weight, transposed) as (g^T a)^T, else (transformers' Conv1D) a^T g."""
    if b.val.stride(0) == 1 and b.val.stride(1) != 1:
        return P.transpose(emit(prim.mm, P.transpose(g, 0, 1), a), 0, 1)
    return emit(prim.mm, P.transpose(a, 0, 1), g)


rule(prim.mm)(lambda g, out, a, b: (emit(prim.mm, g, P.transpose(b, 0, 1)), _rhs_grad(g, a, b)))
# the bias gradient sums g over its rows: a column reduction, whose first stage joins the kernel
# that computes g (an activation's backward) instead of reading g once more
rule(prim.addmm)(lambda g, out, bias, a, b: (P.sum_to(g, tuple(bias.shape)), emit(prim.mm, g, P.transpose(b, 0, 1)),
                                              _rhs_grad(g, a, b)))
rule(prim.bmm)(lambda g, out, a, b: (emit(prim.bmm, g, P.transpose(b, 1, 2)), emit(prim.bmm, P.transpose(a, 1, 2), g)))


@rule(prim.sdpa, with_needs=True)
def _sdpa(g, out, q, k, v, needs, kw_needs=(), **options):
    # torch's own attention backward from q, k and v: it recomputes the forward rather than have
    # the forward save anything beyond its inputs. (The same VJP written with our primitives needs
    # P, an L x S value that partition() would have the forward compute and save.) On a GPU, ATen's
    # backward of the fused kernel (flash, efficient, cuDNN) called directly: torch's autograd
    # re-running the whole attention cost ~0.35 ms of host a layer. A mask that needs a gradient
    # (one that efficient attention gives is sdpa_saving's, below) gets it from torch's autograd.
    device = P.builder().device
    if "attn_mask" in kw_needs:
        grads = list(emit(prim.call_torch_vjp, F.scaled_dot_product_attention, (q, k, v), options, [g],
                          tuple(needs[:3]), ("attn_mask",)))
        return (*grads[:3], {"attn_mask": grads[3]})
    meta_options = {name: o.val if isinstance(o, TVal) else o for name, o in options.items()}
    layouts = prim.sdpa_backward_meta(g.val, q.val, k.val, v.val, **meta_options, device=device)
    if device.type == "cuda":
        return emit(prim.sdpa_backward, g, q, k, v, **options, _val=layouts)
    return emit(prim.call_torch_vjp, F.scaled_dot_product_attention, (q, k, v), options, [g], _val=layouts)


@rule(prim.sdpa_saving, with_needs=True)
def _sdpa_saving(g, out, q, k, v, needs, kw_needs=(), **options):
    # g: the gradients of (out, logsumexp, seed, offset); only out's is ever defined. A mask that
    # needs a gradient: efficient attention's backward gives the bias's, [B, H, L, S], summed to
    # the mask's broadcast shape
    saved = [emit(prim.item, out, i) for i in range(4)]
    mask_grad = "attn_mask" in kw_needs
    grads = emit(prim.sdpa_saving_backward, g[0], q, k, v, saved, **options, mask_grad=mask_grad)
    if not mask_grad:
        return grads
    grads = list(grads)
    return (*grads[:3], {"attn_mask": P.sum_to(grads[3], options["attn_mask"].shape)})


@rule(prim.conv2d, with_needs=True)
def _conv2d(g, out, x, weight, bias, stride, padding, dilation, groups, needs):
    gx, gw = emit(prim.conv2d_backward, g, x, weight, stride, padding, dilation, groups, tuple(needs[:2]))
    # the bias broadcasts as (C, 1, 1) over a batched or unbatched result
    db = None if bias is None or not needs[2] else P.reshape(P.sum_to(g, (bias.shape[0], 1, 1)), bias.shape)
    return gx, gw, db


@rule(prim.max_pool2d)
def _max_pool2d(g, out, x, *window):
    # g: the gradients of (out, indices); the indices have none
    return (emit(prim.max_pool2d_backward, g[0], emit(prim.item, out, 1), tuple(x.shape), _stride_order(x.val),
                 *window),)


rule(prim.embedding)(lambda g, out, indices, weight, padding_idx:
                     (None, emit(prim.embedding_backward, g, indices, weight.shape[0], padding_idx)))
# g added into zeros at the gathered positions, as eager's backward
rule(prim.gather)(lambda g, out, x, dim, index:
                  (emit(prim.call_torch, torch.scatter_add, (P.full(x.shape, 0, g.dtype), dim, index, g), {}),
                   None, None))


@rule(prim.call_torch)
def _call_torch(g, out, fn, args, kwargs, needs=None, kw_needs=()):
    """`needs[i]`: positional argument i needs a gradient (BatchNorm's running stats do not, and
    torch refuses to differentiate with respect to them); `kw_needs`: the names of the tensors
    passed by keyword that need one. Returns (None, one gradient per positional argument, a dict
    of the keyword ones)."""
    grads = g if isinstance(g, (tuple, list)) else (g,)
    vals = out.val if isinstance(out.val, (tuple, list)) else (out.val,)  # one per result
    zeros_for_missing = [gi if gi is not None or v is None else P.full(tuple(v.shape), 0, dtype=v.dtype)
                         for gi, v in zip(grads, vals)]  # None: a result that is no tensor
    floating = lambda t: isinstance(t, TVal) and (t.val.is_floating_point() or t.val.is_complex())  # noqa: E731
    if any(isinstance(v, (list, tuple)) and any(floating(t) for t in v) for v in kwargs.values()):
        raise NotImplementedError(f"gradient of {fn} with floating-point tensors in a list passed by keyword")
    kw_needs = tuple(k for k in kw_needs if floating(kwargs.get(k)))
    res = iter(emit(prim.call_torch_vjp, fn, args, kwargs, zeros_for_missing, needs, kw_needs))

    def nested(a):  # (the gradients come flat: prim.flat_items)
        return type(a)(nested(x) for x in a) if isinstance(a, (list, tuple)) else next(res)
    return None, nested(tuple(args)), dict(zip(kw_needs, res))
