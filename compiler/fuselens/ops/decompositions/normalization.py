"""Normalizations as primitives: layer norm, RMS norm, batch norm (inference and training),
instance and group norm.

Training batch norm writes its running statistics: the decomposition returns their new values
as `Written` (capture's functionalization hands the call over as `OnCopies`, whose results are
the written tensors' new values, then the output; trace.py matches them). Its gradient is the
closed form of ATen's backward (`with_vjp`), so the backward's reductions are sum(g) and
sum(g * xhat) over one domain: one kernel, fused with the ReLU backward that produces g.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import builder as P
from .. import primitives as prim
from ..builder import emit
from .conventions import is_half, upcast
from .registry import Unsupported, Written, register


def _normalized_dims(x, normalized_shape):
    n = len(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size)) else 1
    return tuple(range(x.ndim - n, x.ndim))


@register(F.layer_norm)
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    y = upcast(x)
    dims = _normalized_dims(x, normalized_shape)
    count = math.prod(x.shape[d] for d in dims)
    centered = P.sub(y, P.div(P.sum(y, dims, True), count))
    var_ = P.div(P.sum(P.mul(centered, centered), dims, True), count)
    out = P.mul(centered, P.rsqrt(P.add(var_, eps)))
    if weight is not None:
        out = P.mul(out, weight)
    if bias is not None:
        out = P.add(out, bias)
    return P.cast(out, x.dtype)


if hasattr(F, "rms_norm"):
    @register(F.rms_norm)
    def rms_norm(x, normalized_shape, weight=None, eps=None):
        y = upcast(x)
        dims = _normalized_dims(x, normalized_shape)
        count = math.prod(x.shape[d] for d in dims)
        eps = torch.finfo(y.dtype).eps if eps is None else eps  # ATen's: of the compute dtype
        # as ATen's composite: normalized in fp32, rounded to x's dtype, then scaled
        out = P.cast(P.mul(y, P.rsqrt(P.add(P.div(P.sum(P.mul(y, y), dims, True), count), eps))), x.dtype)
        return out if weight is None else P.mul(out, weight)


@register(F.batch_norm)
def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """Inference (running statistics): one pointwise expression, which fuses with the ReLU and
    residual add around it (cuDNN's inference kernel is a pass of its own). Training (batch
    statistics, also nn.BatchNorm's eval without running statistics): the per-channel mean and
    biased variance over every dim but the channels (`_normalize_batch`); the running
    statistics, if given, updated as ATen does (`Written`)."""
    if x.ndim < 2 or not x.dtype.is_floating_point or not isinstance(momentum, (int, float)) \
            or (running_mean is None) != (running_var is None):
        raise Unsupported("batch_norm of these arguments")
    w, b = _per_channel(x, weight), _per_channel(x, bias)
    if not training:
        if running_mean is None:
            raise Unsupported("batch_norm in inference without running statistics")  # eager raises
        mean, rstd = _per_channel(x, running_mean), P.rsqrt(P.add(_per_channel(x, running_var), eps))
        return P.cast(_affine(P.mul(P.sub(upcast(x), mean), rstd), w, b), x.dtype)
    dims = (0,) + tuple(range(2, x.ndim))
    y, mean, unbiased_var = _normalize_batch(x, dims, w, b, eps)
    if running_mean is None:
        return y
    c = (x.shape[1],)
    return Written(y, [(running_mean, _running(P.reshape(mean, c), running_mean, momentum)),
                       (running_var, _running(P.reshape(unbiased_var, c), running_var, momentum))])


@register(torch.batch_norm)
def torch_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    return batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


@register(F.instance_norm)
def instance_norm(x, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                  momentum=0.1, eps=1e-5):
    """Batch norm of each sample on its own (ATen's: batch norm of x viewed as [1, N*C, ...],
    the running statistics repeated per sample): statistics per (sample, channel) over the
    spatial dims; the running statistics, updated per sample as batch norm's, averaged over the
    samples."""
    if not use_input_stats:  # the running statistics: batch norm's inference
        return batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    if x.ndim < 3 or not x.dtype.is_floating_point or not isinstance(momentum, (int, float)) \
            or (running_mean is None) != (running_var is None):
        raise Unsupported("instance_norm of these arguments")
    if is_half(x.dtype):
        # ATen's CPU kernel keeps the statistics of a half-precision instance norm in its dtype
        # and rounds them: results differ from statistics kept in fp32 by an ulp of x where the
        # output cancels (OpInfo's samples); not reproduced here, the extern keeps eager's
        raise Unsupported("half-precision instance_norm")
    y, mean, unbiased_var = _normalize_batch(x, tuple(range(2, x.ndim)), _per_channel(x, weight),
                                             _per_channel(x, bias), eps)
    if running_mean is None:
        return y
    new = []
    for s, r in ((mean, running_mean), (unbiased_var, running_var)):
        per_sample = _running(P.reshape(s, x.shape[:2]), r, momentum)
        new.append(P.cast(P.div(P.sum(upcast(per_sample), (0,)), x.shape[0]), r.dtype))
    return Written(y, [(running_mean, new[0]), (running_var, new[1])])


@register(torch.instance_norm)
def torch_instance_norm(x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn_enabled):
    return instance_norm(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


@register(F.group_norm)
def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """Each sample's channels in `num_groups` groups, each normalized over its channels and the
    spatial dims: batch norm's statistics on x viewed as [N, G, C/G, *spatial] (one reduction
    kernel; the channel dim split, not merged with the spatial ones, so a channels-last x keeps
    its layout and is reduced in memory order), then the per-channel affine, in fp32 and rounded
    once as ATen's kernels do. The gradient of an affine GroupNorm is ATen's backward's
    (`_GroupNormVJP`); without weight and bias, batch norm's closed form over the groups' rows,
    which one persistent kernel reduces and differentiates where the rows are short."""
    if x.ndim < 2 or not x.dtype.is_floating_point or not isinstance(num_groups, int) or num_groups <= 0 \
            or x.shape[1] % num_groups or 0 in x.shape:
        raise Unsupported("group_norm of these arguments")  # (the torch call raises eager's error)
    xf = upcast(x)
    grouped = P.reshape(xf, (x.shape[0], num_groups, x.shape[1] // num_groups, *x.shape[2:]))
    dims = tuple(range(2, grouped.ndim))
    n = math.prod(grouped.shape[d] for d in dims)
    mean, var = _batch_stats(grouped, dims, n)
    rstd = P.rsqrt(P.add(var, eps))
    normalized = P.mul(P.sub(grouped, mean), rstd)
    if weight is None and bias is None:
        y = emit(prim.with_vjp, normalized, [grouped, mean, rstd, None, None], _BatchNormVJP(dims, n))
        return P.cast(P.reshape(y, x.shape), x.dtype)
    w, b = _per_channel(x, weight), _per_channel(x, bias)
    y = _affine(P.reshape(normalized, x.shape), w, b)
    return P.cast(emit(prim.with_vjp, y, [xf, mean, rstd, w, b], _GroupNormVJP(num_groups)), x.dtype)


class _GroupNormVJP:
    """The gradients of GroupNorm's y = (x - mean) * rstd * w + b as ATen's backward kernels
    compute them: per sample and channel, ds = sum(g * x) and db = sum(g) over the spatial dims
    (one pass over g and x: a channels-last x's columns), then from those alone the weight's
    and bias's gradients and per sample and group c2, c3, with dx = rstd * w * g + c2 * x + c3
    (the second pass). Derived from the normalization and the affine apart, the weight's
    gradient was a reduction of its own over g and x, a third pass where the groups' rows are
    too long for one persistent kernel (a UNet's, a GroupNorm ResNet's), and g was stored in fp32
    between the groups' sums and dx."""

    def __init__(self, groups):
        self.groups = groups

    def __call__(self, g, xf, mean, rstd, w, b):
        n, c, groups = xf.shape[0], xf.shape[1], self.groups
        spatial, d = tuple(range(2, xf.ndim)), c // groups
        per_group = lambda v: P.reshape(v, (n, groups, d))  # noqa: E731
        over_spatial = lambda v: P.sum(v, spatial) if spatial else v  # noqa: E731  (an (N, C) x: none)
        ds, db = per_group(over_spatial(P.mul(g, xf))), per_group(over_spatial(g))
        mean, rstd = P.reshape(mean, (n, groups, 1)), P.reshape(rstd, (n, groups, 1))
        gamma = None if w is None else P.reshape(w, (1, groups, d))
        weighted = lambda v: v if gamma is None else P.mul(v, gamma)  # noqa: E731
        sum1, sum2 = P.sum(weighted(ds), (2,), True), P.sum(weighted(db), (2,), True)
        s = 1.0 / (d * math.prod(xf.shape[2:]))
        c2 = P.mul(P.mul(P.mul(P.mul(P.sub(P.mul(sum2, mean), sum1), rstd), rstd), rstd), s)
        c3 = P.sub(P.mul(P.neg(c2), mean), P.mul(P.mul(sum2, rstd), s))
        per_channel = lambda v: P.reshape(P.expand(v, (n, groups, d)), (n, c) + (1,) * len(spatial))  # noqa: E731
        dx = P.add(P.add(P.mul(per_channel(weighted(rstd)), g), P.mul(per_channel(c2), xf)), per_channel(c3))
        dw = None if w is None else P.reshape(P.sum(P.mul(P.sub(ds, P.mul(db, mean)), rstd), (0,)), w.shape)
        return [dx, None, None, dw, None if b is None else P.reshape(P.sum(db, (0,)), b.shape)]

    def __repr__(self):
        return f"group_norm_vjp(groups={self.groups})"


@register(torch.group_norm)
def torch_group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return group_norm(x, num_groups, weight, bias, eps)


def _per_channel(x, t):
    """A per-channel tensor in fp32, shaped to broadcast against x ([C, 1, ...])."""
    return None if t is None else P.reshape(upcast(t), (x.shape[1],) + (1,) * (x.ndim - 2))


def _normalize_batch(x, dims, w, b, eps):
    """x normalized by its statistics over `dims`, in fp32 (ATen's accumulate type), with the
    gradient of ATen's backward (`_BatchNormVJP`); and those statistics, detached (eager updates
    running statistics without autograd): the mean and the unbiased variance."""
    n = math.prod(x.shape[d] for d in dims)
    if n <= 1:  # eager raises for one value per channel (or instance); none gives NaN statistics
        raise Unsupported("normalization over at most one value")
    xf = upcast(x)
    mean, var = _batch_stats(xf, dims, n)
    rstd = P.rsqrt(P.add(var, eps))
    y = emit(prim.with_vjp, _affine(P.mul(P.sub(xf, mean), rstd), w, b), [xf, mean, rstd, w, b],
             _BatchNormVJP(dims, n))
    stats = (emit(prim.stop_gradient, mean), emit(prim.stop_gradient, P.mul(var, n / (n - 1))))
    return (P.cast(y, x.dtype),) + stats


def _running(stat, running, momentum):
    """ATen's running-statistic update, in fp32, stored in the statistic's dtype."""
    return P.cast(P.add(P.mul(stat, momentum), P.mul(upcast(running), 1 - momentum)), running.dtype)


def _batch_stats(xf, dims, n):
    """Mean and biased variance over `dims`, from one pass over x: sums of d = x - k and of d^2,
    k being the channel's first element (shifted, the variance E[d^2] - E[d]^2 loses no
    precision to a mean far from 0). Two sums of one input over one domain share a kernel; a
    variance from x - mean would need the mean first, a second pass over x."""
    k = xf
    for d in dims:
        k = P.slice(k, d, 0, 1)
    shifted = P.sub(xf, k)
    m1 = P.div(P.sum(shifted, dims, True), n)
    m2 = P.div(P.sum(P.mul(shifted, shifted), dims, True), n)
    return P.add(k, m1), P.maximum(P.sub(m2, P.mul(m1, m1)), 0.0)


def _affine(y, w, b):
    y = y if w is None else P.mul(y, w)
    return y if b is None else P.add(y, b)


class _BatchNormVJP:
    """The gradients of y = (x - mean) * rstd * w + b, mean and rstd being x's batch statistics
    over `dims` (`n` values per channel), as ATen's backward kernels compute them (CPU and CUDA
    alike): two reductions, sum(g) and sum(g * (x - mean)), and
    dx = (g - sum(g) / n - (x - mean) * sum(g * (x - mean)) * rstd^2 / n) * rstd * w."""

    def __init__(self, dims, n):
        self.dims, self.n = dims, n

    def __call__(self, g, xf, mean, rstd, w, b):
        centered = P.sub(xf, mean)
        sum_g = P.sum(g, self.dims, True)
        sum_g_centered = P.sum(P.mul(g, centered), self.dims, True)
        proj = P.mul(P.div(sum_g_centered, self.n), P.mul(rstd, rstd))
        scale = rstd if w is None else P.mul(rstd, w)
        dx = P.mul(P.sub(P.sub(g, P.div(sum_g, self.n)), P.mul(centered, proj)), scale)
        dw = None if w is None else _per_channel_grad(P.mul(sum_g_centered, rstd), w.shape)
        return [dx, None, None, dw, None if b is None else _per_channel_grad(sum_g, b.shape)]

    def __repr__(self):
        return f"batch_norm_vjp(dims={self.dims}, n={self.n})"


def _per_channel_grad(g, shape):
    """A per-channel gradient in the weight's shape as given (C, 1, ...): summed over the samples
    where the statistics are per sample (instance norm), else a view."""
    return P.reshape(g, shape) if math.prod(g.shape) == math.prod(shape) else P.sum_to(g, shape)
