"""Emitting primitives into an FX graph.

`TVal` is a tensor being built: an FX node plus its meta value. The functions here are the
primitives with torch's conveniences added (type promotion, scalar operands, negative dims,
keepdim), and are what decompositions and VJP rules are written with. Every node gets
`meta["val"]` by running the primitive's `impl` on meta tensors, and `meta["loc"]` from the
builder's current source location.
"""
from __future__ import annotations

import builtins
import contextlib
import math
import numbers
import threading

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

from . import primitives as prim

_local = threading.local()  # graphs may be built on several threads at once


class TVal:
    __slots__ = ("node", "val")

    def __init__(self, node, val):
        self.node, self.val = node, val

    shape = property(lambda self: tuple(self.val.shape))
    dtype = property(lambda self: self.val.dtype)
    ndim = property(lambda self: self.val.ndim)

    def numel(self):
        return math.prod(self.shape)

    def __repr__(self):
        return f"TVal({self.node.name}: {self.dtype} {list(self.shape)})"


class GraphBuilder:
    """Owns the primitive graph being built and the source location stamped on new nodes."""

    def __init__(self, device):
        self.graph = fx.Graph()
        self.device = torch.device(device)
        self.loc = None
        self.recompute = None  # the checkpoint region of the captured call being decomposed
        self._seed = None
        self._streams = 0
        # values made once per graph, by what they are made of (an attention's bias from its mask)
        self.memo: dict = {}
        self._grad: dict[fx.Node, bool] = {}  # nodes a gradient will flow through (needs_grad)

    def placeholder(self, name, val, requires_grad=False):
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        node.meta["loc"] = None
        self._grad[node] = requires_grad
        return TVal(node, val)

    def needs_grad(self, *values) -> bool:
        """Whether the graph will be differentiated through any of `values`: they depend on an
        input placeholder that requires grad, not through a stop_gradient (a decomposition may
        compute differently there, as torch's ops choose kernels by requires_grad)."""
        for n in self.graph.nodes:  # (each node after its inputs; those seen before are kept)
            if n not in self._grad:
                self._grad[n] = n.target is not prim.stop_gradient and any(self._grad[a] for a in n.all_input_nodes)
        return any(self._grad[v.node] for v in values if isinstance(v, TVal))

    def seed(self):
        """The graph's random seed: an int input, created on first use (after the other inputs)."""
        if self._seed is None:
            placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
            where = self.graph.inserting_after(placeholders[-1]) if placeholders else \
                self.graph.inserting_before(next(iter(self.graph.nodes), None))
            with where:
                node = self.graph.placeholder("seed")
            node.meta.update(val=0, loc=None, seed=True)
            self._seed = TVal(node, 0)
        return self._seed

    def next_stream(self):
        self._streams += 1
        return self._streams

    def output(self, values):
        self.graph.output(tuple(v.node if isinstance(v, TVal) else v for v in values))

    @contextlib.contextmanager
    def building(self):
        if not hasattr(_local, "builders"):
            _local.builders = []
        _local.builders.append(self)
        try:
            yield self
        finally:
            _local.builders.pop()

    @contextlib.contextmanager
    def at(self, loc, recompute=None):
        """Emit with source location `loc` (and the checkpoint region `recompute`)."""
        saved = self.loc, self.recompute
        self.loc, self.recompute = loc, recompute
        try:
            yield
        finally:
            self.loc, self.recompute = saved


def builder() -> GraphBuilder:
    return _local.builders[-1]


def _meta(x):
    return x.val if isinstance(x, TVal) else x


def _node(x):
    return x.node if isinstance(x, TVal) else x


def emit(p: prim.Primitive, *args, _val=None, **kwargs):
    """Add a call of primitive `p`; returns a TVal (or a tuple of TVals for tuple results)."""
    b = builder()
    if _val is None:
        def run():
            margs = map_aggregate(args, _meta)
            mkwargs = {k: ("meta" if k == "device" else map_aggregate(v, _meta)) for k, v in kwargs.items()}
            return p.impl(*margs, **mkwargs)
        _val = _pointwise_val(p, (args, kwargs), run) if p.kind == "pointwise" else run()
    node = b.graph.call_function(p, map_aggregate(args, _node),
                                 {k: map_aggregate(v, _node) for k, v in kwargs.items()})
    node.meta["loc"] = b.loc
    if b.recompute is not None:
        node.meta["recompute"] = b.recompute
    if isinstance(_val, (tuple, list)):
        node.meta["val"] = tuple(_val)
        whole = TVal(node, tuple(_val))
        return tuple(emit(prim.item, whole, i) if isinstance(v, torch.Tensor) else v for i, v in enumerate(_val))
    node.meta["val"] = _val
    return TVal(node, _val)


# --- dtypes ---------------------------------------------------------------------------------------
def result_type(*xs):
    """torch's type promotion over tensors and Python scalars (0-d tensors rank below others)."""
    rep = None
    for x in xs:
        x = torch.empty((1,) if x.ndim else (), dtype=x.dtype) if isinstance(x, TVal) else x
        if rep is None:
            rep = x
        elif isinstance(rep, torch.Tensor) or isinstance(x, torch.Tensor):
            dims = builtins.any(isinstance(t, torch.Tensor) and t.ndim for t in (rep, x))
            rep = torch.empty((1,) if dims else (), dtype=torch.result_type(rep, x))
        else:
            rep = rep + x
    return rep.dtype if isinstance(rep, torch.Tensor) else torch.tensor(rep).dtype


def cast(x, dtype):
    if not isinstance(x, TVal):
        if dtype == torch.bool:
            return builtins.bool(x)
        return float(x) if dtype.is_floating_point else int(x)
    return x if x.dtype == dtype else emit(prim.convert, x, dtype=dtype)


def to_float(x):
    """Ints and bools are promoted to the default float dtype, as torch does for div, exp, ..."""
    if isinstance(x, TVal) and not (x.dtype.is_floating_point or x.dtype.is_complex):
        return cast(x, torch.get_default_dtype())
    return x


# --- pointwise ------------------------------------------------------------------------------------
def _unary(p, float_only=True):
    def fn(x):
        return emit(p, to_float(x) if float_only else x)
    fn.__name__ = p.name
    return fn


neg = _unary(prim.neg, float_only=False)


def abs(x):  # noqa: A001 - the primitive's name
    # a bool is its own absolute value (the primitive, run by torch, has no bool kernel);
    # torch.abs of a bool tensor is refused at capture, as eager refuses it
    return x if x.dtype == torch.bool else emit(prim.abs, x)


def _rounding(p):
    def fn(x):  # integers are whole already: torch gives a copy (Triton's floor takes only floats)
        return emit(p, x) if x.dtype.is_floating_point else emit(prim.copy, x)
    fn.__name__ = p.name
    return fn


floor, ceil = _rounding(prim.floor), _rounding(prim.ceil)


def copy(x, memory_format=torch.preserve_format):
    """A fresh buffer: of x's layout (clone) or contiguous (`.contiguous()`): what a later view may do depends on it."""
    if memory_format is torch.preserve_format:
        return emit(prim.copy, x)
    return emit(prim.copy, x, memory_format=memory_format)


def logical_not(x):
    return emit(prim.logical_not, x)


def emit_operands(p, *operands, dtype):
    """A pointwise primitive of tensors and Python scalars (already cast to `dtype`). The scalars
    stay literals in the graph; the meta value is computed with them as 0-d tensors of `dtype`,
    since some torch functions take only tensors (logical_and, maximum)."""
    def run():
        return p.impl(*[o.val if isinstance(o, TVal) else torch.tensor(o, dtype=dtype, device="meta")
                        for o in operands])
    return emit(p, *operands, _val=_pointwise_val(p, (operands, dtype), run))


# A pointwise primitive's meta result is a new tensor whose layout follows from its operands'
# layouts, dtypes and its other arguments alone, and a model's layers repeat the same calls: torch's
# meta kernels for them are Python (type promotion, broadcasting), ~0.2 ms a call, most of the
# backend's graph building. Results are remembered by that key and made again as empty tensors.
_POINTWISE_VALS: dict = {}


def _operand_key(v):
    if isinstance(v, TVal):
        v = v.val
    if isinstance(v, torch.Tensor):
        if v.device.type != "meta" or not all(type(n) is int for n in (*v.shape, *v.stride())):
            raise TypeError("not a meta tensor of static sizes")
        return ("T", tuple(v.shape), v.stride(), v.dtype, v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_operand_key(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _operand_key(x)) for k, x in v.items()))
    return (type(v), v)


def _pointwise_val(p, operands, run):
    """`run()` (p.impl on the operands' metas), or the result it gave for operands of the same key."""
    try:
        key = (p, _operand_key(operands), torch.get_default_dtype(), torch.is_grad_enabled())
        layout = _POINTWISE_VALS.get(key)
    except TypeError:  # a symbolic size, an unhashable argument: not remembered
        return run()
    if layout is not None:
        shape, stride, dtype = layout
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    val = run()
    # only new tensors (not an operand itself, as a convert to its own dtype returns, nor a view)
    if isinstance(val, torch.Tensor) and val.device.type == "meta" and not val.requires_grad and \
            val._base is None and not any(val is _meta(o) for o in tree_leaves(operands)) and \
            all(type(n) is int for n in (*val.shape, *val.stride())):
        if len(_POINTWISE_VALS) >= 20000:  # (a process compiling many models)
            _POINTWISE_VALS.clear()
        _POINTWISE_VALS[key] = (tuple(val.shape), val.stride(), val.dtype)
    return val


def _binary(p, float_result=False):
    def fn(a, b):
        if not isinstance(a, TVal) and not isinstance(b, TVal):
            return p.impl(torch.tensor(a), torch.tensor(b)).item()
        dtype = result_type(a, b)
        if float_result and not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        # bools add and multiply as torch's do (True + True is True); Triton's 1-bit integers wrap
        op = _BOOL_ARITHMETIC.get(p, p) if dtype == torch.bool else p
        return emit_operands(op, cast(a, dtype), cast(b, dtype), dtype=dtype)
    fn.__name__ = p.name
    return fn


_BOOL_ARITHMETIC = {prim.add: prim.logical_or, prim.mul: prim.logical_and}


add, sub, mul = _binary(prim.add), _binary(prim.sub), _binary(prim.mul)
div = _binary(prim.div, float_result=True)
eq, ne, lt, le, gt, ge = (_binary(p) for p in (prim.eq, prim.ne, prim.lt, prim.le, prim.gt, prim.ge))


def pow(a, b):
    if isinstance(b, numbers.Number) and isinstance(a, TVal):
        # small integer powers as products: exact, and no pow call in the kernel (in fp32 for
        # half types: pow rounds once)
        if float(b).is_integer() and 1 <= b <= 4:
            x = cast(a, torch.float32) if a.dtype in (torch.float16, torch.bfloat16) else a
            out = x
            for _ in range(int(b) - 1):
                out = mul(out, x)
            return cast(out, a.dtype)
        if b == 0.5:
            return sqrt(a)
    return _binary(prim.pow)(a, b)


def _logical(p):
    def fn(a, b):
        if not isinstance(a, TVal) and not isinstance(b, TVal):
            return builtins.bool(p.impl(torch.tensor(a), torch.tensor(b)))
        return emit_operands(p, cast(a, torch.bool), cast(b, torch.bool), dtype=torch.bool)
    return fn


logical_and, logical_or, logical_xor = _logical(prim.logical_and), _logical(prim.logical_or), \
    _logical(prim.logical_xor)


def where(cond, a, b):
    dtype = result_type(a, b)
    if not isinstance(cond, TVal):
        return a if cond else b
    return emit_operands(prim.where, cast(cond, torch.bool), cast(a, dtype), cast(b, dtype), dtype=dtype)


def _declared_helper(p):
    return _unary(p, float_only=p.int_to_float) if p.arity == 1 else _binary(p, float_result=p.int_to_float)


# the helpers of primitives declared with `prim.unary`/`prim.binary` that need nothing more
# (`floor` and `ceil` do: written above)
for _p in list(prim.PRIMITIVES.values()):
    if _p.torch_names and _p.name not in globals():
        globals()[_p.name] = _declared_helper(_p)
gelu_erf = _declared_helper(prim.gelu_erf)


# --- reductions -----------------------------------------------------------------------------------
def norm_dims(dims, ndim):
    if dims is None or dims == [] or dims == ():
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % builtins.max(ndim, 1) for d in dims})) if ndim else ()


def _reduction(p):
    def fn(x, dims=None, keepdim=False):
        dims = norm_dims(dims, x.ndim)
        out = emit(p, x, dims)
        return out if keepdim else squeeze_dims(out, dims)
    fn.__name__ = p.name
    return fn


sum, prod, amax, amin = (_reduction(p) for p in (prim.sum, prim.prod, prim.amax, prim.amin))


def sum_to(x, shape):
    """Sum a broadcast result back down to `shape` (the VJP of broadcasting)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and x.shape[lead + i] != 1)
    out = emit(prim.sum, x, dims) if dims else x
    return reshape(out, shape)


# --- views ----------------------------------------------------------------------------------------
def reshape(x, shape):
    shape = tuple(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(x.numel() // builtins.max(known, 1) if s == -1 else s for s in shape)
    return x if x.shape == shape else emit(prim.reshape, x, shape)


def squeeze_dims(x, dims):
    keep = [s for i, s in enumerate(x.shape) if i not in dims or s != 1]
    return reshape(x, keep)


def unsqueeze(x, dim):
    dim = dim % (x.ndim + 1)
    return reshape(x, x.shape[:dim] + (1,) + x.shape[dim:])


def permute(x, dims):
    dims = tuple(d % x.ndim for d in dims)
    return x if dims == tuple(range(x.ndim)) else emit(prim.permute, x, dims)


def transpose(x, d0, d1):
    if x.ndim < 2:
        return x
    dims = list(range(x.ndim))
    dims[d0 % x.ndim], dims[d1 % x.ndim] = dims[d1 % x.ndim], dims[d0 % x.ndim]
    return permute(x, dims)


def expand(x, shape):
    shape = tuple(shape)
    lead = len(shape) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(shape))
    if x.ndim < len(shape):
        x = reshape(x, (1,) * lead + x.shape)
    return x if x.shape == shape else emit(prim.expand, x, shape)


def broadcast_shapes(*shapes):
    return tuple(torch.broadcast_shapes(*shapes))


def slice(x, dim, start, end, step=1):
    dim = dim % x.ndim
    size = x.shape[dim]
    start, end, step = builtins.slice(start, end, step).indices(size)
    end = builtins.max(end, start)
    if (start, end, step) == (0, size, 1):
        return x
    return emit(prim.slice, x, dim, start, end, step)


def select(x, dim, index):
    dim = dim % x.ndim
    index = index % x.shape[dim] if x.shape[dim] else index
    return squeeze_dims(slice(x, dim, index, index + 1), (dim,))


# --- sources --------------------------------------------------------------------------------------
def full(shape, value, dtype=None, device=None):
    if dtype is None:
        dtype = torch.tensor(value).dtype if not isinstance(value, float) else torch.get_default_dtype()
    return emit(prim.full, tuple(shape), value, dtype=dtype, device=device or builder().device)


def iota(length, start=0, step=1, dtype=torch.int64, device=None):
    return emit(prim.iota, length, start, step, dtype=dtype, device=device or builder().device)


def zeros_like(x, dtype=None):
    return full(x.shape, 0, dtype or x.dtype)
