"""The decomposition registry: torch-level callables mapped to functions of primitives.

A function is registered for every spelling capture may produce (`spellings`, `tensor_method`);
it raises `Unsupported` for arguments it does not handle, or returns `Written` for a call that
writes into its tensor arguments. Each module of this package registers its own; the package's
`__init__` imports them all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECOMPOSITIONS: dict = {}


class Unsupported(Exception):
    """This decomposition does not handle these arguments: call the torch op as an extern."""


def register(*targets):
    def deco(fn):
        for t in targets:
            DECOMPOSITIONS[t] = fn
        return fn
    return deco


def tensor_method(name):
    return getattr(torch.Tensor, name)


def spellings(*names, fn=True, method=True, functional=False):
    """The torch.<name>, torch.Tensor.<name> and F.<name> spellings of op names that exist."""
    out = []
    for n in names:
        for owner, use in ((torch, fn), (torch.Tensor, method), (F, functional)):
            if use and hasattr(owner, n):
                out.append(getattr(owner, n))
    return out


@dataclass
class Written:
    """What a decomposition of a call that writes into tensor arguments returns: the call's
    result, and (argument, its new value) for each argument it writes."""
    result: object
    writes: list


def register_c_method_spellings():
    """A few methods torch.Tensor overrides in Python (split, norm, ...) also reach graphs as the
    C method of torch._C.TensorBase: the same decomposition serves both."""
    for name in dir(torch.Tensor):
        python_fn, c_fn = getattr(torch.Tensor, name), getattr(torch._C.TensorBase, name, None)
        if c_fn is not None and c_fn is not python_fn and callable(python_fn) and python_fn in DECOMPOSITIONS:
            DECOMPOSITIONS.setdefault(c_fn, DECOMPOSITIONS[python_fn])
