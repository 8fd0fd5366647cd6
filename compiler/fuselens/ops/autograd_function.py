"""A custom `torch.autograd.Function` whose gradient autograd records, in the graph.

Capture (capture/builtins.py) captures its forward in no-grad mode, as `apply` runs it, and traces
its backward once into a torch-level FX graph (`trace_backward`: the saved tensors and the output's
gradient in, one gradient per forward argument out). `FunctionGradient` joins the two: a graph call
whose value is the forward's and whose VJP is the traced backward (`prim.with_vjp`, its rule
decomposing the backward's nodes into primitives inside the joint graph, where they fuse like any
other code). Run eagerly (a fallback, the CPU's eager backend), it is an autograd.Function whose
backward runs the traced graph. The user's forward and backward each run once per step, as eager's.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import primitives as prim
from .builder import TVal, emit


class Untraceable(Exception):
    """The backward is no straight-line torch code over its tensors (Python decides on a tensor's
    value, a tensor constant of its own): the call keeps running eagerly (a graph break)."""


def trace_backward(backward, make_ctx, saved: list, grad, name: str, grads=lambda g: (g,)) -> fx.GraphModule:
    """`backward(ctx, *grads(grad))` traced with FX proxies that carry meta tensors: `saved` and
    `grad` are the meta tensors of the saved values and of the output's gradient; `make_ctx(proxies)`
    gives the context object whose saved tensors are the proxies of `saved`; `grads` the gradient of
    each output from the one differentiable output's (the others' are zeros, as autograd passes
    for outputs marked non-differentiable). What the backward asks of a tensor's metadata (its
    shape, `g.is_contiguous()`, `x.dim()`) is answered from the metas, as capture answers it: a
    constant of the trace. `once_differentiable` is unwrapped (its no-grad run and checks are
    eager's business; the graph's backward is not differentiated again)."""
    graph = fx.Graph()
    tracer = _MetaTracer(graph)
    placeholders = [(f"saved_{i}", m) for i, m in enumerate(saved)] + [("grad", grad)]
    proxies = []
    for label, meta in placeholders:
        node = graph.placeholder(label)
        # (a copy: an in-place op of the backward changes no meta of the capture's)
        node.meta["val"] = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="meta")
        proxies.append(_MetaProxy(node, tracer))
    try:
        out = inspect.unwrap(backward)(make_ctx(proxies[:-1]), *grads(proxies[-1]))
    except Exception as e:  # noqa: BLE001 - a TraceError, or anything the traced code raised on proxies
        raise Untraceable(f"{type(e).__name__}: {e}"[:200]) from None
    out = out if isinstance(out, tuple) else (out,)
    if any(o is not None and not isinstance(o, fx.Proxy) for o in out):
        raise Untraceable("its backward returns a value computed from no gradient or saved tensor")
    graph.output(tuple(o.node if o is not None else None for o in out))
    return fx.GraphModule(torch.nn.Module(), graph, f"{name}_backward")


# a tensor's metadata, answered from its meta where the backward reads it as an attribute
_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "layout", "is_cuda", "is_sparse", "is_quantized"})


class _MetaProxy(fx.Proxy):
    def __getattr__(self, k):
        val = self.node.meta.get("val")
        if k in _META_ATTRS and isinstance(val, torch.Tensor):
            return getattr(val, k)
        return super().__getattr__(k)


class _MetaTracer(fx.proxy.GraphAppendingTracer):
    """Each call recorded is also run on the meta tensors of its arguments: a tensor result is a
    proxy carrying its meta; a result holding no tensor (`g.is_contiguous()`, `x.size(0)`) is the
    value itself. Where the metas cannot run it (a data-dependent op), a proxy without one."""

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        val = None
        if kind in ("call_function", "call_method"):
            known = True

            def meta(a):
                nonlocal known
                if isinstance(a, fx.Proxy):
                    v = a.node.meta.get("val")
                    known = known and v is not None
                    return v
                return a
            margs, mkwargs = fx.node.map_aggregate((args, kwargs), meta)
            if known:
                try:
                    with torch.no_grad():
                        val = target(*margs, **mkwargs) if kind == "call_function" else \
                            getattr(margs[0], target)(*margs[1:], **mkwargs)
                except Exception:  # noqa: BLE001 (what metas cannot compute: a proxy of no meta)
                    val = None
            if val is not None and not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(val)):
                return val
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                     proxy_factory_fn or (lambda node: _MetaProxy(node, self)))
        if isinstance(val, torch.Tensor):
            proxy.node.meta["val"] = val
        return proxy


class FunctionGradient:
    """`FunctionGradient(...)(y, *inputs, *saved)`: y (the forward's output, computed without
    gradient) with the gradients of `inputs` (the forward's tensor arguments, at `positions` among
    its arguments) given by the traced `backward` from `saved` and y's gradient."""

    def __init__(self, name: str, backward: fx.GraphModule, positions: tuple, n_saved: int):
        self.backward, self.positions, self.n_saved = backward, positions, n_saved
        self.__name__ = self.__qualname__ = f"{name}_apply"

    def __repr__(self):
        return self.__name__

    def __call__(self, y, *tensors):
        return _Apply.apply(self, y, *tensors)

    def gradients(self, outputs) -> list:
        """The backward's outputs (one per forward argument) at the inputs' positions."""
        return [outputs[p] if p < len(outputs) else None for p in self.positions]

    def decomposition(self, y, *tensors):
        """The primitive form: y, whose VJP runs the backward's nodes on the joint graph's values."""
        def rule(g, *values):
            saved = values[len(self.positions):]
            env = dict(zip([n for n in self.backward.graph.nodes if n.op == "placeholder"], [*saved, g]))
            from .trace import decompose_node  # (trace imports this module's class)
            for n in self.backward.graph.nodes:
                if n.op in ("call_function", "call_method"):
                    env[n] = decompose_node(n, env)
                elif n.op == "output":
                    outs = [env[o] if isinstance(o, fx.Node) else None for o in n.args[0]]
            grads = [g_ if isinstance(g_, TVal) else None for g_ in self.gradients(outs)]
            return grads + [None] * len(saved)
        return emit(prim.with_vjp, y, list(tensors), rule)


class _Apply(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fg, y, *tensors):
        ctx.fg, ctx.n_inputs = fg, len(tensors) - fg.n_saved
        ctx.save_for_backward(*tensors[ctx.n_inputs:])
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        outs = ctx.fg.backward(*ctx.saved_tensors, g)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return (None, None, *ctx.fg.gradients(outs), *[None] * ctx.fg.n_saved)
