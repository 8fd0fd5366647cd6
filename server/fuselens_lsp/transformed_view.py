"""The transformed code as the editor shows it: the compiler's source as is (it is what runs),
under a header that says what each of the compiler's own names in it means, and which object
each `__fl_rN` stands for."""
from __future__ import annotations

import ast
import re
import textwrap

_INTERNAL = re.compile(r"\b__fl_[A-Za-z0-9_]*")
_REF = re.compile(r"__fl_r\d+$")

#: (pattern, what the names mean), the first match wins
_MEANINGS = [
    (re.compile(r"__fl_graph_\w+$"), "runs a compiled graph (its kernels are in the fuselens panel)"),
    (re.compile(r"__fl_o$"), "the outputs of the graph call just before"),
    (re.compile(r"__fl_resume_\w+$"), "the rest of the function after a graph break or a branch (below)"),
    (re.compile(r"__fl_t\d+$"), "a value a graph computed for the Python code at a break"),
    (re.compile(r"__fl_break_\w+$"), "a statement that breaks the graph inside a called function, in Python"),
    (re.compile(r"__fl_ret$"), "the result of the call the graph break was in"),
]


def _ref_sources(source: str) -> dict[str, str]:
    """`__fl_r0, __fl_r1 = self.config, self.layer` (bound on entry) -> {name: source}."""
    out = {}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t, v = node.targets[0], node.value
            names = t.elts if isinstance(t, ast.Tuple) else [t]
            values = v.elts if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) else [v]
            if len(names) == len(values) and all(isinstance(n, ast.Name) and _REF.match(n.id) for n in names):
                out.update((n.id, ast.unparse(x)) for n, x in zip(names, values))
    return out


def explained(source: str, qualname: str) -> str:
    """`source` under a comment header naming the compiler's names it uses."""
    names = sorted(set(_INTERNAL.findall(source)), key=lambda n: (len(n), n))
    if not names:
        return source
    refs = _ref_sources(source)
    width = max(len(n) for n in names)
    entries, other = [], False
    for name in names:
        meaning = f"`{refs[name]}`, bound on entry" if name in refs else \
            next((m for p, m in _MEANINGS if p.match(name)), None)
        if meaning is None:
            other = True
        else:
            entries.append((name, meaning))
    notes = []
    if refs:
        notes.append("Writes to a __fl_rN below are the function's own, made on the real object after the "
                     "graph, as in eager.")
    if other:
        notes.append("Other __fl_ names are the compiler's own helpers and temporaries.")
    # the view opens in a column beside the source: narrow lines, each meaning under its name
    wrapped = textwrap.wrap(f"What fuselens runs for `{qualname}` (read-only). The names it adds:", 62,
                            initial_indent="# ", subsequent_indent="# ")
    for name, meaning in entries:
        wrapped += textwrap.wrap(f"{name:<{width}}  {meaning}", 60, initial_indent="#   ",
                                 subsequent_indent="#   " + " " * (width + 2))
    for note in notes:
        wrapped += textwrap.wrap(note, 62, initial_indent="# ", subsequent_indent="# ")
    return "\n".join(wrapped) + "\n\n" + source
