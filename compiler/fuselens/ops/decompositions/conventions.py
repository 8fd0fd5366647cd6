"""What decompositions share with eager: half precision computed in fp32, torch's spellings of
shapes, dims and pairs, arguments on another device refused."""
from __future__ import annotations

import builtins
import functools

import torch

from .. import builder as P
from ..builder import TVal
from .registry import Unsupported


def is_half(dtype):
    return dtype in (torch.float16, torch.bfloat16)


def upcast(x):
    """Half-precision math runs in fp32 (as ATen's kernels do internally)."""
    return P.cast(x, torch.float32) if isinstance(x, TVal) and is_half(x.dtype) else x


def opmath(fn):
    """A decomposition of one ATen kernel written with several primitives: computed in fp32 for
    half-precision tensors and rounded once, as the kernel does (each primitive's result is
    rounded to its dtype, so in half precision the steps would round each time)."""
    @functools.wraps(fn)  # its signature is what decompose() checks arguments against
    def wrapper(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, TVal)]
        if not builtins.any(is_half(t.dtype) for t in tensors):
            return fn(*args, **kwargs)
        dtype = P.result_type(*tensors)
        return P.cast(fn(*[upcast(a) for a in args], **kwargs), dtype)
    return wrapper


def shape_arg(args):
    """torch.zeros(2, 3) and torch.zeros((2, 3)) both mean shape (2, 3)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def both_python(a, b):
    return not isinstance(a, TVal) and not isinstance(b, TVal)


def dims_arg(dim):
    if dim is None or isinstance(dim, int):
        return dim
    return tuple(dim)


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def check_device(device):
    if device is not None and torch.device(device).type != P.builder().device.type:
        raise Unsupported("tensor created on another device")
