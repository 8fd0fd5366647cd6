"""Which of a file's functions the compiler can reach: the compiled ones, every module's
`forward`, and what those refer to (directly or through each other). The other functions
(helpers of `__init__`, of scripts, weight initialisers) are never captured, so breaks in them
are not worth a diagnostic unless the user asks for all (`fuselens.uncompiledFunctions`).

Syntactic and generous on purpose: any name or attribute a reached function mentions that
names a function of the file (a top-level function, or a method of any class of the file) is
reached too, whether it is called, passed on (`checkpoint(self.block, x)`) or only read."""
from __future__ import annotations

import ast

ROOT_METHODS = frozenset({"forward"})


def reachable(source: str, compiled: set[str]) -> set[str] | None:
    """Qualnames (`f`, `Class.method`, as the analysis names them) reached from `compiled`
    and from every `forward`; None when the source does not parse (then nothing is hidden)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    bodies: dict[str, ast.AST] = {}
    by_name: dict[str, set[str]] = {}    # bare name -> qualnames it may mean
    for s in tree.body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bodies[s.name] = s
            by_name.setdefault(s.name, set()).add(s.name)
        elif isinstance(s, ast.ClassDef):
            for f in s.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    q = f"{s.name}.{f.name}"
                    bodies[q] = f
                    by_name.setdefault(f.name, set()).add(q)
    todo = [q for q in bodies if q in compiled or q.rpartition(".")[2] in ROOT_METHODS and "." in q]
    seen = set(todo)
    while todo:
        for node in ast.walk(bodies[todo.pop()]):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            for q in by_name.get(name, ()):
                if q not in seen:
                    seen.add(q)
                    todo.append(q)
    return seen
