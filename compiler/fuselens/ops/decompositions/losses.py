"""Losses: negative log-likelihood and cross entropy (class indices picked by a one-hot mask), MSE."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import builder as P
from .conventions import upcast
from .reductions import log_softmax, mean, stabilizer, sum_
from .registry import Unsupported, register


def _class_pick(logp, target, class_dim, weight, lse=None):
    """(-logp[target] * w[target], w[target]) per sample, via a one-hot mask over the class dim.
    With `lse` = (m, log(sum(exp(x - m)))), `logp` is the logits x and logp[target] is
    (x[target] - m) - log(...), as log_softmax computes it: the pick reads x, not log_softmax's
    result, so it is a reduction beside the maximum (one pass over a row less) and the
    gradient, softmax - one-hot, needs no row sum."""
    classes = logp.shape[class_dim]
    shape = [1] * logp.ndim
    shape[class_dim] = classes
    onehot = P.eq(P.reshape(P.iota(classes, dtype=target.dtype), shape), P.unsqueeze(target, class_dim))
    picked = P.sum(P.where(onehot, logp, 0.0), class_dim)
    if lse is not None:
        m, log_sum = (P.squeeze_dims(t, (class_dim,)) for t in lse)
        picked = P.sub(P.sub(picked, m), log_sum)
    picked = P.neg(picked)
    if weight is None:
        return picked, None
    w = P.sum(P.where(onehot, P.reshape(P.cast(weight, logp.dtype), shape), 0.0), class_dim)
    return P.mul(picked, w), w


@register(F.nll_loss)
def nll_loss(logp, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        raise Unsupported("legacy reduction arguments")
    class_dim = 1 if logp.ndim > 1 else 0
    return _nll(upcast(logp), target, weight, ignore_index, reduction, class_dim, None, logp.dtype)


def _nll(values, target, weight, ignore_index, reduction, class_dim, lse, dtype, with_total_weight=False):
    """The loss (and with `with_total_weight` ATen's second result: the weights of the targets
    counted, 0 for reduction "none")."""
    loss, w = _class_pick(values, target, class_dim, weight, lse)
    valid = P.ne(target, ignore_index)
    loss = P.where(valid, loss, 0.0)
    if reduction == "none":
        out, denom = loss, P.full((), 0.0, dtype)
    else:
        total = P.sum(loss)
        denom = P.sum(P.where(valid, w, 0.0)) if w is not None else P.sum(P.cast(valid, torch.float32))
        out = total if reduction == "sum" else P.div(total, denom)
    out = P.cast(out, dtype)
    return (out, P.cast(denom, dtype)) if with_total_weight else out


@register(torch.ops.aten.nll_loss_forward.default)
def nll_loss_forward(logp, target, weight, reduction, ignore_index):
    """ATen's nll_loss (what a cross entropy recorded under autocast calls: capture/autocast.py);
    `reduction` is ATen's enum: 0 none, 1 mean, 2 sum."""
    class_dim = 1 if logp.ndim > 1 else 0
    return _nll(upcast(logp), target, weight, ignore_index, ("none", "mean", "sum")[reduction], class_dim, None,
                logp.dtype, with_total_weight=True)


@register(F.cross_entropy)
def cross_entropy(x, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    if label_smoothing:
        raise Unsupported("label smoothing")
    class_dim = 1 if x.ndim > 1 else 0
    if not target.dtype.is_floating_point:  # class indices: picked from the logits (_class_pick)
        y = upcast(x)
        m = stabilizer(P.amax(y, class_dim, True))
        lse = (m, P.log(P.sum(P.exp(P.sub(y, m)), class_dim, True)))
        return P.cast(_nll(y, target, weight, ignore_index, reduction, class_dim, lse, y.dtype), x.dtype)
    if weight is not None:
        raise Unsupported("class weights with probability targets")
    loss = P.neg(P.sum(P.mul(log_softmax(upcast(x), class_dim), target), class_dim))
    n = math.prod(loss.shape)
    out = loss if reduction == "none" else (P.sum(loss) if reduction == "sum" else P.div(P.sum(loss), n))
    return P.cast(out, x.dtype)


@register(F.mse_loss)
def mse_loss(x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if weight is not None or size_average is not None or reduce is not None:
        raise Unsupported("mse_loss options")
    d = P.sub(x, target)
    sq = P.mul(d, d)
    return sq if reduction == "none" else (sum_(sq) if reduction == "sum" else mean(sq))
