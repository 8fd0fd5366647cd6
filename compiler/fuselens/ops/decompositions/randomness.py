"""Random tensors (rand, randn and their _like forms) and dropout: primitives drawing from the
graph's seed, each call on its own stream."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import builder as P
from .. import primitives as prim
from ..builder import emit
from .conventions import check_device, shape_arg
from .registry import Unsupported, register


def random(kind, shape, dtype):
    b = P.builder()
    seed = b.seed()
    out = emit(prim.PRIMITIVES[kind], seed, tuple(shape), dtype=torch.float32, device=b.device,
               stream=b.next_stream())
    return P.cast(out, dtype)


def _random_creation(kind):
    def fn(*size, generator=None, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
        if generator is not None:
            raise Unsupported("explicit generator")
        check_device(device)
        return random(kind, shape_arg(size), dtype or torch.get_default_dtype())
    return fn


register(torch.rand)(_random_creation("rand"))
register(torch.randn)(_random_creation("randn"))
register(torch.rand_like)(lambda x, dtype=None, **kw: random("rand", x.shape, dtype or x.dtype))
register(torch.randn_like)(lambda x, dtype=None, **kw: random("randn", x.shape, dtype or x.dtype))


@register(F.dropout, torch.dropout)
def dropout(x, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return x
    if p == 1:
        return P.mul(x, 0)
    keep = P.ge(random("rand", x.shape, torch.float32), p)
    return P.where(keep, P.mul(x, 1 / (1 - p)), 0)
