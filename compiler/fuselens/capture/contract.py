"""The contract of what capture hands the backend (docs/architecture.md, "Stage contracts" and
"capture → backend: the FX graph"): the captured graph's nodes and their metadata. Checked where
capture makes the graph module (capture.py) when FUSELENS_VERIFY=1."""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ops.contract import check_node_order, expect, is_meta_tensor, node_name

STAGE = "captured graph"


def _is_loc(loc) -> bool:
    return isinstance(loc, tuple) and len(loc) == 5 and isinstance(loc[0], str) and \
        all(isinstance(x, int) for x in loc[1:])


def check_captured(gm: fx.GraphModule) -> None:
    stage = STAGE
    graph = gm.graph
    check_node_order(graph, stage)
    ops_begun = False
    for n in graph.nodes:
        what = node_name(n)
        val = n.meta.get("val")
        if n.op == "placeholder":
            expect(not ops_begun, stage, what, "comes before the first op (placeholders come first)")
            expect(is_meta_tensor(val), stage, what, f"meta['val'] is a meta tensor, not {type(val).__name__}")
            expect(isinstance(n.meta.get("device"), torch.device), stage, what,
                   "meta['device'] is the input's torch.device")
            expect(isinstance(n.meta.get("source"), str), stage, what, "meta['source'] is where the input is found")
        elif n.op == "get_attr":
            const = getattr(gm, n.target, None)
            expect(hasattr(gm, n.target) and not isinstance(const, torch.Tensor), stage, what,
                   "names a constant of the graph module that is no tensor")
            expect(n.meta.get("val") is const, stage, what, "meta['val'] is the constant")
            expect(all(u.op == "call_function" for u in n.users), stage, what, "is an argument of calls only")
        elif n.op == "call_function":
            ops_begun = True
            expect(callable(n.target), stage, what, "calls a function")
            sized = isinstance(val, (int, bool)) and not isinstance(val, torch.Tensor)
            expect(is_meta_tensor(val) or sized or isinstance(val, tuple) and
                   all(v is None or is_meta_tensor(v) for v in val), stage, what,
                   f"meta['val'] is a meta tensor, a tuple of them, or a size's int, not {type(val).__name__}")
            if not sized:
                expect(_is_loc(n.meta.get("loc")), stage, what,
                       f"meta['loc'] is (filename, line, col, end_line, end_col), not {n.meta.get('loc')!r}")
                expect(isinstance(n.meta.get("device"), torch.device), stage, what,
                       "meta['device'] is the result's torch.device")
            written = n.meta.get("writes")
            expect(written is None or isinstance(written, fx.Node) and written.graph is graph, stage, what,
                   "meta['writes'] is a node of the graph")
        else:
            expect(n.op == "output", stage, what, f"is a {n.op} node (placeholders, call_function, get_attr, output)")
            expect(isinstance(n.args[0], tuple) and all(isinstance(o, fx.Node) for o in n.args[0]), stage, what,
                   "returns a flat tuple of nodes")
