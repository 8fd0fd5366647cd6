"""New tensors: filled (full, zeros, ones, their _like and new_ forms) and ranges (arange)."""
from __future__ import annotations

import builtins
import math

import torch

from .. import builder as P
from .conventions import check_device, shape_arg
from .registry import register, tensor_method


def _creation_dtype(dtype, value=0.0):
    if dtype is not None:
        return dtype
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, int) else torch.get_default_dtype()


@register(torch.full)
def full(size, fill_value, *, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
    check_device(device)
    return P.full(tuple(size), fill_value, _creation_dtype(dtype, fill_value))


def _filled(value):
    def fn(*size, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False, memory_format=None):
        check_device(device)
        return P.full(shape_arg(size), value, dtype or torch.get_default_dtype())
    return fn


register(torch.zeros, torch.empty)(_filled(0))
register(torch.ones)(_filled(1))


def _filled_like(value):
    def fn(x, *rest, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False,
           memory_format=None, fill_value=None):
        v = rest[0] if rest else (fill_value if fill_value is not None else value)
        check_device(device)
        return P.full(x.shape, v, dtype or x.dtype)
    return fn


register(torch.zeros_like, torch.empty_like)(_filled_like(0))
register(torch.ones_like)(_filled_like(1))
register(torch.full_like)(_filled_like(None))


def _new_filled(value):
    def fn(x, *size, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
        check_device(device)
        return P.full(shape_arg(size), value, dtype or x.dtype)
    return fn


register(tensor_method("new_zeros"), tensor_method("new_empty"))(_new_filled(0))
register(tensor_method("new_ones"))(_new_filled(1))


@register(torch.arange)
def arange(start, end=None, step=1, *, dtype=None, device=None, layout=None, pin_memory=False,
           requires_grad=False):
    check_device(device)
    if end is None:
        start, end = 0, start
    length = builtins.max(math.ceil((end - start) / step), 0)
    if dtype is None:
        dtype = torch.int64 if builtins.all(isinstance(v, int) for v in (start, end, step)) else \
            torch.get_default_dtype()
    if dtype.is_floating_point:
        return P.add(P.mul(P.cast(P.iota(length), dtype), step), start)
    # an integer dtype: torch truncates start, end and step to integers first; for int64 the
    # length comes from them too (integer division rounding to zero), as its kernel computes it
    start, end, step = int(start), int(end), int(step)
    if dtype == torch.int64:
        n = end - start + step - (step > 0) + (step < 0)
        length = builtins.max(abs(n) // abs(step) * (1 if (n >= 0) == (step > 0) else -1), 0)
    return P.iota(length, start, step, dtype=dtype)
