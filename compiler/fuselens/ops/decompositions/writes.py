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
from .views import getitem


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


def setitem_in_place(x, index, value):
    """`x[index] = value`, returning x: the in-place form of capture's functional setitem, which
    runtime/reinplace.py gives a write into a graph input."""
    x[index] = value
    return x


def _scatter(x, target, dim, index, src):
    """`prim.scatter_`: src (a tensor or number, cast to x's dtype, broadcast to target's shape with
    index's length along dim) written into target, a view of x, at `index` along dim."""
    shape = tuple(index.numel() if d == dim else s for d, s in enumerate(target.shape)) if index is not None \
        else tuple(target.shape)
    src = P.cast(src, x.dtype) if isinstance(src, TVal) else P.full((), src, dtype=x.dtype)
    try:
        if index is not None and index.ndim == 0:  # (a 0-d index drops its dim from what src fills)
            src = P.unsqueeze(P.expand(src, shape[:dim] + shape[dim + 1:]), dim)
        else:
            src = P.expand(src, shape)
    except RuntimeError:
        raise Unsupported("a source that does not broadcast to what it is written into (eager raises)") from None
    return emit(prim.scatter_, x, target, dim, index, src, _val=x.val)


def _index_tensor(index, dtypes=(torch.int64, torch.int32), keepdim=False):
    """`index` if an integer tensor of at most one dim; `keepdim`: a 0-d one as one position of a
    dim src keeps (index_copy_'s, index_fill_'s), not a dim indexing drops."""
    if not isinstance(index, TVal) or index.dtype not in dtypes or index.ndim > 1:
        raise Unsupported("an index that is not an integer tensor of at most one dim")
    return P.reshape(index, (1,)) if keepdim and index.ndim == 0 else index


def _wrapped(index, size):
    """Negative positions counted from the end, as indexing counts them (index_copy_ raises instead)."""
    return P.where(P.lt(index, 0), P.add(index, size), index)


@register(torch.ops.aten.index_copy_.default)
def aten_index_copy_(x, dim, index, src):
    if not isinstance(x, TVal) or x.ndim == 0 or not isinstance(src, TVal) or src.ndim != x.ndim:
        raise Unsupported("index_copy_ of these arguments")
    dim, index = dim % x.ndim, _index_tensor(index, (torch.int64,), keepdim=True)
    if tuple(src.shape) != tuple(index.numel() if d == dim else s for d, s in enumerate(x.shape)):
        raise Unsupported("index_copy_ with a source of another shape (ATen raises)")
    return _scatter(x, x, dim, index, src)


@register(torch.ops.aten.index_put_.default)
def aten_index_put_(x, indices, values, accumulate=False):
    """`x.index_put_(indices, values)` with one index tensor (None elsewhere: whole dims)."""
    tensors = [d for d, i in enumerate(indices) if i is not None]
    if accumulate or not isinstance(x, TVal) or len(tensors) != 1 or len(indices) > x.ndim:
        raise Unsupported("index_put_ other than with one index tensor, not accumulating")
    dim = tensors[0]
    index = _index_tensor(indices[dim])
    return _scatter(x, x, dim, _wrapped(index, x.shape[dim]), values)


@register(torch.ops.aten.index_fill_.int_Scalar)
def aten_index_fill_(x, dim, index, value):
    if not isinstance(x, TVal) or x.ndim == 0:
        raise Unsupported("index_fill_ of a 0-d tensor")
    dim = dim % x.ndim
    return _scatter(x, x, dim, _wrapped(_index_tensor(index, (torch.int64,), keepdim=True), x.shape[dim]), value)


@register(setitem_in_place)
def _setitem_in_place(x, index, value):
    """`x[index] = value` with slices, Ellipsis and integers, and at most one index tensor: src written
    into the view the basic indices make, at the tensor's positions along its dim."""
    index = index if isinstance(index, tuple) else (index,)
    if not isinstance(x, TVal) or any(i is None or isinstance(i, (list, bool)) for i in index):
        raise Unsupported("setitem of these indices")
    n_real = sum(1 for i in index if i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (x.ndim - n_real) + index[at + 1:]
    tensors = [k for k, i in enumerate(index) if isinstance(i, TVal)]
    if len(tensors) > 1 or any(isinstance(i, slice) and i.step is not None and i.step <= 0 for i in index):
        raise Unsupported("setitem with several index tensors or a non-positive step")
    basic = tuple(slice(None) if isinstance(i, TVal) else i for i in index)
    target = getitem(x, basic)
    if not tensors:
        return _scatter(x, target, 0, None, value)
    k = tensors[0]
    dim = sum(1 for i in index[:k] if not isinstance(i, int))  # (integers drop their dims)
    tensor = _index_tensor(index[k])
    return _scatter(x, target, dim, _wrapped(tensor, target.shape[dim]), value)
