"""The joint forward+backward graph, built from the primitives' VJP rules.

Placeholders: the forward inputs ("primals"), then one "tangent" per differentiable forward output
(one that requires grad in eager and that a gradient can flow back from here).
Outputs: the forward outputs, then the gradient of every primal that requires grad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from ..ops import builder as P
from ..ops import primitives as prim
from ..ops.builder import GraphBuilder, TVal
from ..ops.contract import verify
from ..ops.trace import values_only
from .contract import check_joint


@dataclass
class JointGraph:
    graph: fx.Graph
    num_primals: int
    num_fw_outputs: int
    tangent_outputs: list  # indices of the forward outputs that have a tangent input
    grad_inputs: list  # indices of the primals whose gradients follow the forward outputs


def _differentiable(v):
    """A float or complex tensor (torch differentiates complex values too: `torch.fft`)."""
    return isinstance(v, TVal) and isinstance(v.val, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)


def _needs_of(a, needs):
    """Whether an argument needs a gradient: per item of a list or tuple (einsum's operands)."""
    if isinstance(a, (list, tuple)):
        return tuple(_needs_of(x, needs) for x in a)
    return isinstance(a, fx.Node) and needs.get(a, False)


def _accumulate_listed(grads, needs, nodes, vals, gs):
    """The gradients `gs` of listed values (nested lists item by item) to their nodes."""
    for sub_node, sub_val, sub_g in zip(nodes, vals, gs):
        if isinstance(sub_node, (list, tuple)) and isinstance(sub_g, (list, tuple)):
            _accumulate_listed(grads, needs, sub_node, sub_val, sub_g)
        elif isinstance(sub_node, fx.Node):  # not an index's slice or int
            _accumulate(grads, sub_node, _fit(sub_val, sub_g) if needs.get(sub_node) else None)


def _accumulate(grads, node, g):
    if g is None:
        return
    grads[node] = g if node not in grads else P.add(grads[node], g)


def build_joint(fw: fx.Graph, requires_grad: list[bool], device, output_requires_grad=None) -> JointGraph:
    """`output_requires_grad`: per forward output, whether it requires grad in eager (a detached
    value does not); None: every output that depends on a primal requiring grad."""
    b = GraphBuilder(device)
    env: dict = {}
    needs: dict = {}  # forward node -> does its value depend on an input that requires grad
    with b.building():
        primals = [n for n in fw.nodes if n.op == "placeholder"]
        for n, rg in zip(primals, requires_grad + [False] * len(primals)):
            env[n] = b.placeholder(n.name, n.meta["val"])
            env[n].node.meta.update(n.meta)
            needs[n] = rg and _differentiable(env[n])
        if any(n.meta.get("seed") for n in primals):
            b._seed = next(env[n] for n in primals if n.meta.get("seed"))
        body = [n for n in fw.nodes if n.op == "call_function"]
        for n in body:
            new = b.graph.node_copy(n, lambda a: env[a].node)
            args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, fx.Node) else a)
            env[n] = TVal(new, new.meta["val"])
            arg_nodes = n.all_input_nodes
            needs[n] = any(needs.get(a, False) for a in arg_nodes) and not n.meta.get("no_gradient") and (
                isinstance(new.meta["val"], tuple) or _differentiable(env[n]))
        outputs = list(next(n for n in fw.nodes if n.op == "output").args[0])

        # tangent placeholders go right after the primals
        grads: dict = {}
        tangent_outputs = []
        last_primal = env[primals[-1]].node if primals else None
        for i, o in enumerate(outputs):
            if output_requires_grad is not None and not output_requires_grad[i]:
                continue
            if isinstance(o, fx.Node) and needs.get(o) and _differentiable(env[o]):
                where = b.graph.inserting_after(last_primal) if last_primal is not None else \
                    b.graph.inserting_before(next(iter(b.graph.nodes)))
                with where:
                    t = b.graph.placeholder(f"tangent_{i}")
                t.meta.update(val=env[o].val, loc=None, tangent=True)
                last_primal = t
                tangent_outputs.append(i)
                _accumulate(grads, o, TVal(t, env[o].val))

        for n in reversed(body):
            g = grads.pop(n, None)
            if g is None or not needs[n]:
                continue
            p = n.target
            if p is prim.item:
                producer, index = n.args
                slot = grads.setdefault(producer, [None] * len(producer.meta["val"]))
                slot[index] = g if slot[index] is None else P.add(slot[index], g)
                continue
            if p.vjp is None:
                raise NotImplementedError(f"no VJP rule for primitive {p.name}")
            args = map_aggregate(n.args, lambda a: env[a] if isinstance(a, fx.Node) else a)
            kwargs = map_aggregate(dict(n.kwargs), lambda a: env[a] if isinstance(a, fx.Node) else a)
            with b.at(n.meta.get("loc")):
                if p is prim.call_torch:  # differentiated only where a gradient is needed
                    kwargs = {**kwargs, "needs": tuple(_needs_of(a, needs) for a in n.args[1]),
                              "kw_needs": tuple(k for k, a in n.args[2].items()
                                                if isinstance(a, fx.Node) and needs.get(a, False))}
                elif p.vjp_with_needs:
                    kwargs = {**kwargs, "needs": tuple(isinstance(a, fx.Node) and needs.get(a, False)
                                                       for a in n.args)}
                    kw_needs = tuple(k for k, a in n.kwargs.items() if isinstance(a, fx.Node) and needs.get(a, False))
                    if kw_needs:
                        kwargs["kw_needs"] = kw_needs
                arg_grads = p.vjp(g, env[n], *args, **kwargs)
                if len(arg_grads) > len(n.args):  # a rule's last entry: its keyword tensors' gradients
                    for k, kw_g in arg_grads[len(n.args)].items():
                        if isinstance(n.kwargs.get(k), fx.Node) and needs.get(n.kwargs[k]):
                            _accumulate(grads, n.kwargs[k], kw_g)
                    arg_grads = arg_grads[:len(n.args)]
                for a_node, a_val, ga in zip(n.args, args, arg_grads):
                    if isinstance(a_node, dict) and isinstance(ga, dict):  # an extern's keyword tensors
                        for k, sub_g in ga.items():
                            if isinstance(a_node.get(k), fx.Node) and needs.get(a_node[k]):
                                _accumulate(grads, a_node[k], sub_g)
                    elif isinstance(a_node, (list, tuple)):  # cat, an extern's arguments: one per listed value
                        _accumulate_listed(grads, needs, a_node, a_val, ga)
                    elif isinstance(a_node, fx.Node) and needs.get(a_node) and ga is not None:
                        _accumulate(grads, a_node, _fit(a_val, ga) if p.kind == "pointwise" else ga)

        grad_inputs = [i for i, n in enumerate(primals) if needs[n]]
        grad_values = []
        for i in grad_inputs:
            n = primals[i]
            g = grads.get(n)
            grad_values.append(_fit(env[n], g) if g is not None else P.zeros_like(env[n]))
        b.output([env[o] if isinstance(o, fx.Node) else o for o in outputs] + grad_values)
    values_only(b.graph)
    joint = JointGraph(b.graph, len(primals), len(outputs), tangent_outputs, grad_inputs)
    verify(check_joint, joint)
    return joint


def _fit(arg: TVal, g):
    """A pointwise gradient reduced over broadcast dims and cast to the argument's dtype."""
    if g is None or not isinstance(arg, TVal):
        return None
    g = P.sum_to(g, arg.shape) if g.shape != arg.shape else g
    return P.cast(g, arg.dtype)
