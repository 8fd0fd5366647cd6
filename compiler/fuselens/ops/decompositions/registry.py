"""The decomposition registry: torch-level callables mapped to functions of primitives.

A function is registered for every spelling capture may produce (`spellings`, `tensor_method`);
it raises `Unsupported` for arguments it does not handle, or returns `Written` for a call that
writes into its tensor arguments. Each module of this package registers its own; the package's
`__init__` imports them all.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECOMPOSITIONS: dict = {}


class Unsupported(Exception):
    """This decomposition does not handle these arguments: call the torch op as an extern."""


def register(*targets):
    def deco(fn):
        for t in targets:
            DECOMPOSITIONS[t] = _as_method(t, fn)
        return fn
    return deco


def _self_after_others() -> dict:
    """{op name: its schema's argument names}, for ops whose `self` is not the first argument:
    `Tensor.where(condition, other)` is `torch.where(condition, self, other)`, `Tensor.polygamma(n)`
    is `torch.polygamma(n, self)` (read from the operator schemas, not listed by hand)."""
    if not hasattr(_self_after_others, "cache"):
        out = {}
        for s in torch._C._jit_get_all_schemas():
            names = [a.name for a in s.arguments if not a.kwarg_only]
            if s.name.startswith("aten::") and "self" in names[1:]:
                out.setdefault(s.name[6:], names)
        _self_after_others.cache = out
    return _self_after_others.cache


def _as_method(target, fn):
    """`fn` (written for the torch.<name> spelling) as the decomposition of `target`: where
    target is the Tensor method of an op whose schema puts `self` after other arguments, the
    method's receiver goes to that place (its other arguments by their schema names)."""
    name = getattr(target, "__name__", None)
    names = _self_after_others().get(name)
    if names is None or getattr(torch.Tensor, name, None) is not target:
        return fn
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    sig = inspect.Signature([inspect.Parameter(n, kind) for n in ["self"] + [n for n in names if n != "self"]])

    def method(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        return fn(*(bound.arguments[n] for n in names))
    method.__signature__ = sig  # (what decompose() binds a call's arguments against)
    method.in_schema_order = fn  # (an ATen overload's call: its arguments are in the schema's order)
    return method


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
