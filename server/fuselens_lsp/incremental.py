"""Per-function caching of the abstract-domain analysis, so that an edit re-analyses only what it
can change.

A file is split into units (its top-level `def`s and `class`es, decorators included) and the
context (every other top-level statement: imports, assignments, `torch.compile(...)` calls).
What the analysis says about a unit depends only on its own text, the text of the units it can
reach by name (callees, base classes, classes it instantiates: capture inlines them; a global
the context binds leads to the units its statement names), the context; and, through
`_compiled_names`, on every `compile(...)` call and `name = Class(...)` assignment anywhere in
the file. A unit's results
are cached under a hash of exactly that, with the units' start lines remembered: on a hit the
results are moved to where the units are now. On a miss, the capture runs on the file with
every unit it does not need blanked out (line breaks kept, so positions stay exact).

The capture itself is untouched: this is the same `analyze_source`, on less text.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
from dataclasses import dataclass

from .analysis import lines_with_ends


@dataclass
class _Unit:
    name: str
    start: int          # 1-based, first decorator included
    end: int
    text: str
    refs: frozenset     # names it mentions (Name ids and attribute names)
    compiles: str       # its compile(...) calls, as text
    instances: tuple    # its `x = Name(...)` assignments: (Name, text)
    h: str              # hash of its text


@dataclass
class _Cached:
    functions: list     # FunctionAnalysis values, in the coordinates of `starts`
    starts: dict        # (name, text hash) of each unit in its reach -> its start line then
    spans: list         # [(start, end, key)] of those units then


@dataclass
class _Stmt:
    """A top-level statement: its node (whose own line numbers are `offset` lines behind where
    it is now: it was parsed alone or before lines were added above it) and its span now."""
    node: ast.stmt
    start: int          # 1-based, first decorator included
    end: int
    offset: int


def _first_line(s) -> int:
    return min([d.lineno for d in getattr(s, "decorator_list", ())] + [s.lineno])


@dataclass
class Result:
    functions: list
    syntax_error: tuple | None = None


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def _facts(node) -> tuple[frozenset, str, tuple]:
    refs, compiles, instances = set(), [], []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            refs.add(n.id)
        elif isinstance(n, ast.Attribute):
            refs.add(n.attr)
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "compile":
                compiles.append(ast.unparse(n))
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name):
            instances.append((n.value.func.id, ast.unparse(n)))
    return frozenset(refs), "\n".join(compiles), tuple(instances)


class IncrementalAnalyzer:
    """One per document; not thread-safe (the server analyses in one thread)."""

    def __init__(self, limit: int = 4096):
        self.cache: dict[str, _Cached] = {}
        self.unit_facts: dict[str, tuple] = {}   # unit text hash -> (refs, facts)
        self.limit = limit
        self.hits = self.misses = 0
        self.prev: tuple | None = None  # (lines, outline) of the last text analysed
        self.reach_by_shape: tuple | None = None  # (names of the units, the units each reaches)
        self.memo: dict = {}  # analysis.analyze's per-function results, by FunctionAnalysis

    def outline(self, source: str, filename: str) -> list[_Stmt]:
        """The file's top-level statements. After an edit inside one statement only that
        statement is parsed again (a 3,000-line file takes 30-100 ms to parse): the text around
        it is unchanged and each top-level statement parses on its own, so the file parses as
        before. Anything else (an edit between statements, a statement split or merged, a
        syntax error) parses the whole file, which raises the error `ast.parse` gives."""
        lines = lines_with_ends(source)
        prev, self.prev = self.prev, None
        stmts = self._reparse_one(prev, lines, filename) if prev is not None else None
        if stmts is None:
            tree = ast.parse(source, filename)
            stmts = [_Stmt(s, _first_line(s), s.end_lineno, 0) for s in tree.body]
        self.prev = (lines, stmts)
        return stmts

    @staticmethod
    def _reparse_one(prev, lines: list[str], filename: str) -> list[_Stmt] | None:
        old, stmts = prev
        n = min(len(old), len(lines))
        p = 0
        while p < n and old[p] == lines[p]:
            p += 1
        if p == len(old) == len(lines):
            return stmts
        q = 0
        while q < n - p and old[-1 - q] == lines[-1 - q]:
            q += 1
        delta = len(lines) - len(old)
        for i, st in enumerate(stmts):  # the statement holding every changed line (1-based span)
            if st.start - 1 <= p and len(old) - q <= st.end:
                break
        else:
            return None
        chunk = "".join(lines[st.start - 1:st.end + delta])
        if not chunk.endswith("\n"):
            return None
        try:
            body = ast.parse(chunk, filename).body
        except (SyntaxError, ValueError):
            return None  # (the whole file, parsed, reports it)
        if len(body) != 1 or _first_line(body[0]) != 1:
            return None
        new = _Stmt(body[0], st.start, st.start - 1 + body[0].end_lineno, st.start - 1)
        moved = [dataclasses.replace(x, start=x.start + delta, end=x.end + delta, offset=x.offset + delta)
                 for x in stmts[i + 1:]] if delta else stmts[i + 1:]
        return stmts[:i] + [new] + moved

    def analyze(self, source: str, filename: str, analyze_source, key: str = "") -> Result:
        """`key`: what else `analyze_source` depends on (the classes other files compile).
        Raises what `ast.parse` raises on a text that does not parse."""
        lines = lines_with_ends(source)
        units, context = [], []
        outline = self.outline(source, filename)
        for st in outline:
            s = st.node
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = st.start
                text = "".join(lines[start - 1:st.end])
                th = _digest(text)
                rf = self.unit_facts.get(th)
                if rf is None:
                    rf = self.unit_facts[th] = _facts(s)
                units.append(_Unit(s.name, start, st.end, text, *rf, th))
            else:
                context.append(st)
        if len(self.unit_facts) > self.limit:
            self.unit_facts.clear()
        ctx_text = "".join("".join(lines[st.start - 1:st.end]) for st in context)
        # a global the context binds (`model = Block3(64)`) leads to the units its statement
        # names: a unit that uses the global can reach (inline) them
        ctx_vars: dict[str, set] = {}
        for st in context:
            s = st.node
            refs = _facts(s)[0]
            for n in ast.walk(s):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    ctx_vars.setdefault(n.id, set()).update(refs - {n.id})
        by_name: dict[str, list[_Unit]] = {}
        for u in units:
            by_name.setdefault(u.name, []).append(u)

        def closure(seed_refs) -> list[_Unit]:
            seen, names, todo, out = set(), set(), list(seed_refs), []
            while todo:
                n = todo.pop()
                if n in names:
                    continue
                names.add(n)
                todo.extend(ctx_vars.get(n, ()))
                for u in by_name.get(n, ()):
                    if id(u) not in seen:
                        seen.add(id(u))
                        out.append(u)
                        todo.extend(u.refs)
            return out

        classes = {st.node.name for st in outline if isinstance(st.node, ast.ClassDef)}
        # which functions and classes are compiled may follow from any unit's compile(...) calls
        # and instance assignments (capture's _compiled_names reads them all)
        everywhere = _digest(key, ctx_text, *[u.compiles for u in units],
                             *[t for u in units for name, t in u.instances if name in classes])
        # which units each unit reaches follows from names alone: kept (as positions in the
        # file's list of units) while no unit's name or names used change, as when typing
        shape = (tuple((u.name, u.refs) for u in units), tuple(sorted((k, frozenset(v)) for k, v in ctx_vars.items())))
        if self.reach_by_shape is None or self.reach_by_shape[0] != shape:
            index = {id(u): i for i, u in enumerate(units)}
            self.reach_by_shape = (shape, [sorted({index[id(x)] for x in closure(u.refs | {u.name})} | {i})
                                           for i, u in enumerate(units)])
        keys, reach = {}, {}
        for u, positions in zip(units, self.reach_by_shape[1]):
            reach[id(u)] = [units[j] for j in positions]
            keys[id(u)] = _digest(everywhere, u.h, *[x.h for x in reach[id(u)]])

        out: dict[int, list] = {}
        missed = []
        for u in units:
            hit = self.cache.get(keys[id(u)])
            moved = self._move(hit, u, reach[id(u)], filename) if hit is not None else None
            if moved is None:
                missed.append(u)
            else:
                out[id(u)] = moved
        self.hits += len(units) - len(missed)
        self.misses += len(missed)
        if missed:
            need = {id(x) for u in missed for x in reach[id(u)]}
            keep = list(lines)
            for u in units:
                if id(u) not in need:
                    for i in range(u.start - 1, u.end):
                        keep[i] = keep[i][len(keep[i].rstrip("\r\n")):]
            res = analyze_source("".join(keep), filename)
            if res.syntax_error is not None:  # cannot happen (blanking whole units): analyse it all
                return Result(res.functions, res.syntax_error)
            for u in missed:
                fns = [f for f in res.functions if u.start <= f.line <= u.end]
                out[id(u)] = fns
                if len(self.cache) > self.limit:
                    self.cache.clear()
                self.cache[keys[id(u)]] = _Cached(
                    fns, {(x.name, x.h): x.start for x in reach[id(u)]},
                    [(x.start, x.end, (x.name, x.h)) for x in reach[id(u)]])
        return Result([f for u in units for f in out[id(u)]])

    @staticmethod
    def _move(hit: _Cached, u: _Unit, reach: list[_Unit], filename: str) -> list | None:
        """The cached functions, their lines moved to where their units are now (None: cannot)."""
        now = {(x.name, x.h): x.start for x in reach}
        delta = {}
        for k, old in hit.starts.items():
            if k not in now:
                return None
            delta[k] = now[k] - old
        if all(d == 0 for d in delta.values()):
            return hit.functions

        def shift(line):
            if line is None:
                return None
            for a, b, k in hit.spans:
                if a <= line <= b:
                    return line + delta[k]
            raise LookupError(line)

        def here(fn):
            return not fn or fn == filename
        try:
            fns = []
            for f in hit.functions:
                breaks = []
                for b in f.breaks:
                    stack = tuple(dataclasses.replace(fr, line=shift(fr.line), end_line=shift(fr.end_line))
                                  if here(fr.filename) else fr for fr in b.stack)
                    if here(b.filename):
                        b = dataclasses.replace(b, line=shift(b.line), end_line=shift(b.end_line), stack=stack)
                    else:
                        b = dataclasses.replace(b, stack=stack)
                    breaks.append(b)
                fns.append(dataclasses.replace(f, line=shift(f.line), end_line=shift(f.end_line), breaks=breaks))
            return fns
        except LookupError:  # a position outside the units (in the context): recompute
            return None
