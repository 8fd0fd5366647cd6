"""Capture in the concrete domain: one call of a function with real arguments → one cache
entry's worth of data (graphs, guards, the transformed function's source, resumes)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..ops.contract import verify
from . import breaks as B
from .contract import check_captured
from .evaluator import Evaluator
from .frames import BreakSignal, Guard
from .graph import GraphBuilder
from .guards import Sources
from .resume import Resume, Writer, signature
from .source import FunctionSource


@dataclass
class GraphInfo:
    """One captured graph. `inputs`: source expressions of its placeholders; the last
    `n_writeback` outputs are new values of mutated inputs `writeback` (sources)."""
    gm: fx.GraphModule
    inputs: list[str]
    writeback: list[str]
    function: str
    lines: list[tuple[str, int]]
    op_count: int
    name: str = "__fl_graph_0"

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def line_range(self) -> str:
        if not self.lines:
            return "-"
        ls = sorted({l for _, l in self.lines})
        return f"{ls[0]}-{ls[-1]}" if ls[0] != ls[-1] else str(ls[0])


@dataclass
class Capture:
    fs: FunctionSource
    source: str                       # the transformed function (and break helpers), as shown
    namespace: dict                   # constants the source refers to
    guards: list[Guard]
    guard_source: str
    graph: GraphInfo | None
    graph_break: B.GraphBreak | None
    resumes: list[Resume] = field(default_factory=list)
    tensor_shapes: dict = field(default_factory=dict)  # source -> shape, for dynamic dims
    function_source: str = ""        # the transformed function alone
    # break helpers: (name, source, globals): each runs a statement of an inlined function, with
    # that function's module globals (a callee from another module names its own globals)
    helpers: list = field(default_factory=list)
    files: set = field(default_factory=set)  # of the functions it ran (runtime/capture_cache.py)
    process_state: tuple = ((), ())  # Evaluator.process_reads' items, process_unchecked
    # the transformed function's and the guard function's code (source.factory_code), once compiled
    codes: dict = field(default_factory=dict)
    # source -> dims of its graph input that are dynamic (unguarded sizes: `sym_size` nodes)
    dynamic: dict = field(default_factory=dict)


def capture(fs: FunctionSource, args, kwargs, *, dynamic=None, fullgraph=False,
            prefix="", compile_callee=None) -> Capture:
    # compile_callee: the runtime's function giving a callee compiled on its own, for the calls in a
    # statement run in Python after a break (resume.Writer.compiling_calls); passed in, as the
    # runtime is a layer above capture
    dynamic = {} if dynamic is None else dynamic  # (dims marked dynamic are added: the caller's)
    builder = GraphBuilder()
    probe = Evaluator(builder)
    bound = probe.bind(fs, args, kwargs)
    sources = Sources(bound)
    tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
    sources.global_state(sorted({t.device.type for t in tensors}) if tensors else ("cpu", "cuda"))
    ev = Evaluator(builder, sources=sources, dynamic=dynamic)
    frame = {name: _wrap_argument(ev, sources, name, v) for name, v in bound.items()}
    for name, v in fs.closure.items():
        cell = fs.cells.get(name)
        v = cell.cell_contents if cell is not None else v  # fs is cached: read the cell anew
        src = f"{sources.constant(cell, 'cell_' + name)}.cell_contents" if cell is not None \
            else sources.constant(v, name)
        if not isinstance(v, torch.Tensor):
            sources.guard_value(src, v)
        frame[name] = ev.wrap_external(v, src)
    graph_name = f"__fl_graph_{prefix}0"
    brk = None
    writer = Writer(fs, sources, ev.tensor_writes.inputs, prefix, ev.effects, ev.tensor_writes.latest,
                    ev.value_sources, compile_callee)
    try:
        ret = ev.run(fs, frame)
        sig_text, consts = signature(fs.node.args, fs.defaults)
        sources.constants.update(consts)
        ret_expr = writer.mat.expr(ret)
        before, after = writer.mat.replay_parts()
        body = writer.finish(_graph_call(graph_name, builder) if builder.n_ops else None,
                             after + [f"return {ret_expr}"], before)
        text = "\n".join([f"def {fs.name}({sig_text}):"] + ["    " + b for b in body])
    except BreakSignal as sig:
        if fullgraph:
            raise B.GraphBreakError(sig.brk) from None
        brk = sig.brk
        call = _graph_call(graph_name, builder)
        text = writer.write(sig, call if builder.n_ops else None)
    graph = None
    if builder.n_ops:
        writeback = [src for src, v in ev.tensor_writes.inputs.items()]
        gm = builder.output(list(writer.mat.outputs) + [ev.tensor_writes.inputs[s] for s in writeback],
                            {s for s, dims in ev.dynamic.items() if dims})
        verify(check_captured, gm)
        graph = GraphInfo(gm, [s for s, _ in builder.inputs], writeback, fs.qualname,
                          sorted(l for l in builder.lines if l[0] == fs.filename) or sorted(builder.lines),
                          builder.n_ops, graph_name)
    ev.guard_symbolic()
    ev.effects.guard_distinct()
    sources.guard_unshared([s for s, o in builder.inputs if isinstance(o, torch.Tensor)])
    helpers = [(name, src, hfs.globals) for name, src, hfs in writer.helper_sources()]
    source = "\n\n\n".join([text] + [src for _, src, _ in helpers])
    guard_src = _guard_source(fs, sources)
    shapes = {s: tuple(o.shape) for s, o in builder.inputs if isinstance(o, torch.Tensor)}
    if graph is not None:  # run as shown, but reading the graph's inputs faster
        text = sources.fast_graph_call(text, graph_name, graph.inputs)
    return Capture(fs, source, dict(sources.constants), list(sources.guards), guard_src, graph,
                   brk, writer.resumes, shapes, text, helpers, ev.files,
                   process_state=(tuple(ev.process_reads.items()), tuple(ev.process_unchecked)),
                   dynamic={s: frozenset(dynamic[s]) for s, _ in builder.inputs if dynamic.get(s)})


def _graph_call(name, builder) -> tuple:
    return name, [s for s, _ in builder.inputs]


def _wrap_argument(ev: Evaluator, sources: Sources, src: str, v):
    sources.guard_argument(src, v, ev.dynamic)
    return ev.wrap_external(v, src)


def _guard_source(fs: FunctionSource, sources: Sources) -> str:
    sig_text, consts = signature(fs.node.args, fs.defaults)
    sources.constants.update(consts)
    return sources.function_source(sig_text)
