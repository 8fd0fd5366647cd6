"""The backward graph for a call where some outputs get no gradient (the loss does not use them).

Eager's backward runs no VJP from such an output: a node that no gradient reaches is skipped, and
a gradient is the sum of the defined ones only. The compiled backward is one program over every
output's cotangent; given zeros for the missing ones, its VJP terms would multiply them with the
forward's values, and 0 * inf or 0 * NaN is NaN. So for each set of missing cotangents the
backward graph is rewritten without their terms: what only they reach is not computed, a sum
keeps its other operand, and elsewhere (a gradient that meets a defined one in a `where`, a `cat`,
an extern's VJP) they are zeros, as eager materializes them.
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.node import map_aggregate

from ..ops import builder as P
from ..ops import primitives as prim
from ..ops.builder import GraphBuilder, TVal


def without_tangents(backward: fx.Graph, missing: frozenset, device) -> fx.Graph:
    """`backward` (placeholders: saved values, then tangents) with the tangents whose indices
    (among the tangents) are in `missing` undefined. The placeholders stay (unused)."""
    b = GraphBuilder(device)
    env: dict = {}
    depends: set = set()  # nodes computed from a tangent
    gone: set = set()  # nodes computed from missing tangents only: terms eager does not compute
    zeros: dict = {}

    def use(a):
        if a not in gone:
            return env[a]
        if a not in zeros:
            val = a.meta["val"]
            zeros[a] = P.full(val.shape, 0, val.dtype).node
        return zeros[a]

    with b.building():
        k = 0
        for n in backward.nodes:
            if n.op == "placeholder":
                env[n] = b.graph.placeholder(n.name)
                env[n].meta.update(n.meta)
                if n.meta.get("tangent"):
                    depends.add(n)
                    if k in missing:
                        gone.add(n)
                    k += 1
            elif n.op == "call_function":
                inputs = n.all_input_nodes
                if any(a in depends for a in inputs):
                    depends.add(n)
                    if all(a in gone for a in inputs if a in depends):
                        gone.add(n)
                        continue
                    kept = _sum_without(n, gone, env)
                    if kept is not None:
                        env[n] = kept
                        continue
                with b.at(n.meta.get("loc")):
                    env[n] = b.graph.node_copy(n, use)
            elif n.op == "output":
                b.graph.output(map_aggregate(n.args[0], lambda a: use(a) if isinstance(a, fx.Node) else a))
    b.graph.eliminate_dead_code()
    return b.graph


def _sum_without(n, gone, env):
    """`a + b` or `a - b` with one operand a dropped term: the other (negated for `0 - b`), where
    it has the sum's shape and dtype already; None otherwise."""
    if n.target not in (prim.add, prim.sub) or not any(a in gone for a in n.args):
        return None
    a, c = n.args
    kept = c if a in gone else a
    val = n.meta["val"]
    if not isinstance(kept, fx.Node) or kept.meta["val"].shape != val.shape or kept.meta["val"].dtype != val.dtype:
        return None
    if n.target is prim.sub and kept is c:
        with P.builder().at(n.meta.get("loc")):
            return P.neg(TVal(env[kept], kept.meta["val"])).node
    return env[kept]
