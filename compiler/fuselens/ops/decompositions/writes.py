"""Writes as values: the functional forms of in-place writes that capture's functionalization emits
(ATen's copy_, fill_, zero_) and writes capture did not record."""
from __future__ import annotations

import torch

from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from ..effects import unrecorded_write
from .registry import register


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
