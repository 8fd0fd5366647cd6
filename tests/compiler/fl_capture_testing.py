"""Helpers for the capture tests: run a function eagerly and compiled on copies of the same
inputs, compare results and input mutations, and count graphs/breaks with explain."""
from __future__ import annotations

import collections.abc
import math
from collections import OrderedDict

import pytest
import torch

import fuselens


def clone_tree(v):
    if isinstance(v, torch.Tensor):
        c = v.detach().clone()
        c.requires_grad_(v.requires_grad)
        return c
    if isinstance(v, tuple):
        items = [clone_tree(x) for x in v]  # a named tuple or a structseq keeps its type
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, list):
        return [clone_tree(x) for x in v]
    if type(v) is OrderedDict:
        return OrderedDict((k, clone_tree(x)) for k, x in v.items())
    if isinstance(v, dict):
        return {k: clone_tree(x) for k, x in v.items()}
    return v


def perturbed(v, gen):
    """clone_tree(v) with new values in its floating-point tensors (same shapes, layouts and
    requires_grad): a graph that kept an input's values as constants gives the first call's
    results here."""
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.layout == torch.strided and v.numel():
        c = v.detach().clone()
        with torch.no_grad():
            c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))
        return c.requires_grad_(v.requires_grad)
    if isinstance(v, tuple):
        items = [perturbed(x, gen) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, list):
        return [perturbed(x, gen) for x in v]
    if type(v) is OrderedDict:
        return OrderedDict((k, perturbed(x, gen)) for k, x in v.items())
    if isinstance(v, dict):
        return {k: perturbed(x, gen) for k, x in v.items()}
    return clone_tree(v)


def assert_same(got, expected):
    """Values and structure (tuple/list/dict nesting) are the same."""
    assert type(got) is type(expected) or (isinstance(got, torch.Tensor)
                                           and isinstance(expected, torch.Tensor)), \
        f"{type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for k in expected:
            assert_same(dict.__getitem__(got, k), dict.__getitem__(expected, k))
        if hasattr(expected, "__dict__"):  # a dict subclass with attributes (ModelOutput)
            assert_same(vars(got), vars(expected))
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, equal_nan=True)
        assert got.requires_grad == expected.requires_grad, \
            f"requires_grad: compiled {got.requires_grad}, eager {expected.requires_grad}"
    elif isinstance(expected, float) and math.isnan(expected):  # a NaN read into Python
        assert isinstance(got, float) and math.isnan(got), f"{got!r} where eager has nan"
    elif hasattr(expected, "__dict__") and type(expected).__module__ not in ("builtins", "torch"):
        assert_same(vars(got), vars(expected))  # an object of a Python class: what it holds
    else:
        assert got == expected, f"{got!r} where eager has {expected!r}"


def check(fn, *args, graphs=None, breaks=None, calls=2, seed=0, **kwargs):
    """`fn(*args, **kwargs)` compiled == eager (result and mutated inputs), on `calls` calls
    (the second one hits the cache). With `graphs`/`breaks`, also checks explain's counts;
    `breaks` is a list of codes. Returns (compiled function, explanation or None)."""
    torch.manual_seed(seed)
    eager_args, eager_kwargs = clone_tree(args), clone_tree(kwargs)
    expected = fn(*eager_args, **eager_kwargs)
    cf = fuselens.compile(fn)
    n_entries = None
    for i in range(calls):
        torch.manual_seed(seed)
        c_args, c_kwargs = clone_tree(args), clone_tree(kwargs)
        got = cf(*c_args, **c_kwargs)
        assert_same(got, expected)
        assert_same(c_args, eager_args)  # input mutation happens in compiled code too
        assert_same(c_kwargs, eager_kwargs)
        n = len(fuselens.inspect(cf))
        if n_entries is not None:
            assert n == n_entries, "a second call with the same inputs recompiled"
        n_entries = n
    # other values of the same shapes: compiled == eager again (nothing of the first call's
    # values kept as a constant)
    gen = torch.Generator().manual_seed(seed + 1)
    p_args, p_kwargs = perturbed(args, gen), perturbed(kwargs, gen)
    e_args, e_kwargs = clone_tree(p_args), clone_tree(p_kwargs)
    torch.manual_seed(seed)
    try:
        expected = fn(*e_args, **e_kwargs)
    except Exception as e:  # noqa: BLE001 (values where eager raises: the compiled call raises the same)
        torch.manual_seed(seed)
        with pytest.raises(type(e)):
            cf(*p_args, **p_kwargs)
    else:
        torch.manual_seed(seed)
        assert_same(cf(*p_args, **p_kwargs), expected)
        assert_same(p_args, e_args)
    ex = None
    if graphs is not None or breaks is not None:
        torch.manual_seed(seed)
        ex = fuselens.explain(fn, *clone_tree(args), **clone_tree(kwargs))
        if graphs is not None:
            assert len(ex.graphs) == graphs, str(ex)
        if breaks is not None:
            assert [b.code for b in ex.graph_breaks] == list(breaks), str(ex)
    return cf, ex


def line_of(fn, text, nth=0):
    """The file line number of the `nth` line of `fn`'s source containing `text`."""
    import inspect
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, l in enumerate(lines) if text in l]
    return hits[nth]


class DictMapping(collections.abc.Mapping):
    """A user's mapping over a dict: its own `__getitem__`; Mapping's `get`, `__contains__`...
    (frozen in Python 3.11's standard library: read from the standard library's file)."""

    def __init__(self, d):
        self.d = d

    def __getitem__(self, k):
        return self.d[k]

    def __iter__(self):
        return iter(self.d)

    def __len__(self):
        return len(self.d)
