"""Pooling. Adaptive average pooling (2-d, and 1-d as 2-d over one row) whose windows tile the input (ResNet's and most classifiers'
global pooling) is a mean over reshaped windows, fused with its neighbours; its gradient is the
mean's. 2-d max pooling is a primitive giving the values and each maximum's offset in its window,
which its backward reads (torch's autograd re-ran the forward: ~0.4 ms of host a call); lowering
computes both, and the backward, as window loops fused with their neighbours
(`Lowering._max_pool2d`). Other pooling stays torch's call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from .conventions import pair
from .reductions import mean
from .registry import Unsupported, register


@register(F.adaptive_avg_pool2d)
def adaptive_avg_pool2d(x, output_size):
    """Windows of equal size where the output size divides the input's (torch's adaptive windows
    are then exactly those): (N, C, oh, H/oh, ow, W/ow) averaged over the window dims."""
    if not isinstance(x, TVal) or x.ndim not in (3, 4) or not x.dtype.is_floating_point:
        raise Unsupported("adaptive_avg_pool2d of this input")
    h, w = x.shape[-2:]
    oh, ow = (s if s is not None else n for s, n in zip(pair(output_size), (h, w)))
    if not all(isinstance(n, int) for n in (h, w, oh, ow)) or not oh or not ow or h % oh or w % ow:
        raise Unsupported("adaptive windows of unequal sizes")
    lead = tuple(x.shape[:-2])
    windows = P.reshape(x, lead + (oh, h // oh, ow, w // ow))
    return mean(windows, (len(lead) + 1, len(lead) + 3))


@register(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d)
def adaptive_avg_pool1d(x, output_size):
    """The 2-d pooling over (1, L) (a Swin's or a speech model's pooled sequence)."""
    if not isinstance(x, TVal) or x.ndim not in (2, 3):
        raise Unsupported("adaptive_avg_pool1d of this input")
    size = output_size[0] if isinstance(output_size, (tuple, list)) else output_size
    return P.squeeze_dims(adaptive_avg_pool2d(P.unsqueeze(x, -2), (1, size)), (x.ndim - 1,))


@register(F.max_pool2d, torch.max_pool2d)
def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    if return_indices or not isinstance(x, TVal) or x.ndim not in (3, 4) or not x.dtype.is_floating_point:
        raise Unsupported("max_pool2d returning its indices, or of this input")
    stride = kernel_size if stride is None or stride == [] or stride == () else stride
    out, _ = emit(prim.max_pool2d, x, pair(kernel_size), pair(stride), pair(padding), pair(dilation),
                  bool(ceil_mode))
    return out
