"""Reductions: sums, means, extremes and their indices, variance, norms, logsumexp, softmax."""
from __future__ import annotations

import builtins
import math

import torch

from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from .conventions import dims_arg, upcast
from .registry import Unsupported, register, spellings


@register(*spellings("sum"))
def sum_(x, dim=None, keepdim=False, *, dtype=None):
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        dtype = torch.int64
    y = P.cast(x, dtype) if dtype is not None else x
    out = P.sum(upcast(y), dims_arg(dim), keepdim)
    return P.cast(out, y.dtype)


@register(*spellings("mean"))
def mean(x, dim=None, keepdim=False, *, dtype=None):
    y = P.cast(x, dtype) if dtype is not None else x
    if not y.dtype.is_floating_point:
        raise Unsupported("mean of integers")
    dims = P.norm_dims(dims_arg(dim), y.ndim)
    count = math.prod(y.shape[d] for d in dims)
    out = P.div(P.sum(upcast(y), dims, keepdim), count)
    return P.cast(out, y.dtype)


@register(*spellings("prod"))
def prod(x, dim=None, keepdim=False, *, dtype=None):
    y = P.cast(x, dtype if dtype is not None else (x.dtype if x.dtype.is_floating_point else torch.int64))
    return P.cast(P.prod(upcast(y), dim, keepdim), y.dtype)


@register(*spellings("amax"))
def amax(x, dim=(), keepdim=False):
    return P.amax(x, dims_arg(dim), keepdim)


@register(*spellings("amin"))
def amin(x, dim=(), keepdim=False):
    return P.amin(x, dims_arg(dim), keepdim)


def _max_min(p_reduce, p_binary, p_arg):
    def fn(x, dim=None, keepdim=False):
        if isinstance(dim, TVal):
            return p_binary(x, dim)
        if dim is None:
            values = p_reduce(x, None, False)
            if not x.dtype.is_floating_point:
                return values
            # as ATen's (evenly_distribute_backward): the gradient shared by the elements equal to
            # the extreme, or by the NaNs where it is NaN (amax's `x == out` has none: NaN for all)
            nan = P.ne(values, values)
            hit = P.where(nan, P.ne(x, x), P.eq(x, values))
            picked = P.div(P.sum(P.where(hit, x, 0.0)), P.sum(P.cast(hit, x.dtype)))
            return emit(prim.with_value, picked, P.cast(values, picked.dtype))
        index = _index_of_extreme(p_reduce, p_arg)(x, dim, keepdim)
        values = p_reduce(x, dim, keepdim)
        if not x.dtype.is_floating_point or x.ndim == 0:
            return values, index
        # the gradient goes to the element at the index, as ATen's (not shared among ties, nor NaN
        # where the extreme is NaN, as amax/amin's)
        d = dim % x.ndim
        at = index if keepdim else P.unsqueeze(index, d)
        positions = P.reshape(P.iota(x.shape[d]), [x.shape[d] if i == d else 1 for i in range(x.ndim)])
        picked = P.sum(P.where(P.eq(positions, at), x, 0.0), d, keepdim)
        return emit(prim.with_value, picked, P.cast(values, picked.dtype)), index
    return fn


register(*spellings("max"))(_max_min(P.amax, P.maximum, prim.argmax))
register(*spellings("min"))(_max_min(P.amin, P.minimum, prim.argmin))


def _index_of_extreme(p_reduce, p_arg):
    """argmax/argmin along `dim` as two reductions: the extreme (`p_reduce`: P.amax or P.amin),
    then the least position holding it, a NaN being the extreme of a row that has one (its first
    position, as ATen's). Kernels, which the scheduler fuses and splits where rows are long: ATen's
    argmax of a decode step's 128256 logits took 37 us on an H200. A dim of no elements (eager
    raises) or of a symbolic size stays ATen's call (`p_arg`)."""
    def fn(x, dim, keepdim):
        d = dim % max(x.ndim, 1)
        n = x.shape[d] if x.ndim else 1
        if not isinstance(n, int) or n == 0 or x.ndim == 0:
            return emit(p_arg, P.cast(x, torch.uint8) if x.dtype == torch.bool else x, dim, keepdim)
        v = P.cast(x, torch.uint8) if x.dtype == torch.bool else x  # (the first True is the first 1)
        extreme = p_reduce(v, d, True)
        hit = P.eq(v, extreme)
        if v.dtype.is_floating_point:
            hit = P.logical_or(hit, P.logical_and(P.ne(v, v), P.ne(extreme, extreme)))
        positions = P.reshape(P.iota(n), [n if i == d else 1 for i in range(x.ndim)])
        return P.amin(P.where(hit, positions, n), d, keepdim)
    return fn


def _arg_extreme(p_reduce, p_arg):
    index = _index_of_extreme(p_reduce, p_arg)

    def fn(x, dim=None, keepdim=False):
        if dim is None:  # index into the flattened tensor
            x, dim, keepdim = P.reshape(x, (-1,)), 0, False
        if x.dtype == torch.bool:  # (ATen's call raises, as eager does)
            return emit(p_arg, x, dim, keepdim)
        return index(x, dim, keepdim)
    return fn


register(*spellings("argmax"))(_arg_extreme(P.amax, prim.argmax))
register(*spellings("argmin"))(_arg_extreme(P.amin, prim.argmin))


@register(*spellings("any"))
def any_(x, dim=None, keepdim=False):
    return P.cast(P.amax(P.cast(P.ne(x, 0), torch.int32), dims_arg(dim), keepdim), torch.bool)


@register(*spellings("all"))
def all_(x, dim=None, keepdim=False):
    return P.cast(P.amin(P.cast(P.ne(x, 0), torch.int32), dims_arg(dim), keepdim), torch.bool)


def _correction(unbiased, correction):
    if correction is not None:
        return correction
    return 1 if unbiased in (None, True) else 0


@register(*spellings("var"))
def var(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    y = upcast(x)
    dims = P.norm_dims(dims_arg(dim), y.ndim)
    count = math.prod(y.shape[d] for d in dims)
    centered = P.sub(y, P.div(P.sum(y, dims, True), count))
    dof = builtins.max(count - _correction(unbiased, correction), 0)
    out = P.div(P.sum(P.mul(centered, centered), dims, keepdim), dof)
    return P.cast(out, x.dtype)


@register(*spellings("std"))
def std(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return P.cast(P.sqrt(upcast(var(x, dim, unbiased, keepdim, correction=correction))), x.dtype)


@register(*spellings("var_mean"))
def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(dim, bool):  # torch.var_mean(x, unbiased): the overload without a dim
        dim, unbiased = None, dim
    return var(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def stabilizer(m):
    """The row maximum that softmax, log_softmax and logsumexp subtract for range: their values
    do not depend on it, so neither do their gradients (ATen's closed-form backwards have no
    term for it). Without a gradient path, the backward computes no tie count of the maximum
    and no second row sum (GPT-2's loss: two reductions over a 50257-wide row less)."""
    return emit(prim.stop_gradient, m)


@register(*spellings("logsumexp"))
def logsumexp(x, dim, keepdim=False):
    # integers and bools: computed in the default float dtype (torch's integer-to-float promotion)
    dtype = x.dtype if x.dtype.is_floating_point else torch.get_default_dtype()
    y = upcast(P.cast(x, dtype))
    m = P.amax(y, dim, True)
    m = stabilizer(P.where(P.eq(P.abs(m), math.inf), 0.0, m))
    out = P.add(P.log(P.sum(P.exp(P.sub(y, m)), dim, True)), m)
    return P.cast(out if keepdim else P.squeeze_dims(out, P.norm_dims(dim, y.ndim)), dtype)


@register(*spellings("norm"), torch.linalg.vector_norm)
def norm(x, p=2, dim=None, keepdim=False, dtype=None, ord=None):
    if (ord if ord is not None else p) not in (2, 2.0, "fro") or dtype is not None:
        raise Unsupported("norm other than 2")
    y = upcast(x)
    return P.cast(P.sqrt(P.sum(P.mul(y, y), dims_arg(dim), keepdim)), x.dtype)


# --- softmax ---------------------------------------------------------------------------------------
@register(*spellings("softmax", functional=True), torch.special.softmax)
def softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("softmax without dim")
    y = upcast(P.cast(x, dtype) if dtype is not None else x)
    e = P.exp(P.sub(y, stabilizer(P.amax(y, dim, True))))
    return P.cast(P.div(e, P.sum(e, dim, True)), dtype or x.dtype)


@register(*spellings("log_softmax", functional=True))
def log_softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("log_softmax without dim")
    y = upcast(P.cast(x, dtype) if dtype is not None else x)
    shifted = P.sub(y, stabilizer(P.amax(y, dim, True)))
    return P.cast(P.sub(shifted, P.log(P.sum(P.exp(shifted), dim, True))), dtype or x.dtype)


# ATen's forms, as a composite's ATen ops recorded under autocast reach graphs (capture/autocast.py)
@register(torch.ops.aten._softmax.default)
def aten_softmax(x, dim, half_to_float):
    return softmax(x, dim, dtype=torch.float32 if half_to_float else None)


@register(torch.ops.aten._log_softmax.default)
def aten_log_softmax(x, dim, half_to_float):
    return log_softmax(x, dim, dtype=torch.float32 if half_to_float else None)
