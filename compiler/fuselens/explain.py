"""`fuselens.explain` and `fuselens.inspect`: what capture did, as values and as a report."""
from __future__ import annotations

import linecache
from dataclasses import dataclass, field

from .capture.breaks import GraphBreak
from .capture.capture import GraphInfo


@dataclass
class Explanation:
    graphs: list[GraphInfo]
    graph_breaks: list[GraphBreak]
    guards: list
    entries: list = field(default_factory=list)
    disabled: str | None = None  # why the compiled function runs eagerly now (its recompile limit)

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def recompiles(self) -> list[tuple[str, str, dict]]:
        """(function, the guard of the entry before that failed, the dims dynamic since) of each
        recompile."""
        return [(e.function, e.recompiled_because, dict(e.dynamic_dims)) for e in self.entries if e.recompiled_because]

    def recompile_lines(self) -> list[str]:
        """Each recompile in words: `recompiled f because k == 1 failed; dynamic since: x dims [0]`."""
        out = []
        for function, because, dynamic in self.recompiles:
            dims = "; dynamic since: " + ", ".join(f"{src} dims {dims}" for src, dims in dynamic.items()) if dynamic else ""
            out.append(f"recompiled {function} because {because} failed{dims}")
        return out

    def __str__(self) -> str:
        out = [f"{len(self.graphs)} graph(s), {len(self.graph_breaks)} graph break(s)", *self.recompile_lines()]
        if self.disabled:
            out.append(f"running eagerly now: {self.disabled}")
        for i, g in enumerate(self.graphs):
            out.append(f"\nGraph {i}: {g.function}, lines {g.line_range()}, {g.op_count} op(s)")
            out.append("    " + "\n    ".join(_graph_lines(g)))
        for b in self.graph_breaks:
            out.append("\n" + format_break(b))
        return "\n".join(out)


def _graph_lines(g: GraphInfo) -> list[str]:
    lines = []
    for n in g.graph.nodes:
        if n.op == "placeholder":
            lines.append(f"{n.name} = input {n.meta.get('source', '')}")
        elif n.op == "call_function":
            t = n.target
            name = getattr(t, "__qualname__", None) or getattr(t, "__name__", str(t))
            mod = getattr(t, "__module__", "") or ""
            if name.startswith("_VariableFunctionsClass."):
                name = "torch." + t.__name__
            elif mod.startswith("torch.nn.functional"):
                name = "F." + name
            elif mod.startswith("torch") and not name.startswith(("Tensor", "TensorBase")):
                name = "torch." + name
            elif mod == "_operator":
                name = "operator." + name
            args = ", ".join(str(a) for a in n.args)
            kw = ", ".join(f"{k}={v}" for k, v in n.kwargs.items())
            lines.append(f"{n.name} = {name}({args}{', ' + kw if kw else ''})")
        elif n.op == "output":
            lines.append(f"return {n.args[0]}")
    return lines


def format_break(b: GraphBreak) -> str:
    tc = f" (torch.compile: {b.torch_code})" if b.torch_code else ""
    out = [f"{b.location()}: {b.code} {b.title}{tc}"]
    for f in b.stack:
        out.append(f"  called from {f.filename}:{f.line}:{f.col + 1} in {f.function}")
    src = linecache.getline(b.filename, b.line).rstrip("\n")
    if src:
        end = b.end_col if b.end_line == b.line else len(src)
        out.append(f"    {src}")
        out.append("    " + " " * b.col + "^" * max(1, end - b.col))
    out.append(f"  {b.explanation}")
    out.append(f"  hint: {b.hint}")
    return "\n".join(out)
