"""`fuselens.inspect`: what a compiled function became, as plain data.

One `Entry` per cache entry (resume functions' included), each with its guards, transformed
source, graphs (with their kernels, each kernel's bytes moved and the source lines it computes)
and the graph break that ended it. Everything is a dataclass of strings, numbers and lists:
tools (the editor's worker, reports, tests) read these and never the runtime's objects.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .capture.breaks import Frame, GraphBreak
from .runtime.compiled import compiled_of

__all__ = ["inspect", "Entry", "Graph", "Kernel", "KernelLine", "Guard", "GraphBreak", "Frame"]


@dataclass(frozen=True)
class KernelLine:
    """Kernel source line `kernel_line` (0-based) computes source line `line` (1-based) of `filename`."""
    kernel_line: int
    filename: str
    line: int


@dataclass
class Kernel:
    name: str
    source: str                               # Triton, or C++ (a CPU graph's kernels: `language`)
    bytes_moved: int | None                   # of its tensor arguments; None with dynamic sizes
    source_lines: list[tuple[str, int]]       # (filename, 1-based line) it computes, sorted
    provenance: list[KernelLine] = field(default_factory=list)
    language: str = "triton"                  # "triton" | "cpp"


@dataclass
class Graph:
    name: str
    function: str                             # the function (or resume function) it was captured from
    ir: str                                   # the FX graph, printed
    op_count: int
    io_bytes: int | None                      # bytes of its tensor inputs and outputs
    kernels: list[Kernel]                     # empty until the graph's first call compiles it
    wrapper: str | None                       # the Python that launches the kernels


@dataclass(frozen=True)
class Guard:
    expr: str
    reason: str


@dataclass
class Entry:
    function: str
    guards: list[Guard]
    source: str                               # the transformed function, as Python
    graphs: list[Graph]
    graph_break: GraphBreak | None
    # a recompile (entries after a function's first): the guard of the entry before that failed,
    # in words ("x.shape[1] == 7"); the dims dynamic in this entry ({"x": [1]}: no recompile for them)
    recompiled_because: str | None = None
    dynamic_dims: dict[str, list[int]] = field(default_factory=dict)

    @property
    def kernels(self) -> list[Kernel]:
        return [k for g in self.graphs for k in g.kernels]

    @property
    def wrappers(self) -> list[str]:
        return [g.wrapper for g in self.graphs if g.wrapper]


def inspect(compiled) -> list[Entry]:
    """The cache entries of what `fuselens.compile` returned (a function, method or module)."""
    cf = compiled_of(compiled)
    if cf is None:
        raise TypeError("fuselens.inspect expects what fuselens.compile returned")
    return [_entry(e) for e in cf.all_entries()]


def _entry(e) -> Entry:
    graphs = [_graph(gc.info, gc) for gc in e.graph_calls]
    return Entry(e.function, [Guard(g.expr, g.reason) for g in e.guards], e.source, graphs, e.graph_break,
                 e.recompiled_because, dict(e.dynamic_dims))


def _graph(info, call) -> Graph:
    return Graph(info.name, info.function, str(info.gm.graph), info.op_count, _io_bytes(info.gm.graph),
                 [_kernel(k) for k in call.kernels], call.wrapper_source or None)


# codegen/kernel_expressions.py's loc_comment: `  # model.py:12  y = x * w` at the end of a kernel
# line (`  // model.py:12 ...` in C++)
_LOC_RE = re.compile(r"  (?:#|//) ([^\s:]+\.py):(\d+)(?:  |$)")


def _kernel(k) -> Kernel:
    by_base = {}
    for filename, _ in k.source_lines:
        by_base.setdefault(os.path.basename(filename), filename)
    prov = []
    for i, text in enumerate(k.source.split("\n")):
        m = _LOC_RE.search(text)
        if m and m.group(1) in by_base:
            prov.append(KernelLine(i, by_base[m.group(1)], int(m.group(2))))
    language = "cpp" if 'extern "C"' in k.source else "triton"
    return Kernel(k.name, k.source, k.bytes_moved, [tuple(x) for x in k.source_lines], prov, language)


def _io_bytes(graph) -> int | None:
    """The least memory traffic of any implementation of the graph: its tensor inputs read once,
    its outputs written once (the bandwidth of a graph that is one kernel)."""
    import torch

    def nbytes(v):
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    total = 0
    for n in graph.nodes:
        if n.op == "placeholder":
            total += nbytes(n.meta.get("val"))
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
            total += sum(nbytes(o.meta.get("val")) for o in outs if hasattr(o, "meta"))
    return total or None
