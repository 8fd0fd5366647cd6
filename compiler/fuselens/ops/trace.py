"""Torch-level FX graph -> primitive FX graph, by running each node's decomposition on TVals."""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from . import builder as P
from . import primitives as prim
from .attention import rewrite_attention
from .builder import GraphBuilder, TVal, emit
from .decompositions import DECOMPOSITIONS, Unsupported


def normalize_target(node: fx.Node):
    """call_method nodes (from symbolic_trace) become their unbound torch.Tensor method."""
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target)
    return node.target


def meta_like(v):
    """A meta tensor with v's shape, strides and dtype (`.to("meta")` makes non-dense tensors contiguous)."""
    if isinstance(v, torch.Tensor) and v.device.type != "meta":
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    return v


def extern_call(target, args, kwargs, node=None):
    """Any torch function as an extern call (no decomposition, or arguments it does not handle)."""
    try:
        meta_args = map_aggregate(args, lambda a: a.val if isinstance(a, TVal) else a)
        meta_kwargs = map_aggregate(kwargs, lambda a: a.val if isinstance(a, TVal) else a)
        val = map_aggregate(target(*meta_args, **meta_kwargs), meta_like)
    except Exception:  # data-dependent shapes: take the value capture recorded
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, (torch.Tensor, tuple, list)):
            raise
    return emit(prim.call_torch, target, tuple(args), dict(kwargs), _val=val)


def _decomposition(target):
    """The decomposition of a torch spelling; an ATen overload (capture emits the functional
    overloads of in-place writes) uses its Python binding's: `torch.Tensor.<op>`, `torch.<op>`
    or `F.<op>`, generated from the same schema (arguments that do not bind go extern)."""
    fn = DECOMPOSITIONS.get(target)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[1]
        for owner in (torch.Tensor, torch, torch.nn.functional):
            binding = getattr(owner, name, None)
            if binding is not None and binding in DECOMPOSITIONS:
                return DECOMPOSITIONS[binding]
    return fn


def decompose(target, args, kwargs, node=None):
    fn = _decomposition(target)
    if fn is not None:
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except (TypeError, ValueError):
            fn = None
    if fn is not None:
        try:
            return with_result_dtypes(fn(*args, **kwargs), eager_result(target, args, kwargs, node))
        except Unsupported:
            pass
        except RuntimeError:
            # a step refuses a zero-size tensor (`amax` over an empty dim inside softmax) where the
            # op itself gives an empty result: torch's op computes it (there is nothing to compute)
            if not _has_empty((args, kwargs)):
                raise
    return extern_call(target, args, kwargs, node)


def _has_empty(tree) -> bool:
    found = []
    map_aggregate(tree, lambda a: found.append(a) if isinstance(a, TVal) and isinstance(a.val, torch.Tensor) and a.val.numel() == 0 else None)
    return bool(found)


def eager_result(target, args, kwargs, node):
    """What torch's op gives (meta tensors): capture's value, else the op run on meta tensors."""
    val = node.meta.get("val") if node is not None else None
    if val is not None:
        return val
    tvals = []
    map_aggregate((args, kwargs), lambda a: tvals.append(a) if isinstance(a, TVal) else None)
    if not tvals:  # a factory: it would allocate real memory
        return None
    try:
        return target(*map_aggregate(args, _meta_val), **map_aggregate(kwargs, _meta_val))
    except Exception:  # no meta kernel: the decomposition's dtypes stand
        return None


def _meta_val(a):
    return a.val if isinstance(a, TVal) else a


def with_result_dtypes(out, expected):
    """A decomposition's results in the dtypes of torch's op (its type promotion and result-dtype
    rules), whatever dtype the primitives it was written with produced."""
    if isinstance(out, TVal) and isinstance(expected, torch.Tensor):
        return out if out.dtype == expected.dtype else P.cast(out, expected.dtype)
    if isinstance(out, (tuple, list)) and isinstance(expected, (tuple, list)) and len(out) == len(expected):
        return type(out)(with_result_dtypes(o, e) for o, e in zip(out, expected))
    return out


def to_primitive_graph(gm: fx.GraphModule, example_inputs, device) -> fx.Graph:
    """The primitive graph of `gm` for inputs shaped like `example_inputs` (tensors or meta tensors).

    Placeholders keep gm's order; a `seed` int placeholder is appended when the graph draws random
    numbers. Outputs are a flat tuple (a single returned value becomes a 1-tuple). Attention
    patterns become one `sdpa` call (attention.py).
    """
    b = GraphBuilder(device)
    env: dict[fx.Node, object] = {}
    inputs = iter(example_inputs)
    with b.building():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = b.placeholder(node.name, meta_like(next(inputs)))
            elif node.op in ("call_function", "call_method"):
                args = map_aggregate(node.args, lambda a: env[a] if isinstance(a, fx.Node) else a)
                kwargs = map_aggregate(dict(node.kwargs), lambda a: env[a] if isinstance(a, fx.Node) else a)
                with b.at(node.meta.get("loc")):
                    env[node] = decompose(normalize_target(node), args, kwargs, node)
            elif node.op == "get_attr" and not isinstance(getattr(gm, node.target), torch.Tensor):
                env[node] = getattr(gm, node.target)  # a constant argument capture could not spell
            elif node.op == "output":
                out = node.args[0]
                out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                b.output([env[o] if isinstance(o, fx.Node) else o for o in out])
            else:
                raise NotImplementedError(f"{node.op} nodes ({node.target}) are not part of the capture contract")
    rewrite_attention(b.graph, device)
    return b.graph


def values_only(graph: fx.Graph) -> fx.Graph:
    """`graph` once no gradient is to be taken through it (an inference graph, a joint graph whose
    VJPs are built): `with_value(t, v)` is `v`, and what only routed a gradient (`t`) goes."""
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is prim.with_value:
            value = n.args[1]
            n.replace_all_uses_with(value)
            graph.erase_node(n)
    graph.eliminate_dead_code()
    return graph
