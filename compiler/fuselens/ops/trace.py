"""Torch-level FX graph -> primitive FX graph, by running each node's decomposition on TVals."""
from __future__ import annotations

import functools
import inspect

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

from . import builder as P
from . import primitives as prim
from .attention import rewrite_attention
from .autograd_function import FunctionGradient
from .builder import GraphBuilder, TVal, emit
from .contract import check_primitive_graph, verify
from .decompositions import DECOMPOSITIONS, Unsupported, Written
from .effects import OnCopies


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
    out = emit(prim.call_torch, target, tuple(args), dict(kwargs), _val=val)
    if node is not None and _cuts_gradient(node):
        call = (out[0] if isinstance(out, tuple) else out).node
        (call if call.target is prim.call_torch else call.args[0]).meta["no_gradient"] = True
    return out


def _cuts_gradient(node: fx.Node) -> bool:
    """Whether eager's result of `node` requires no grad though an argument does, as capture
    recorded it (a TorchScript function's `torch.tensor(x.size(-1))`): autograd/joint.py sends
    it no gradient (its VJP would run torch's autograd on it, and on a GPU copy it from the CPU)."""
    vals = [v for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return bool(vals) and not any(v.requires_grad for v in vals) and any(
        isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].requires_grad for a in node.all_input_nodes)


def _decomposition(target):
    """The decomposition of a torch spelling; an ATen overload (capture emits the functional
    overloads of in-place writes) uses its Python binding's: `torch.Tensor.<op>`, `torch.<op>`
    or `F.<op>`, generated from the same schema (arguments that do not bind go extern). A call
    run on copies of what it writes (`OnCopies`) uses the decomposition of the call, if that
    returns the written values (`Written`)."""
    if isinstance(target, OnCopies):
        fn = _decomposition(target.fn)
        return None if fn is None else _on_copies(fn, target.written)
    if isinstance(target, FunctionGradient):
        return target.decomposition
    fn = DECOMPOSITIONS.get(target)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[1]
        for owner in (torch.Tensor, torch, torch.nn.functional):
            binding = getattr(owner, name, None)
            if binding is not None and binding in DECOMPOSITIONS:
                return getattr(DECOMPOSITIONS[binding], "in_schema_order", DECOMPOSITIONS[binding])
    return fn


def _bind(fn, target, args, kwargs):
    """(args, kwargs) that `fn`, a decomposition written for torch's Python binding, takes for a
    call of `target`. Arguments named as in the op's ATen schema (functional forms of in-place
    calls: `aten.add.Tensor(t, other=1)`; BLOOM's `alibi.baddbmm(batch1=q, batch2=k, ...)`) go to
    their schema positions where `fn` has no parameter of that name (the binding's `add(a, b)`,
    `baddbmm(x, a, b)`); TypeError where they still do not bind."""
    sig = inspect.signature(fn)
    try:
        sig.bind(*args, **kwargs)
        return args, kwargs
    except TypeError as e:
        error = e
    for schema in _schemas(target) if kwargs else ():
        positional, named = list(args), dict(kwargs)
        for a in schema.arguments[len(positional):]:
            if a.kwarg_only or a.name not in named or a.name in sig.parameters:
                break
            positional.append(named.pop(a.name))
        try:
            sig.bind(*positional, **named)
            return tuple(positional), named
        except TypeError:
            continue
    raise error


def _schemas(target) -> list:
    """The ATen schemas of `target`: an overload's own, or those of the ATen op a torch function
    or Tensor method of that name binds to."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return [schema]
    try:
        packet = getattr(torch.ops.aten, target.__name__)
        return [getattr(packet, o)._schema for o in packet.overloads()]
    except (AttributeError, RuntimeError):
        return []


def _complex(v) -> bool:
    """Whether a complex tensor is among `v`'s values (arguments, the node's result)."""
    return any(isinstance(a, (TVal, torch.Tensor)) and a.dtype.is_complex for a in tree_leaves(v))


def _on_copies(fn, written):
    """`fn`'s decomposition giving what `OnCopies(fn, written)` returns: the new values of the
    written arguments (their indices among the distinct tensor arguments), then the result."""
    @functools.wraps(fn)  # its signature is what decompose() checks arguments against
    def decomposition(*args, **kwargs):
        out = fn(*args, **kwargs)
        if not isinstance(out, Written):
            raise Unsupported("the decomposition writes nothing where the call writes")
        distinct = []
        map_aggregate((args, kwargs), lambda a: distinct.append(a) if isinstance(a, TVal) and
                      not any(a is d for d in distinct) else None)
        new = {id(arg): value for arg, value in out.writes}
        if sorted(id(distinct[i]) for i in written) != sorted(new):
            raise Unsupported("the decomposition writes other arguments than the call")
        result = out.result if isinstance(out.result, (tuple, list)) else (out.result,)
        return tuple(new[id(distinct[i])] for i in written) + tuple(result)
    return decomposition


def decompose(target, args, kwargs, node=None):
    fn = _decomposition(target)
    if fn is not None and _complex((args, kwargs, node.meta.get("val") if node is not None else None)):
        fn = None  # complex values: torch's ops compute them (kernels compute real numbers)
    if fn is not None:
        try:
            args, kwargs = _bind(fn, target, args, kwargs)
        except (TypeError, ValueError):
            fn = None
    if fn is not None:
        b = P.builder()
        state = (next(iter(reversed(b.graph.nodes)), None), b._seed)  # (a list view in older torch)
        try:
            out = fn(*args, **kwargs)
            if isinstance(out, Written):  # writes in place: only its OnCopies form has them as results
                raise Unsupported("a write into an argument")
            return with_result_dtypes(out, eager_result(target, args, kwargs, node))
        except Unsupported:
            _undo(b, *state)
        except RuntimeError:
            # a step refuses a zero-size tensor (`amax` over an empty dim inside softmax) where the
            # op itself gives an empty result: torch's op computes it (there is nothing to compute)
            if not _has_empty((args, kwargs)):
                raise
            _undo(b, *state)
    return extern_call(target, args, kwargs, node)


def decompose_node(node: fx.Node, env: dict, elsewhere: dict | None = None):
    """A torch-level graph's call node as primitives, its operands the values `env` holds.
    `elsewhere` (node -> its value moved to the graph's device, or None): the nodes whose values
    eager makes on another device than the graph's (below)."""
    if elsewhere is not None and _on_another_device(node):
        # (`torch.tensor(8.0)`, a factory without a device, in a GPU graph): torch's op on that
        # device, as eager runs it; the graph's kernels never take its result (_operand)
        elsewhere[node] = None
        args = map_aggregate(node.args, lambda a: env[a] if isinstance(a, fx.Node) else a)
        kwargs = map_aggregate(dict(node.kwargs), lambda a: env[a] if isinstance(a, fx.Node) else a)
        return extern_call(normalize_target(node), args, kwargs, node)
    operand = (lambda a: env[a]) if not elsewhere else (lambda a: _operand(a, env, elsewhere))
    args = map_aggregate(node.args, lambda a: operand(a) if isinstance(a, fx.Node) else a)
    kwargs = map_aggregate(dict(node.kwargs), lambda a: operand(a) if isinstance(a, fx.Node) else a)
    return decompose(normalize_target(node), args, kwargs, node)


def _on_another_device(node: fx.Node) -> bool:
    """Whether capture found `node`'s value on another device type than the graph's (the builder's)."""
    device = node.meta.get("device")
    return device is not None and torch.device(device).type != P.builder().device.type


def _operand(a: fx.Node, env: dict, elsewhere: dict):
    """`a`'s value as an operand of an op on the graph's device: one made on another device is
    copied here once (eager's CUDA ops take a CPU 0-d tensor as a scalar and a CPU index tensor
    as it is; a kernel reads only its own device's memory)."""
    v = env[a]
    if a not in elsewhere or not isinstance(v, TVal):
        return v
    if elsewhere[a] is None:
        elsewhere[a] = emit(prim.call_torch, torch.Tensor.to, (v, P.builder().device), {}, _val=v.val)
    return elsewhere[a]


def _undo(b, last, seed):
    """Remove what a decomposition that gave up emitted: its nodes (dead nodes would still be
    lowered: a reduction is a kernel whether or not anything reads it), and the graph's seed if
    it made it (a seed input draws from torch's generator on every call)."""
    for n in list(reversed(b.graph.nodes)):
        if n is last:
            break
        if n.op != "placeholder":
            b.graph.erase_node(n)
    if seed is None and b._seed is not None:
        b.graph.erase_node(b._seed.node)
        b._seed = None


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


def to_primitive_graph(gm: fx.GraphModule, example_inputs, device, requires_grad=()) -> fx.Graph:
    """The primitive graph of `gm` for inputs shaped like `example_inputs` (tensors or meta tensors).

    Placeholders keep gm's order; a `seed` int placeholder is appended when the graph draws random
    numbers. Outputs are a flat tuple (a single returned value becomes a 1-tuple). Attention
    patterns become one `sdpa` call (attention.py; `requires_grad`, per input, where the graph is
    differentiated).
    """
    b = GraphBuilder(device)
    env: dict[fx.Node, object] = {}
    elsewhere: dict = {}  # decompose_node's
    inputs = iter(example_inputs)
    grads = iter(requires_grad)
    with b.building():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = b.placeholder(node.name, meta_like(next(inputs)), bool(next(grads, False)))
            elif node.op in ("call_function", "call_method"):
                with b.at(node.meta.get("loc"), node.meta.get("recompute")):
                    env[node] = decompose_node(node, env, elsewhere)
            elif node.op == "get_attr" and not isinstance(getattr(gm, node.target), torch.Tensor):
                env[node] = getattr(gm, node.target)  # a constant argument capture could not spell
            elif node.op == "output":
                out = node.args[0]
                out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                b.output([env[o] if isinstance(o, fx.Node) else o for o in out])
            else:
                raise NotImplementedError(f"{node.op} nodes ({node.target}) are not part of the capture contract")
    rewrite_attention(b.graph, device, requires_grad)
    verify(check_primitive_graph, b.graph)
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


# primitives whose result is a function of their operands alone (extern calls may draw random
# numbers or return views; with_value / with_vjp route gradients)
_PURE_KINDS = ("pointwise", "reduction", "view", "source")


def merge_common_subexpressions(graph: fx.Graph) -> fx.Graph:
    """Nodes computing the same pure primitive of the same operands become one node: a VJP or a
    decomposition that computes a value again (the two BatchNorms of a ResNet's downsample block
    each summing the same gradient) computes it once. Two graph outputs stay two nodes: the caller
    gets two tensors, as from eager."""
    seen: dict = {}
    returned = set(next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes)
    for n in list(graph.nodes):
        if n.op != "call_function" or getattr(n.target, "kind", None) not in _PURE_KINDS or \
                n.target in (prim.with_value, prim.with_vjp):
            continue
        key = (n.target, _operand_key(n.args), _operand_key(n.kwargs))
        first = seen.setdefault(key, n)
        if first is not n and not (n in returned and first in returned):
            n.replace_all_uses_with(first)
            graph.erase_node(n)
            if n in returned:
                returned.add(first)
    return graph


def _operand_key(v):
    """A hashable stand-in for operands, equal only for equal operands: nodes by identity, numbers
    by type and repr (1, 1.0 and True promote differently; 0.0 and -0.0 differ), other objects
    by identity."""
    if isinstance(v, fx.Node):
        return v
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_operand_key(x) for x in v)
    if isinstance(v, dict):
        return dict, tuple((k, _operand_key(x)) for k, x in v.items())
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return type(v), repr(v)
    return "object", id(v)
