"""Writes as values: the functional forms of in-place writes that capture's functionalization emits
(ATen's copy_, fill_, zero_) and writes capture did not record; and the in-place writes into graph
inputs that runtime/reinplace.py makes of functional ones (a KV cache's `index_copy_`)."""
from __future__ import annotations

import torch

from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from ..effects import unrecorded_write
from .registry import Unsupported, register


def _over(x, new):
    """`new` (cast and broadcast to x) in place of x's values; x stays in the autograd graph with
    a zero gradient, as after eager's in-place write."""
    new = P.cast(new, x.dtype) if isinstance(new, TVal) else P.full((), new, dtype=x.dtype)
    return P.where(P.full(tuple(x.shape), True, dtype=torch.bool), new, x)


@register(torch.ops.aten.copy.default)
def aten_copy(x, src, non_blocking=False):
    return _over(x, src)


@register(torch.ops.aten.fill.Scalar, torch.ops.aten.fill.Tensor)
def aten_fill(x, value):
    return _over(x, value)


@register(torch.ops.aten.zero.default)
def aten_zero(x):
    return _over(x, 0)


@register(unrecorded_write)
def _unrecorded_write(t, v):
    return emit(prim.with_value, t, P.cast(v, t.dtype))


@register(torch.ops.aten.index_copy_.default)
def aten_index_copy_(x, dim, index, src):
    """The write itself (`index_copy_` primitive: a kernel storing into x's memory) where index is a
    tensor of indices of at most one dim (ATen's rule) and src has x's rank; otherwise ATen's call."""
    if not (isinstance(x, TVal) and isinstance(index, TVal) and isinstance(src, TVal)) or \
            index.dtype not in (torch.int64, torch.int32) or index.ndim > 1 or src.ndim != x.ndim or x.ndim == 0:
        raise Unsupported("index_copy_ of these arguments")
    dim = dim % x.ndim
    n = index.numel()
    if tuple(src.shape) != tuple(n if d == dim else s for d, s in enumerate(x.shape)):
        raise Unsupported("index_copy_ with a source of another shape (ATen raises)")
    return emit(prim.index_copy_, x, dim, index, P.cast(src, x.dtype), _val=x.val)
