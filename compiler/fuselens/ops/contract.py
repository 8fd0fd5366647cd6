"""Stage contracts as code: what each stage hands the next, checked where it hands it over when
`FUSELENS_VERIFY=1` (off by default: the checks cost compile time; the test suite turns them on).
The rules are docs/architecture.md's "Stage contracts", one check each; each stage's package holds
the check of what it hands over (`capture/contract.py`, here, `autograd/contract.py`,
`lower/contract.py`, `schedule/contract.py`). A broken rule is fuselens's own error: `ContractError`,
which the runtime's fall-back treats as any internal error (the function or graph runs eagerly,
with a warning naming the node or buffer and the rule).

This module: that mechanism, and the primitive graph's contract (ops → autograd, and the graphs
autograd hands to lower)."""
from __future__ import annotations

import os

import torch
import torch.fx as fx

from .primitives import PRIMITIVES, Primitive


class ContractError(RuntimeError):
    """A stage handed over what its contract excludes (an internal error of fuselens)."""


# every contract broken in a verified hand-over of this process (tests/conftest.py asserts none)
VIOLATIONS: list[str] = []


def enabled() -> bool:
    return os.environ.get("FUSELENS_VERIFY", "") == "1"


def verify(check, *args) -> None:
    """`check(*args)` where FUSELENS_VERIFY=1: a hand-over between stages."""
    if not enabled():
        return
    try:
        check(*args)
    except ContractError as e:
        VIOLATIONS.append(str(e))
        raise


def expect(holds, stage: str, what: str, rule: str) -> None:
    """`rule`, of `stage`'s contract, holds for `what` (a node, a buffer), or a ContractError says so."""
    if not holds:
        raise ContractError(f"{stage} contract: {what}: {rule}")


def node_name(n: fx.Node) -> str:
    target = getattr(n.target, "__name__", n.target) if n.op != "placeholder" else "placeholder"
    return f"node {n.name} ({target})"


def check_node_order(graph: fx.Graph, stage: str) -> None:
    """Every node's inputs are nodes of the graph defined before it; one `output` node, last."""
    seen: set = set()
    nodes = list(graph.nodes)
    expect(nodes and nodes[-1].op == "output" and sum(n.op == "output" for n in nodes) == 1, stage, "the graph",
           "has one output node, its last")
    for n in nodes:
        for a in n.all_input_nodes:
            expect(a in seen, stage, node_name(n), f"reads {a.name}, which is not defined before it in the graph")
        seen.add(n)


def is_meta_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "meta"


STAGE = "primitive graph"
KINDS = ("pointwise", "reduction", "view", "source", "random", "extern", "item")


def check_primitive_graph(graph: fx.Graph, stage: str = STAGE) -> None:
    """The primitive graph (docs/architecture.md, "ops → autograd")."""
    check_node_order(graph, stage)
    placeholders_done = False
    for n in graph.nodes:
        what = node_name(n)
        expect(n.op in ("placeholder", "call_function", "output"), stage, what,
               f"is a {n.op} node (placeholders, call_function and one output only)")
        if n.op == "placeholder":
            expect(not placeholders_done, stage, what, "comes after an op (placeholders come first)")
            val = n.meta.get("val")
            expect(is_meta_tensor(val) or n.meta.get("seed") and isinstance(val, int), stage, what,
                   f"meta['val'] is a meta tensor (or the int seed, meta['seed']), not {type(val).__name__}")
        elif n.op == "call_function":
            placeholders_done = True
            _check_primitive_call(n, what, stage)
        else:
            expect(isinstance(n.args[0], tuple), stage, what, "returns a flat tuple")
            for o in n.args[0]:
                expect(not isinstance(o, fx.Node) or is_meta_tensor(o.meta.get("val")) or
                       isinstance(o.meta.get("val"), int), stage, what,
                       f"returns {getattr(o, 'name', o)}, which is no tensor and no int")


def _check_primitive_call(n: fx.Node, what: str, stage: str) -> None:
    p = n.target
    expect(isinstance(p, Primitive) and PRIMITIVES.get(p.name) is p, stage, what,
           "its target is a Primitive registered in ops/primitives.py's PRIMITIVES")
    expect(p.kind in KINDS, stage, what, f"its primitive's kind {p.kind!r} is one of {', '.join(KINDS)}")
    expect("loc" in n.meta, stage, what, "has meta['loc'] (a source location, or None)")
    val = n.meta.get("val")
    if p.kind == "item":
        tup, index = n.args
        expect(isinstance(tup, fx.Node) and isinstance(tup.meta.get("val"), tuple) and isinstance(index, int)
               and 0 <= index < len(tup.meta["val"]), stage, what, "picks an item of a tuple-valued node by its index")
        expect(is_meta_tensor(val), stage, what, "meta['val'] is a meta tensor")
        return
    expect(is_meta_tensor(val) or isinstance(val, tuple) and p.kind == "extern", stage, what,
           f"meta['val'] is a meta tensor (a tuple for an extern), not {type(val).__name__}")
    operands = n.all_input_nodes
    for a in operands:
        expect(not isinstance(a.meta.get("val"), tuple), stage, what,
               f"reads the tuple of {a.name} whole (its items are read through `item`)")
    if p.kind in ("source", "random"):
        expect(not any(is_meta_tensor(a.meta.get("val")) for a in operands), stage, what,
               f"a {p.kind} primitive reads no tensor")
    elif p.kind in ("reduction", "view"):
        x = n.args[0] if n.args else None
        expect(isinstance(x, fx.Node) and is_meta_tensor(x.meta.get("val")), stage, what,
               f"a {p.kind} primitive's first argument is a tensor")
        if p.kind == "reduction":
            dims = n.args[1]
            dims = dims if isinstance(dims, (tuple, list)) else (dims,)
            rank = x.meta["val"].dim()
            expect(all(isinstance(d, int) and -rank <= d < max(rank, 1) for d in dims), stage, what,
                   f"reduces dims {list(dims)} of a {rank}-d tensor")
            expect(val.dim() == rank, stage, what, "a reduction keeps its reduced dims (size 1)")
    elif p.kind == "pointwise":
        expect(all(is_meta_tensor(a.meta.get("val")) for a in operands), stage, what,
               "a pointwise primitive's node operands are tensors")
