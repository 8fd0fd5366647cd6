"""Min-cut partition of a joint graph into a forward graph and a backward graph.

The forward must hand the backward every value the backward needs that does not depend on the
tangents. It can save such a value, or save cheaper values it is computed from and let the
backward recompute it. As a flow network: node v is split into v_in -> v_out with capacity the
memory traffic saving v adds: the backward reads it, and the forward writes it unless it is in
memory anyway (an input, an extern's result or operand, a forward output): twice or once its
bytes. source -> primals and -> every node that must not be recomputed (matmuls, convolutions,
any extern, reductions, random numbers); v_out -> u_in (infinite) along data edges; v_out ->
sink (infinite) where a backward node uses v. A value that a backward extern reads (a matmul
operand) must be in memory there: recomputing it costs the backward a write and a read, an edge
source -> v_in of twice its bytes, cut exactly when v is recomputed. A minimum cut is then a
cheapest set of values to save; everything between them and the backward's uses is recomputed,
in the backward's own fused kernels. (AOTAutograd's min-cut rematerialization, with the
materialization costs of extern operands counted.) Nodes of a `torch.utils.checkpoint` call
(meta "recompute") are never saved and may be recomputed whatever their kind, as eager recomputes
the call in the backward: the cut falls on the call's inputs.

An input or output that eager autograd does not save is "private": the caller may write into
it in place before backward, and eager neither reads nor version-checks it then. It is not in
memory for this purpose: saving it, or a value sharing its memory (a view of it, its base),
costs a copy that the forward makes, as any computed value.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import settings
from ..ops import primitives as prim
from ..ops.contract import verify
from .contract import check_partition
from .joint import JointGraph

RECOMPUTABLE_KINDS = ("pointwise", "view", "source")


@dataclass
class Partition:
    forward: fx.Graph  # inputs: primals; outputs: forward outputs + saved values
    backward: fx.Graph  # inputs: saved values + tangents; outputs: gradients
    saved: list  # names of the joint graph's nodes the forward saves
    num_fw_outputs: int


def _bytes(node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return max(math.prod(val.shape), 1) * val.dtype.itemsize
    return 1


def _tangent_dependent(graph):
    dep = set()
    for n in graph.nodes:
        if n.meta.get("tangent") or any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


class _FlowNet:
    """A small directed flow network and its minimum cut (Dinic). Importing networkx
    for this cost a cold first call more than the whole partition."""

    def __init__(self):
        self.cap: dict = {}  # node -> {node: residual capacity}

    def add_node(self, v):
        self.cap.setdefault(v, {})

    def add_edge(self, u, v, capacity):
        self.cap.setdefault(u, {})
        self.cap.setdefault(v, {})
        self.cap[u][v] = self.cap[u].get(v, 0) + capacity
        self.cap[v].setdefault(u, 0)

    def __contains__(self, v):
        return v in self.cap

    def minimum_cut_source_side(self, s, t) -> set:
        """Saturate a maximum flow, then return the nodes that cannot reach `t` in the residual
        network (networkx's `minimum_cut` partition: the cut closest to the sink, the same for
        every maximum flow). Dinic's algorithm: each round a BFS levels the residual network and
        depth-first searches push flow along shortest paths until none is left (one BFS per
        augmenting path, as Edmonds-Karp did, was 0.4 s of a ResNet-50 training compile)."""
        cap = self.cap
        while True:
            level, queue = {s: 0}, collections.deque([s])
            while queue:
                u = queue.popleft()
                for v, c in cap[u].items():
                    if c > 0 and v not in level:
                        level[v] = level[u] + 1
                        queue.append(v)
            if t not in level:
                break
            # per node reached this round, the next-level neighbours not yet found useless (a dead
            # end stays dead within a round)
            todo: dict = {}
            while True:
                path, u = [], s
                while u != t:  # walk down the levels, backing off dead ends
                    nxt = todo.get(u)
                    if nxt is None:
                        nxt = todo[u] = [v for v, c in cap[u].items() if c > 0 and level.get(v) == level[u] + 1]
                    while nxt and cap[u][nxt[-1]] <= 0:
                        nxt.pop()
                    if nxt:
                        path.append(u)
                        u = nxt[-1]
                    elif path:
                        u = path.pop()
                        todo[u].pop()  # the edge into the dead end
                    else:
                        break
                if u != t:
                    break
                path.append(t)
                flow = min(cap[a][b] for a, b in zip(path, path[1:]))
                if flow == math.inf:
                    raise ValueError("unbounded flow: nothing to cut between forward and backward")
                for a, b in zip(path, path[1:]):
                    cap[a][b] -= flow
                    cap[b][a] += flow
        reaches_sink, queue = {t}, collections.deque([t])
        while queue:  # backwards over edges with residual capacity
            v = queue.popleft()
            for u in cap[v]:
                if u not in reaches_sink and cap[u][v] > 0:
                    reaches_sink.add(u)
                    queue.append(u)
        return set(cap) - reaches_sink


def _kind(n):
    """n's kind, a reshape that cannot view its operand's layout (a transposed activation
    flattened for a matmul) "pointwise": it is a copy, as eager's reshape is."""
    if n.op != "call_function":
        return n.op
    if n.target is prim.reshape and not _views_its_operand(n):
        return "pointwise"
    return n.target.kind


def _views_its_operand(n) -> bool:
    """Whether reshape `n` can view its operand's traced layout (torch's own rule, asked of a meta
    tensor; remembered in the node's meta: `_kind` is asked again on every walk through views)."""
    if "views_operand" not in n.meta:
        x, val = n.args[0].meta["val"], n.meta["val"]
        try:
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(val.shape)
            n.meta["views_operand"] = True
        except RuntimeError:
            n.meta["views_operand"] = False
    return n.meta["views_operand"]


def _read_by_extern(n, side, device) -> bool:
    """Whether an extern among `side`'s nodes reads n (directly or through views of it). Not a
    gather (an embedding or a `gather`) reading n as its positions alone where it is loads in a
    kernel (settings.gathers_in_kernels): it loads each position where it reads the table, so
    positions computed from iotas (bilinear resampling's gradient reads) are recomputed there
    rather than saved by the forward."""
    return any(_kind(u) == "extern" and side(u) and not _positions_of_gather(u, n, device) or
               _kind(u) == "view" and _read_by_extern(u, side, device) for u in n.users)


def _positions_of_gather(u, n, device) -> bool:
    """Whether gather `u` reads n as its positions alone."""
    operands = {prim.embedding: (0, 1), prim.gather: (2, 0)}.get(u.target)
    if operands is None:
        return False
    positions, table = (u.args[i] for i in operands)
    return positions is n and table is not n and \
        (device is None or settings.gathers_in_kernels(device, positions.meta["val"].shape, table.meta["val"].shape))


def choose_saved(joint: JointGraph, private=frozenset(), device=None) -> list[fx.Node]:
    """`private`: the nodes (not views) whose memory a private input or output is: saving a value
    in it costs a copy (see the module's docstring). `device`: the graph's (None: gathers are
    taken to load their positions in kernels)."""
    graph = joint.graph
    in_backward = _tangent_dependent(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    net = _FlowNet()
    net.add_node("source")
    net.add_node("sink")
    in_forward = lambda u: u not in in_backward
    in_memory: dict = {}  # node -> the forward has it in memory anyway (saving it costs one read)
    for n in graph.nodes:
        if n in in_backward or n.op == "output":
            continue
        kind = _kind(n)
        # inside a torch.utils.checkpoint call: never saved, recomputed (matmuls too) as eager does
        recompute = n.meta.get("recompute") is not None
        must_run_in_forward = n.op == "placeholder" or kind not in RECOMPUTABLE_KINDS and not recompute
        if must_run_in_forward:
            net.add_edge("source", (n, "in"), capacity=math.inf)
        in_memory[n] = _root(n) not in private and (
            kind in ("placeholder", "extern") or output in n.users or _read_by_extern(n, in_forward, device) or
            kind == "view" and in_memory.get(n.all_input_nodes[0], False))
        # (+1 for a view: a tie saves its base, whose layout the backward is compiled for up front)
        net.add_edge((n, "in"), (n, "out"), capacity=math.inf if recompute else
                     _bytes(n) * (1 if in_memory[n] else 2) + (kind == "view"))
        if kind == "pointwise" and _read_by_extern(n, in_backward.__contains__, device):
            net.add_edge("source", (n, "in"), capacity=2 * _bytes(n))
        for user in n.users:
            if user is output:
                continue
            if user in in_backward:
                net.add_edge((n, "out"), "sink", capacity=math.inf)
            else:
                net.add_edge((n, "out"), (user, "in"), capacity=math.inf)
    reachable = net.minimum_cut_source_side("source", "sink")
    return [n for n in graph.nodes if (n, "in") in reachable and (n, "out") in net and (n, "out") not in reachable]


def _extract(graph: fx.Graph, inputs: list, outputs: list) -> fx.Graph:
    """The subgraph computing `outputs` from `inputs` (which become its placeholders)."""
    needed, stack = set(), [o for o in outputs if isinstance(o, fx.Node)]
    inputs_set = set(inputs)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n not in inputs_set:
            stack.extend(n.all_input_nodes)
    missing = [n for n in needed if n.op == "placeholder" and n not in inputs_set]
    if missing:
        raise AssertionError(f"partition needs {missing} but does not receive them")
    out = fx.Graph()
    env = {}
    for n in inputs:
        env[n] = out.placeholder(n.name)
        env[n].meta.update(n.meta)
    for n in graph.nodes:
        if n in needed and n not in inputs_set and n.op != "output":
            env[n] = out.node_copy(n, lambda a: env[a])
    out.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return out


def _as_autograd_runs(graph: fx.Graph) -> fx.Graph:
    """The backward's nodes in the order eager autograd computes them: the nodes that depend on a
    tangent in their own order, and each value the saved values alone determine (a recomputation)
    just before the first node that needs it. In the joint graph's order the recomputations come
    first (they are forward nodes), each result then held from the backward's start to its use: a
    UNet's GroupNorm inputs recomputed in fp32 held through the whole backward, its transient
    memory 3x Inductor's."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    dependent = _tangent_dependent(graph)
    order, placed = [], {n for n in graph.nodes if n.op == "placeholder"}
    for n in graph.nodes:
        if n in placed or not (n in dependent or n.op == "output"):
            continue
        stack = [n]  # n after what it needs that is not placed yet, those in the graph's order
        while stack:
            top = stack[-1]
            missing = sorted((a for a in top.all_input_nodes if a not in placed), key=position.get, reverse=True)
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            if top not in placed:
                placed.add(top)
                order.append(top)
    out = fx.Graph()
    env = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = out.node_copy(n)
    for n in order:
        env[n] = out.node_copy(n, lambda a: env[a])
    return out


def _root(n):
    while _kind(n) == "view":
        n = n.all_input_nodes[0]
    return n


def _copy_saved(forward: fx.Graph, backward: fx.Graph, saved: list, private):
    """The forward saves a copy of each saved value in private memory; the backward is compiled
    for the copy's layout."""
    output = next(n for n in forward.nodes if n.op == "output")
    outs = list(output.args[0])
    first = len(outs) - len(saved)
    bw_inputs = [n for n in backward.nodes if n.op == "placeholder"]
    for k, n in enumerate(saved):
        if _root(n) not in private:
            continue
        value = outs[first + k]
        with forward.inserting_before(output):
            copy = forward.call_function(prim.copy, (value,))
        copy.meta.update(value.meta, val=prim.copy.impl(value.meta["val"]))
        outs[first + k] = copy
        bw_inputs[k].meta["val"] = copy.meta["val"]
    output.args = (tuple(outs),)


def partition(joint: JointGraph, private_inputs=(), private_outputs=(), device=None) -> Partition:
    """`private_inputs`, `private_outputs`: indices of the primals and forward outputs eager
    autograd does not save (see the module's docstring); `device`: the graph's (`choose_saved`)."""
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if not n.meta.get("tangent")]
    tangents = [n for n in placeholders if n.meta.get("tangent")]
    outputs = list(next(n for n in graph.nodes if n.op == "output").args[0])
    fw_outputs, grads = outputs[:joint.num_fw_outputs], outputs[joint.num_fw_outputs:]
    private = frozenset([primals[i] for i in private_inputs] +
                        [_root(fw_outputs[j]) for j in private_outputs if isinstance(fw_outputs[j], fx.Node)])
    saved = choose_saved(joint, private, device)
    forward = _extract(graph, primals, fw_outputs + saved)
    backward = _as_autograd_runs(_extract(graph, saved + tangents, grads))
    _copy_saved(forward, backward, saved, private)
    # inputs whose memory someone else holds while the backward runs (the module a primal, the
    # user a forward output, autograd's engine the incoming gradients): freeing them in the
    # backward frees no memory (the wrapper's plan of live bytes, codegen/wrapper.py)
    held = {_root(n) for n in primals + fw_outputs if isinstance(n, fx.Node)} - private
    for n, p in zip(saved + tangents, [n for n in backward.nodes if n.op == "placeholder"]):
        p.meta["held"] = n in tangents or _root(n) in held
    for n in backward.nodes:  # saved values are inputs of the backward, not random draws in it
        n.meta.pop("seed", None)
    parts = Partition(forward, backward, [n.name for n in saved], joint.num_fw_outputs)
    verify(check_partition, joint, parts)
    return parts
