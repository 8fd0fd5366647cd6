"""`associative_scan(combine_fn, xs, dim)` (torch._higher_order_ops), captured as ops of the graph.

Eager runs `generic_associative_scan`: pairs of neighbours combined along the scan dim, the
halved sequence scanned recursively, the odd and even results interleaved. Capture runs the same
recursion on the graph's values, `combine_fn` inlined on whole slices, so the scan's ops fuse with
the code around them (Mamba's selective scan: before, a break at each call). That is the op's own
reference for `combine_mode="pointwise"`, whose contract is a combine function of pointwise ops.
For `"generic"`, eager calls `torch.vmap(combine_fn)` on the slices: the same values where
`combine_fn` is pointwise, which capture checks on the ATen operators its ops reach (their
`pointwise` tag, PyTorch's data); another combine function is a break, run by eager."""
from __future__ import annotations

import inspect
import operator

import torch
import torch.utils._pytree as pytree

from . import breaks as B
from .values import NOT_HANDLED, LocalFunction, TensorVar

try:  # (torch's prototype; absent, nothing to capture)
    from torch._higher_order_ops.associative_scan import associative_scan as ASSOCIATIVE_SCAN
except ImportError:  # pragma: no cover
    ASSOCIATIVE_SCAN = None

_KEEPS_VALUES = {torch.ops.aten.expand.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default}


def associative_scan(ev, fn, args, kwargs, e, scope):
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return NOT_HANDLED
    bound.apply_defaults()
    combine, xs, dim, reverse, mode = (bound.arguments[k] for k in
                                       ("combine_fn", "xs", "dim", "reverse", "combine_mode"))
    leaves, spec = pytree.tree_flatten(xs)
    if ev.abstract or not (callable(combine) or isinstance(combine, LocalFunction)) or not leaves \
            or not all(isinstance(t, TensorVar) and t.meta is not None for t in leaves) \
            or type(dim) is not int or type(reverse) is not bool or mode not in ("pointwise", "generic") \
            or mode == "pointwise" and any(t.device.type not in ("cuda", "xpu") for t in leaves) \
            or len({tuple(t.meta.shape) for t in leaves}) != 1 or not -leaves[0].meta.dim() <= dim < leaves[0].meta.dim() \
            or leaves[0].meta.shape[dim] == 0:
        return NOT_HANDLED  # (eager's error, or what eager does with it, where Python runs it)
    dim %= leaves[0].meta.dim()

    def op(f, *a):
        return ev.op(f, list(a), {}, e, scope)

    def call(lhs, rhs):
        start = _last_node(ev)
        out = pytree.tree_leaves(ev.call(combine, [pytree.tree_unflatten(lhs, spec),
                                                   pytree.tree_unflatten(rhs, spec)], {}, e, scope))
        if len(out) != len(lhs) or not all(isinstance(t, TensorVar) and t.meta is not None
                                           and t.meta.shape == a.meta.shape for t, a in zip(out, lhs)):
            ev.brk(B.UNSUPPORTED_EXPR, e, scope, whole_stmt=True, detail="associative_scan: its combine "
                   "function returns other than one tensor of its input's shape per input")
        if mode == "generic" and not _pointwise_since(ev, start):
            ev.brk(B.UNSUPPORTED_EXPR, e, scope, whole_stmt=True,
                   detail="associative_scan: a combine function of other than pointwise ops (eager vmaps it)")
        return out

    def interleave(a, b):
        """a[0], b[0], a[1], b[1]... along dim 0 (a one longer than b, or as long)."""
        n = a.meta.shape[0] + b.meta.shape[0]
        if a.meta.shape[0] == b.meta.shape[0] + 1:
            b = op(torch.nn.functional.pad, b, [0] * (2 * b.meta.dim() - 1) + [1])
        return op(operator.getitem, op(torch.flatten, op(torch.stack, [a, b], 1), 0, 1), slice(0, n))

    def scan(elems):
        n = elems[0].meta.shape[0]
        if n < 2:
            return elems
        odd = scan(call([op(operator.getitem, t, slice(0, -1, 2)) for t in elems],
                        [op(operator.getitem, t, slice(1, None, 2)) for t in elems]))
        rest = [op(operator.getitem, t, slice(2, None, 2)) for t in elems]
        even = call([op(operator.getitem, t, slice(0, -1)) for t in odd] if n % 2 == 0 else odd, rest)
        even = [op(torch.cat, [op(operator.getitem, t, slice(0, 1)), r], 0) if r.meta.numel() else
                op(operator.getitem, t, slice(0, 1)) for t, r in zip(elems, even)]
        return [interleave(a, b) for a, b in zip(even, odd)]

    elems = [op(torch.movedim, t, dim, 0) for t in leaves]
    if reverse:
        elems = [op(torch.flip, t, [0]) for t in elems]
    out = scan(elems)
    if reverse:
        out = [op(torch.flip, t, [0]) for t in out]
    return pytree.tree_unflatten([op(torch.movedim, t, 0, dim) for t in out], spec)


def _last_node(ev):
    return next(iter(reversed(ev.g.graph.nodes)), None)


def _pointwise_since(ev, start) -> bool:
    """Whether every op the graph got after node `start` reached pointwise ATen operators alone
    (and the expansions broadcasting makes)."""
    nodes = list(ev.g.graph.nodes)
    new = nodes[nodes.index(start) + 1:] if start is not None else nodes
    for n in new:
        if n.op != "call_function" or n.target is operator.getitem and isinstance(n.args[0].meta.get("val"), tuple):
            continue  # (an output of a call of several)
        aten = n.meta.get("aten")
        if aten is None or not all(torch.Tag.pointwise in o.tags or o in _KEEPS_VALUES for o in aten):
            return False
    return True
