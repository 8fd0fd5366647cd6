"""In-place writes into a graph's inputs made in place again (a language model's KV cache).

Capture functionalizes every in-place write: `cache.index_copy_(2, pos, k)` becomes a graph node
computing the cache's new value, which the runtime then copies into the cache. For a decode step
that is two passes over every cache it writes (the copy the node makes, the copy back) where eager
writes one row. Where nothing else reads the input, nothing else may see its memory and no
gradient is recorded, the graph's node is given its in-place form instead: it writes the input and
returns it, and the runtime, finding the input itself as its new value, copies nothing.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..backend.driver import copy_graph
from ..capture.tensors import functional_setitem
from ..ops.decompositions.writes import setitem_in_place


_aten = torch.ops.aten
# a functional form capture records for an in-place write -> the write itself, returning its input
IN_PLACE = {
    functional_setitem: setitem_in_place,
    _aten.index_copy.default: _aten.index_copy_.default,
    _aten.index_put.default: _aten.index_put_.default,
    _aten.index_fill.int_Scalar: _aten.index_fill_.int_Scalar,
    _aten.masked_fill.Scalar: _aten.masked_fill_.Scalar,
    _aten.scatter.src: _aten.scatter_.src,
    _aten.scatter.value: _aten.scatter_.value,
}


def _accumulates(node) -> bool:
    """`index_put(..., accumulate=True)`: not a write that may happen twice (a graph that failed
    after it runs again eagerly), so it stays functional."""
    return node.target is _aten.index_put.default and bool(
        node.kwargs.get("accumulate", node.args[3] if len(node.args) > 3 else False))


def reinplace(gm: fx.GraphModule, inputs, written: list[int]) -> fx.GraphModule:
    """`gm` with the writes into graph inputs made in place where that is eager's effect; `written`:
    the input index each of the graph's last outputs is the new value of. `gm` itself if none."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return gm  # (the functional form is what autograd differentiates)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    news = outs[len(outs) - len(written):]
    storages = [t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
    rewrites = []
    for k, new in zip(written, news):
        p = placeholders[k]
        if not isinstance(new, fx.Node) or new.target not in IN_PLACE or not new.args or new.args[0] is not p \
                or set(p.users) != {new} or storages.count(storages[k]) > 1 or list(outs).count(new) > 1 \
                or _accumulates(new):
            continue  # (read elsewhere, sharing memory with another input, or returned twice)
        rewrites.append(new)
    if not rewrites:
        return gm
    graph, copies = copy_graph(gm)
    for n in rewrites:
        copies[n].target = IN_PLACE[n.target]
    return fx.GraphModule(gm, graph)
