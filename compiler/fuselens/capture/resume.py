"""Writing the transformed function: graph calls, the breaking statement in plain Python, and
resume functions for the rest.

At a graph break the evaluator has unwound with one `FrameAtBreak` per inlined frame. The
transformed function calls the graph (which outputs every live tensor), then:

- break in the function itself (one frame): it binds the live variables, runs the breaking
  statement (sub-expressions already computed by the graph replaced by their values), and
  returns `__fl_resume_N(live...)`, whose body is the rest of the function;
- break inside an inlined call (k+1 frames): the innermost frame's break runs in a small
  plain function `__fl_break_k`, and each enclosing frame continues in a resume function
  that receives the inner call's result as `__fl_ret` (a fresh name where the statement, itself
  a resume function's, already reads one: see `_fresh`).
- data-dependent `if`: the graph computes the condition, Python branches, and each branch
  continues in its own resume function.

Resume functions are captured lazily on their first call, like the user's function."""
from __future__ import annotations

import ast
import builtins
import copy
import functools
import itertools
from dataclasses import dataclass, field

from .frames import BreakSignal, FrameAtBreak, has_loop_jump
from .guards import is_literal
from .materialize import CannotResume, Materializer
from .source import FunctionSource, build_function, copy_ast
from .values import LocalFunction, SymInt, TensorVar


_UIDS = itertools.count()


@dataclass
class Resume:
    """A generated function whose body continues the user's code; captured on first call."""
    name: str
    fs: FunctionSource


@dataclass
class Transformed:
    source: str                              # Python source of the transformed function
    namespace: dict                          # constants it refers to (closure)
    resumes: list[Resume] = field(default_factory=list)


def _super_site(frame):
    """(class, first parameter) of a method whose frame may use zero-argument `super()`."""
    fs = frame.scope.fs
    params = fs.params.posonlyargs + fs.params.args if fs.params is not None else []
    if "__class__" not in fs.closure or not params:
        return None
    return fs.closure["__class__"], params[0].arg


def _has_zero_arg_super(nodes) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "super"
               and not n.args for st in nodes for n in ast.walk(st))


def _position(node) -> tuple:
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


# ------------------------------------------------------------------------------------ names
def loaded_names(nodes) -> set:
    out = set()
    for n in nodes:
        for x in ast.walk(n):
            if isinstance(x, ast.Name):
                out.add(x.id)
    return out


def _walk_scope(node):
    """ast.walk that does not enter comprehensions: their targets are local to them."""
    yield node
    for c in ast.iter_child_nodes(node):
        if not isinstance(c, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            yield from _walk_scope(c)


def stored_names(nodes) -> set:
    out = set()
    for n in nodes:
        for x in _walk_scope(n):
            if isinstance(x, ast.Name) and isinstance(x.ctx, (ast.Store, ast.Del)):
                out.add(x.id)
            elif isinstance(x, (ast.FunctionDef, ast.ClassDef)):
                out.add(x.name)
            elif isinstance(x, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in x.names)
    return out


# ------------------------------------------------------------------------------ continuations
def continuation(levels, include_current: bool, current=None) -> list:
    """The statements that follow the statement at the innermost level (or start with
    `current` in its place), re-entering the enclosing `with` blocks and the rest of static
    `for`/`while` loops. `levels`: (owner, node, stmts, idx, extra), outermost first."""
    tail = None
    for depth in range(len(levels) - 1, -1, -1):
        owner, node, stmts, idx, extra = levels[depth]
        if tail is None:
            if isinstance(current, list):
                head = current
            else:
                head = [current] if current is not None else ([stmts[idx]] if include_current else [])
            inner = head + list(stmts[idx + 1:])
        else:
            inner = tail + list(stmts[idx + 1:])
        tail = _wrap(owner, node, inner, extra)
    return tail or []


def _wrap(owner, node, inner, extra):
    if owner == "try":  # a break in its body (statements.py): the rest of the body, re-entered
        return [ast.copy_location(ast.Try(body=inner or [ast.Pass()], handlers=node.handlers,
                                          orelse=node.orelse, finalbody=node.finalbody), node)]
    if owner == "with":
        return [ast.copy_location(ast.With(items=node.items, body=inner or [ast.Pass()],
                                           type_comment=None), node)] if inner else []
    if owner == "for":
        rest = list(extra or [])
        if rest:
            it = _RestItems(rest)
            loop = ast.copy_location(ast.For(target=node.target, iter=it.name_node(node),
                                             body=node.body, orelse=node.orelse,
                                             type_comment=None), node)
            loop._fl_items = rest
            loop._fl_resumes = getattr(node, "_fl_resumes", 0) + 1
            return _rest_of_iteration(inner, [loop], node)
        return _rest_of_iteration(inner, list(node.orelse), node)
    if owner == "while":
        loop = copy.copy(node)
        loop._fl_resumes = getattr(node, "_fl_resumes", 0) + 1
        return _rest_of_iteration(inner, [loop], node)
    return inner  # function body, static if


def _rest_of_iteration(inner, after, loop):
    """The rest of a loop's current iteration, then `after` (its next iterations, or its
    `else`). Where the rest has a `continue`/`break` of the loop, it runs in a one-pass loop
    whose `else` is `after`: `continue` ends the pass and goes on to `after`, `break` skips it,
    as in the loop itself."""
    if not has_loop_jump(inner):
        return inner + after
    once = ast.For(target=ast.Name(id="__fl_once", ctx=ast.Store()),
                   iter=ast.Tuple(elts=[ast.Constant(value=0)], ctx=ast.Load()),
                   body=inner, orelse=after, type_comment=None)
    ast.copy_location(once, inner[0] if inner else loop)
    return [ast.fix_missing_locations(once)]


class _RestItems:
    """The iterations of an unrolled `for` loop left after a break, passed as a constant."""
    counter = 0

    def __init__(self, items):
        self.items = items
        _RestItems.counter += 1
        self.name = f"__fl_rest_{_RestItems.counter}"

    def name_node(self, at):
        n = ast.Name(id=self.name, ctx=ast.Load())
        n._fl_value = self.items
        return ast.copy_location(n, at)


def with_wrappers(levels, stmts) -> list:
    """`stmts` inside every `with` block that encloses the innermost level."""
    for owner, node, *_ in reversed(levels):
        if owner == "with":
            stmts = [ast.copy_location(ast.With(items=node.items, body=stmts, type_comment=None), node)]
    return stmts


# ------------------------------------------------------------------------------ substitution
class _Substitute(ast.NodeTransformer):
    """Replace sub-expressions the graph already computed by temporaries."""

    def __init__(self, completed, mat: Materializer, temps: dict, taken: set, replace_call=None, result=None):
        self.completed = completed
        self.mat = mat
        self.temps = temps       # temp name -> value expression
        self.taken = taken       # the names the statement reads
        self.replace_call = replace_call
        self.result = result

    def visit(self, node):
        if self.replace_call is not None and node is self.replace_call:
            return ast.copy_location(ast.Name(id=self.result, ctx=ast.Load()), node)
        if isinstance(node, ast.expr) and id(node) in self.completed and \
                not isinstance(node, (ast.Name, ast.Constant, ast.Lambda)) and \
                isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
            _, v = self.completed[id(node)]
            if not _materializable(v):  # e.g. a bound method: re-evaluate its parts instead
                return self.generic_visit(node)
            try:
                e = self.mat.expr(v)
            except CannotResume:
                return self.generic_visit(node)
            if isinstance(v, (TensorVar, SymInt)) or not is_literal(v):
                name = _fresh("__fl_t", self.taken | set(self.temps), len(self.temps))
                self.temps[name] = e
                return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), node)
            return ast.copy_location(ast.Constant(value=v), node)
        return self.generic_visit(node)


def _materializable(v) -> bool:
    """Values worth passing from the graph to Python: tensors, sizes, literals, and
    containers of them (anything else is cheaper and safer to evaluate again)."""
    if isinstance(v, (TensorVar, SymInt)) or is_literal(v):
        return True
    if type(v) in (list, tuple):
        return all(_materializable(x) for x in v)
    if type(v) is dict:
        return all(_materializable(x) for x in v.values())
    return False


def _fresh(base, taken, numbered_from=None):
    """`base` (numbered from `numbered_from`, where given) not among `taken`: a resume function's
    statement reads the temporaries of the break before it (`__fl_ret`, `__fl_t0`) where a second
    call in it breaks (`g(pair(a), pair(b))`), and the next resume function's must not take their
    names (the second would clobber the first's value)."""
    candidates = (f"{base}{i}" for i in itertools.count(numbered_from)) if numbered_from is not None \
        else itertools.chain([base], (f"{base}_{i}" for i in itertools.count(1)))
    return next(n for n in candidates if n not in taken)


def _names_read(stmt) -> set:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}


def substitute(stmt, completed, mat, temps, replace_call=None, result=None):
    """`stmt` with the sub-expressions the graph computed replaced by temporaries (added to
    `temps`), and `replace_call` by the name `result`."""
    s = copy_ast(stmt)
    # a copy breaks identity: map copied nodes back to the originals' entries
    orig = list(ast.walk(stmt))
    new = list(ast.walk(s))
    comp = {}
    call = None
    for o, n in zip(orig, new):
        if id(o) in completed:
            comp[id(n)] = completed[id(o)]
        if replace_call is not None and o is replace_call:
            call = n
    return _Substitute(comp, mat, temps, _names_read(stmt), call, result).visit(s)


# ------------------------------------------------------------------------------ generation
class Writer:
    """Generates the transformed function for one break."""

    def __init__(self, fs0: FunctionSource, sources, mutated, resume_prefix: str, effects=None,
                 latest=lambda v: v, value_sources=None, compile_callee=None):
        self.fs0 = fs0
        self.compile_callee = compile_callee  # (capture.capture's)
        self.sources = sources
        self.mat = Materializer(sources, mutated, effects, latest, value_sources)
        self.resumes: list[Resume] = []
        self.helpers: list[str] = []   # plain generated functions (break handlers)
        self.prefix = resume_prefix

    def _function(self, frame, name, params, body, qualname, consts, unbound=()) -> FunctionSource:
        """A generated function continuing `frame`'s code, with the file's locations. Each of
        the `unbound` parameters may arrive as UNBOUND (see `_unbound_args`): it is deleted
        first, so that reading it raises UnboundLocalError as in eager."""
        fs = frame.scope.fs
        if unbound:
            const = self.sources.constant(UNBOUND, "unbound")
            body = [ast.parse(f"if {n} is {const}:\n    del {n}").body[0] for n in unbound] + list(body)
            consts = {**(consts or {}), const: UNBOUND}
        body, consts = self.explicit_super(frame, local_defs(frame, body) + list(body), consts)
        body = unbound_locals(fs.node, body, params) + body
        node = ast.FunctionDef(name=name, args=_args(params), body=body or [ast.Pass()],
                               decorator_list=[], returns=None, type_comment=None, type_params=[])
        at = body[0] if body else frame.stmt
        ast.copy_location(node, at)
        node.end_lineno = max((getattr(b, "end_lineno", 0) or 0) for b in body) if body else at.lineno
        for n in ast.walk(node):
            if not hasattr(n, "lineno") and isinstance(n, (ast.expr, ast.stmt, ast.arg)):
                ast.copy_location(n, at)
        return FunctionSource(name=name, qualname=qualname, filename=fs.filename, node=node,
                              globals=fs.globals, closure=dict(consts or {}), generated=True,
                              source_text=_unparse_fn(node), resume_depth=self.fs0.resume_depth + 1)

    def explicit_super(self, frame, stmts, consts=None):
        """`super()` in code of a method, moved into a generated function (which has no
        `__class__` cell and whose first parameter is not `self`), as `super(cls, self)`;
        `cls` is a constant of the namespace (and of `consts`, for a generated function)."""
        site = _super_site(frame)
        if site is None or not _has_zero_arg_super(stmts):
            return stmts, consts
        cls, first = site
        name = self.sources.constant(cls, cls.__name__)

        class Explicit(ast.NodeTransformer):
            def visit_Call(self, node):
                self.generic_visit(node)
                if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
                    node.args = [ast.Name(id=name, ctx=ast.Load()), ast.Name(id=first, ctx=ast.Load())]
                return node
        out = [ast.fix_missing_locations(Explicit().visit(copy_ast(st))) for st in stmts]
        return out, {**(consts or {}), name: cls}

    def new_resume(self, frame: FrameAtBreak, params: list[str], body: list, tag: str,
                   consts=None, unbound=()) -> str:
        """A resume function: captured lazily by the runtime on its first call."""
        name = f"__fl_resume_{self.prefix}{len(self.resumes)}"
        base = frame.scope.fs.qualname.split(" (")[0]
        self.resumes.append(Resume(name, self._function(frame, name, params, body,
                                                        f"{base} ({tag})", consts, unbound)))
        return name

    def live(self, frame: FrameAtBreak, after: list, extra_defined=()) -> list[str]:
        _bind_rest_items(frame, after)
        # local functions are defined again in the resume; what they close over is live
        names = (loaded_names(after) | loaded_names(local_defs(frame, after))) - _local_fn_names(frame)
        if _super_site(frame) is not None and _has_zero_arg_super(after):
            names.add(_super_site(frame)[1])  # `super()` becomes `super(cls, self)` there
        defined = (set(frame.vars) | set(extra_defined)) - {"__fl_once"}  # (a one-pass loop's own)
        return sorted(n for n in names & defined)

    def handler(self, frame: FrameAtBreak, sig: BreakSignal) -> tuple[list, list[str]]:
        """Statements that run the innermost frame's breaking statement and continue it.
        Returns (statements, names they read from the frame or temps)."""
        temps: dict[str, str] = {}
        s = frame.stmt
        if sig.whole_stmt:
            stmt = self.compiling_calls(s, sig)
        else:
            stmt = substitute(s, frame.completed, self.mat, temps)
        stmt = self.explicit_super(frame, [stmt])[0][0]
        if sig.cond is not None and isinstance(s, ast.If):
            test = stmt.test
            then_name, then_params = self._branch_resume(frame, s.body, "then branch")
            else_name, else_params = self._branch_resume(frame, s.orelse, "else branch")
            stmts = [ast.If(test=test, body=[_return_call(then_name, then_params)],
                            orelse=[_return_call(else_name, else_params)])]
            reads = loaded_names([test]) | set(then_params) | set(else_params)
            # not inside the `with` blocks: each branch's resume enters them itself, and the
            # code after them must run outside (no_grad/autocast leaked into it)
            return stmts, temps, reads
        reads = loaded_names([stmt])
        tail = []
        body = continuation(frame.levels, False) if not isinstance(s, (ast.Return, ast.Raise)) else None
        if body:
            params = self.live(frame, body, stored_names([s]))
            maybe = _maybe_unbound(params, frame, s)
            name = self.new_resume(frame, params, body, "after the graph break", unbound=maybe)
            tail = [_return_call(name, params, self._unbound_args(maybe))]
            reads |= set(params) - stored_names([s])
        elif body is not None:
            tail = [ast.Return(value=ast.Constant(value=None))]
        run = with_wrappers(frame.levels, [stmt])
        if _in_try(frame.levels):
            run, exc_reads = self._raising_into_try(frame, run)
            reads |= exc_reads
        return run + tail, temps, reads

    def _unbound_args(self, names) -> dict:
        """Arguments for names a statement run in Python may leave unbound (assigned only in a
        branch or handler that did not run): `locals().get(n, UNBOUND)`, not `n`, which would
        raise UnboundLocalError in the call although eager reads `n` nowhere later."""
        const = self.sources.constant(UNBOUND, "unbound")
        scope = self.sources.constant(builtins.locals, "locals")  # (the user's code may name a `locals`)
        return {n: ast.parse(f"{scope}().get({n!r}, {const})", mode="eval").body for n in names}

    def _raising_into_try(self, frame, run):
        """`run` (the breaking statement, in the transformed function) inside enclosing `try`
        bodies: what it raises goes to a plain function that raises it again inside the same
        blocks (handlers, `else`, `finally` and the rest of the function run in Python, as after
        an exception in eager). The frame's variables reach it as the transformed function's
        `locals()`: those the statement assigned before raising are bound, as in eager."""
        uid = next(_UIDS)
        body = continuation(frame.levels, False, current=_raise_exc(frame.stmt))
        live = self.live(frame, body, stored_names([frame.stmt]))
        name = self.sources.constant(self.generated(frame, f"__fl_raise{uid}", ["__fl_exc", "__fl_l"],
                                                    _unpack_locals(live, frame.stmt) + body),
                                     "raise_into_try")
        catch = ast.parse(f"try:\n    pass\nexcept BaseException as __fl_exc:\n"
                          f"    return {name}(__fl_exc, locals())").body[0]
        for n in ast.walk(catch):
            ast.copy_location(n, frame.stmt)
        catch.body = run
        return [catch], set(live)

    def _branch_resume(self, frame, branch, tag):
        levels = [list(l) for l in frame.levels] + [["if", frame.stmt, branch, -1, None]]
        body = continuation(levels, include_current=False)
        if not body:
            return None, []
        params = self.live(frame, body)
        return self.new_resume(frame, params, body, tag), params

    def write(self, sig: BreakSignal, graph_call: str | None) -> str:
        frames = sig.frames  # innermost first
        before, replay = self.mat.replay_parts()
        lines: list[str] = []
        sig_text, consts = signature(self.fs0.node.args, self.fs0.defaults)
        for k, v in consts.items():
            self.sources.constants[k] = v
        lines.append(f"def {self.fs0.name}({sig_text}):")
        body: list[str] = []
        inner = frames[0]
        if len(frames) == 1:
            stmts, temps, reads = self.handler(inner, sig)
            defs = local_defs(inner, stmts)
            reads = (set(reads) | loaded_names(defs)) - _local_fn_names(inner)
            pairs = [(n, self.mat.expr(inner.vars[n])) for n in sorted(reads) if n in inner.vars]
            pairs = [(n, e) for n, e in pairs if e != n]
            # one tuple assignment: sources name the parameters as they were on entry, and
            # a parameter may be rebound here (`y = t16` while `t16` gets a new value)
            bind = [f"{', '.join(n for n, _ in pairs)} = {', '.join(e for _, e in pairs)}"] \
                if pairs else []
            bind += [ast.unparse(d) for d in defs]
            bind += [ast.unparse(d) for d in unbound_locals(inner.scope.fs.node, stmts, set(inner.vars))]
            bind += [f"{t} = {e}" for t, e in temps.items()]
            code = [ast.unparse(s) for s in stmts]
            body = self.finish(graph_call, replay + bind + code, before)
        else:
            body = self.finish(graph_call, replay + self.write_inlined(frames, sig), before)
        lines += ["    " + l for b in body for l in b.splitlines()]
        return "\n".join(lines)

    def finish(self, graph_call, body, before=()) -> list[str]:
        """The transformed function's body: sources bound on entry, the side effects made
        `before` the graph, the graph call (`(name, inputs)`: inputs are read before those side
        effects, where capture read them), the function's own containers that Python code
        receives, then `body` (which begins with the other replayed side effects). Call once
        everything is materialized."""
        if graph_call is None:
            return self.mat.entry_lines() + list(before) + self.mat.prelude + body
        name, inputs = graph_call
        if not before:
            call = [f"__fl_o = {name}({', '.join(inputs)})"]
        else:
            call = [f"__fl_in = ({''.join(i + ', ' for i in inputs)})", *before, f"__fl_o = {name}(*__fl_in)"]
        return self.mat.entry_lines() + call + self.mat.prelude + body

    def write_inlined(self, frames, sig: BreakSignal) -> list[str]:
        """A break inside an inlined call. The breaking statement runs in a plain helper with
        the callee's variables; then ONE resume function continues: it calls a generated
        continuation of each inner frame (inlined when the resume is captured) and goes on
        with the outer frame's code, so the rest of the callee and of the caller share a
        graph."""
        inner = frames[0]
        s = inner.stmt
        # names unique to this break: a resume's own breaks must not clash with its parameters
        uid = next(_UIDS)
        st, inn, cond = f"__fl_state{uid}", f"__fl_inner{uid}", f"__fl_cond{uid}"
        temps: dict[str, str] = {}
        stmt = self.compiling_calls(s, sig) if sig.whole_stmt else substitute(s, inner.completed, self.mat, temps)
        stmt = self.explicit_super(inner, [stmt])[0][0]
        x_live: list[str] = []  # the helper's variables its exceptional continuation reads
        returns = False  # the statement may return from the callee (`Returned`)
        unbound: list[str] = []  # live names the statement, run in Python, may leave unbound
        # -- the innermost frame: the helper that runs the break, and its continuation
        if sig.cond is not None and isinstance(s, ast.If):
            cur = ast.copy_location(ast.If(test=ast.Name(id=cond, ctx=ast.Load()),
                                           body=s.body, orelse=s.orelse), s)
            cont_body = continuation(inner.levels, False, current=cur)
            live = self.live(inner, cont_body)
            ret = ast.Tuple(elts=[ast.Call(func=ast.Name(id="bool", ctx=ast.Load()),
                                           args=[stmt.test], keywords=[])] +
                            [ast.Name(id=n, ctx=ast.Load()) for n in live], ctx=ast.Load())
            h_body = with_wrappers(inner.levels, [ast.Return(value=ret)])
            cont_params = [cond] + live
        elif isinstance(s, ast.Return):
            cont_body, h_body, cont_params = [], with_wrappers(inner.levels, [stmt]), None
        else:
            cont_body = continuation(inner.levels, False)
            live = self.live(inner, cont_body, stored_names([s])) if cont_body else []
            unbound = _maybe_unbound(live, inner, s)
            exprs = self._unbound_args(unbound)
            ret = ast.Tuple(elts=[exprs.get(n) or ast.Name(id=n, ctx=ast.Load()) for n in live],
                            ctx=ast.Load())
            if cont_body:
                # a `return` of the callee inside the statement (one Python runs whole: a `try`
                # with a `finally`, a loop) ends the callee: the helper hands its value on as
                # `Returned`, not as the live values its continuation would take
                stmt, returns = _returning(stmt, self.sources.constant(Returned, "Returned"))
            run = with_wrappers(inner.levels, [stmt])
            if _in_try(inner.levels):
                run, x_live = self._helper_raising(inner, run, uid)
            h_body = run + [ast.Return(value=ret if cont_body else ast.Constant(value=None))]
            cont_params = live if cont_body else None
        h_params = sorted((loaded_names(h_body) | set(x_live)) & set(inner.vars)) + list(temps)
        h_body = unbound_locals(inner.scope.fs.node, h_body, set(inner.vars)) + h_body
        hname = f"__fl_break_{self.prefix}{len(self.helpers)}"
        helper = ast.FunctionDef(name=hname, args=_args(h_params), body=h_body, decorator_list=[],
                                 returns=None, type_comment=None, type_params=[])
        ast.fix_missing_locations(ast.copy_location(helper, s))
        self.helpers.append((hname, helper, inner.scope.fs))
        h_args = [self.mat.expr(inner.vars[n]) for n in h_params if n in inner.vars] + list(temps.values())

        consts = {}
        if cont_params is not None:
            inner_call = f"__fl_cont{uid}_0(*{st})"
            consts[f"__fl_cont{uid}_0"] = self.generated(inner, f"__fl_cont{uid}_0", cont_params,
                                                         cont_body, unbound=unbound)
            if returns:
                returned = self.sources.constant(Returned, "Returned")
                consts[returned] = Returned
                inner_call = f"{st}.value if type({st}) is {returned} else {inner_call}"
        else:
            inner_call = st
        # -- each enclosing frame: continue after the call, with its result in __fl_ret
        lives: list[list[str]] = []  # per frame 1..k: expressions of its live values
        for i, fr in enumerate(frames[1:], start=1):
            ftemps: dict[str, str] = {}
            ret = _fresh("__fl_ret", _names_read(fr.stmt))
            cur = substitute(fr.stmt, fr.completed, self.mat, ftemps, replace_call=fr.call, result=ret)
            first = ast.parse(_call_result(inner_call, fr, ftemps, self.mat, ret)).body
            for n in (x for st in first for x in ast.walk(st)):
                ast.copy_location(n, fr.call)
            body = continuation(fr.levels, False, current=first + [cur])
            own = list(ftemps) + [n for n in self.live(fr, body) if n not in ftemps]
            params = [st, inn] + own
            lives.append([ftemps[n] if n in ftemps else self.mat.expr(fr.vars[n]) for n in own])
            if i == len(frames) - 1:
                rname = self.new_resume(fr, params, body, "after the graph break", consts=consts)
                break
            name = f"__fl_cont{uid}_{i}"
            fn = self.generated(fr, name, params, body, consts=consts)
            consts = {name: fn}
            inner_call = f"{name}({st}, {inn}[:-1], *{inn}[-1])"
        call_break = f"{st} = {hname}({', '.join(h_args)})"
        out = _with_lines(call_break, frames[1:], self.mat)
        if any(_in_try(fr.levels) for fr in frames):
            xname, xlives = self._raising_chain(frames, uid)
            thunk = f"{self.sources.constant(functools.partial, 'partial')}(" \
                    f"{self.sources.constant(_reraise, 'reraise')}, __fl_exc)"
            out = ["try:"] + ["    " + l for o in out for l in o.splitlines()] + [
                "except BaseException as __fl_exc:",
                f"    return {xname}({', '.join(_chain_args(thunk, xlives))})"]
            if _in_try(inner.levels):
                out += [f"if type({st}) is {self.sources.constant(Raised, 'Raised')}:",
                        f"    return {xname}({', '.join(_chain_args(f'{st}.call', xlives))})"]
        out.append(f"return {rname}({', '.join(_chain_args(st, lives))})")
        return out

    def _helper_raising(self, inner, run, uid):
        """The break helper's statement `run` inside `try` bodies of its own frame: what it
        raises is returned as `Raised`, whose call runs the rest of the frame (a plain function)
        with the exception raised again inside the same blocks, from the helper's variables.
        Returns (statements, names that function reads)."""
        body = continuation(inner.levels, False, current=_raise_exc(inner.stmt))
        live = self.live(inner, body, stored_names([inner.stmt]))
        fn = self.generated(inner, f"__fl_raise{uid}_0", ["__fl_exc", "__fl_l"],
                            _unpack_locals(live, inner.stmt) + body)
        catch = ast.parse(f"try:\n    pass\nexcept BaseException as __fl_exc:\n"
                          f"    return {self.sources.constant(Raised, 'Raised')}("
                          f"{self.sources.constant(functools.partial, 'partial')}("
                          f"{self.sources.constant(fn, 'raise_into_try')}, __fl_exc, locals()))").body[0]
        for n in ast.walk(catch):
            ast.copy_location(n, inner.stmt)
        catch.body = run
        return [catch], live

    def _raising_chain(self, frames, uid):
        """The enclosing frames' code after the call that led to the break, where the breaking
        frame ended with an exception: each frame goes on from that call inside its blocks (its
        `try` statements decide), the call's result being `__fl_xcall()` (which raises the
        exception, or runs the rest of the breaking frame: see `_helper_raising`). Plain
        functions, one per enclosing frame, each calling the one inside it as the normal
        continuation does. Returns (the outermost's name, each frame's live values)."""
        consts, inner_call, lives = {}, "__fl_xcall()", []
        name = None
        for i, fr in enumerate(frames[1:], start=1):
            ftemps: dict[str, str] = {}
            ret = _fresh("__fl_ret", _names_read(fr.stmt))
            first = ast.parse(_call_result(inner_call, fr, ftemps, self.mat, ret)).body
            for n in (x for st in first for x in ast.walk(st)):
                ast.copy_location(n, fr.call)
            cur = first + [substitute(fr.stmt, fr.completed, self.mat, ftemps, replace_call=fr.call, result=ret)]
            body = continuation(fr.levels, False, current=cur)
            own = list(ftemps) + [n for n in self.live(fr, body) if n not in ftemps]
            lives.append([ftemps[n] if n in ftemps else self.mat.expr(fr.vars[n]) for n in own])
            name = f"__fl_raise{uid}_{i}"
            consts = {name: self.generated(fr, name, ["__fl_xcall", "__fl_xinn"] + own, body, consts=consts)}
            inner_call = f"{name}(__fl_xcall, __fl_xinn[:-1], *__fl_xinn[-1])"
        return self.sources.constant(consts[name], "raise_into_try"), lives

    def compiling_calls(self, s, sig: BreakSignal):
        """Statement `s`, which Python runs whole, with each call that led to the break
        (`sig.compile_calls`) going to its callee compiled on its own: the callee's code before
        and after its break still runs in graphs. Without `compile_callee` (a capture not made
        for the runtime) the statement runs as written."""
        where = {_position(c) for c in sig.compile_calls}
        if not where or self.compile_callee is None:
            return s
        wrap = self.sources.constant(self.compile_callee, "compiled")

        class Rewrite(ast.NodeTransformer):
            def visit_Call(self, node):
                self.generic_visit(node)
                if _position(node) in where:
                    node.func = ast.Call(func=ast.Name(id=wrap, ctx=ast.Load()), args=[node.func], keywords=[])
                return node
        return ast.fix_missing_locations(Rewrite().visit(copy_ast(s)))

    def generated(self, frame, name, params, body, consts=None, unbound=()):
        """A frame's continuation that capture inlines: a real Python function (for the eager
        fallback) carrying its FunctionSource."""
        gen = self._function(frame, name, params, body, frame.scope.fs.qualname.split(" (")[0],
                             consts, unbound)
        fn = build_function(gen.source_text, name, gen.globals, gen.closure)
        fn.__fl_source__ = gen
        return fn

    def helper_sources(self) -> list[tuple[str, str, FunctionSource]]:
        return [(n, ast.unparse(h), fs) for n, h, fs in self.helpers]


def _call_result(inner_call, frame, temps, mat, ret) -> str:
    """`<ret> = <the result of the call that led to the inner frames>`: the inner frames'
    continuation's return value, or, where the call made an object (its `__init__` broke), that
    object (a live value of the frame's, as a temporary)."""
    if frame.constructed is None:
        return f"{ret} = {inner_call}"
    name = _fresh("__fl_new", _names_read(frame.stmt) | set(temps), len(temps))
    temps[name] = mat.expr(frame.constructed)
    return f"{inner_call}\n{ret} = {name}"


def _with_lines(text, outer_frames, mat):
    """`text` inside the `with` blocks of the enclosing frames (outermost first). Their items
    are code of those frames: a name of the frame's (`with ctx_factory():` in torch's grad-mode
    decorator) is written as the value it has there."""
    withs = []
    for fr in reversed(outer_frames):
        for owner, node, *_ in fr.levels:
            if owner == "with":
                withs.append((node, fr))
    if not withs:
        return [text]
    src = text
    for node, fr in reversed(withs):
        class Bind(ast.NodeTransformer):
            def visit_Name(self, n):
                if isinstance(n.ctx, ast.Load) and n.id in fr.vars:
                    return ast.parse(mat.expr(fr.vars[n.id]), mode="eval").body
                return n
        items = ", ".join(ast.unparse(Bind().visit(copy_ast(i))) for i in node.items)
        src = f"with {items}:\n" + "\n".join("    " + l for l in src.splitlines())
    return [src]


class Raised:
    """What a break helper returns where its statement raised inside a `try` of its frame:
    `call()` runs the rest of that frame from there (write_inlined)."""
    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call


class Returned:
    """What a break helper returns where its statement, run in Python, returned from the callee
    (a `return` inside a `try`/`finally` or a loop run whole): the callee's result, in place of
    the live values its continuation takes (write_inlined)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _returning(stmt, returned: str):
    """`stmt` with each `return v` of its own frame (not of a function or lambda defined in it)
    made `return Returned(v)`; and whether it has one."""
    found = []

    class Wrap(ast.NodeTransformer):
        def visit_Return(self, node):
            found.append(node)
            value = node.value if node.value is not None else ast.Constant(value=None)
            call = ast.Call(func=ast.Name(id=returned, ctx=ast.Load()), args=[value], keywords=[])
            return ast.copy_location(ast.Return(value=ast.copy_location(call, node)), node)

        def visit_FunctionDef(self, node):
            return node  # its returns are its own
        visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_FunctionDef

    out = Wrap().visit(copy_ast(stmt))
    return ast.fix_missing_locations(out), bool(found)


def _reraise(exc):
    raise exc


def _chain_args(first, lives) -> list[str]:
    """Arguments of the outermost function of a chain of frame continuations: `first`, the
    inner frames' live values (a tuple of tuples, innermost first), the outermost's own."""
    inner = ", ".join("(" + "".join(e + ", " for e in l) + ")" for l in lives[:-1])
    return [first, f"({inner}{',' if len(lives) == 2 else ''})"] + lives[-1]


def _in_try(levels) -> bool:
    return any(owner == "try" for owner, *_ in levels)


def _raise_exc(at):
    """`raise __fl_exc`, at `at`'s location (the statement or call that raised)."""
    r = ast.Raise(exc=ast.Name(id="__fl_exc", ctx=ast.Load()), cause=None)
    for n in ast.walk(r):
        ast.copy_location(n, at)
    return r


def _unpack_locals(names, at) -> list:
    """`if 'n' in __fl_l: n = __fl_l['n']` for each name: one the statement did not get to
    assign stays unbound (reading it raises UnboundLocalError, as in eager)."""
    out = [ast.parse(f"if {n!r} in __fl_l:\n    {n} = __fl_l[{n!r}]").body[0] for n in names]
    for st in out:
        for n in ast.walk(st):
            ast.copy_location(n, at)
    return out


def _args(params):
    return ast.arguments(posonlyargs=[], args=[ast.arg(arg=p) for p in params], vararg=None,
                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])


def _return_call(name, params, exprs=None):
    """`return name(*params)`; `exprs` gives some parameters' argument expressions."""
    if name is None:
        return ast.Return(value=ast.Constant(value=None))
    exprs = exprs or {}
    return ast.Return(value=ast.Call(func=ast.Name(id=name, ctx=ast.Load()),
                                     args=[exprs.get(p) or ast.Name(id=p, ctx=ast.Load()) for p in params],
                                     keywords=[]))


def _maybe_unbound(names, frame, stmt) -> list:
    """Those of `names` that `stmt`, run in Python, may leave unbound: not bound before it (it
    assigns them only on some paths), or deleted in it."""
    deleted = {x.id for x in _walk_scope(stmt) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Del)}
    return [n for n in names if n not in frame.vars or n in deleted]


class _Unbound:
    """A name left unbound, passed to a resume function (which deletes it again)."""

    def __repr__(self):
        return "<unbound>"


UNBOUND = _Unbound()


def _local_fn_names(frame) -> set:
    """The frame's variables holding local functions it defined (`local_defs` makes them again)."""
    return {n for n, v in frame.vars.items() if isinstance(v, LocalFunction) and v.env is frame.scope}


def local_defs(frame, stmts) -> list:
    """`def`/`lambda` statements re-creating the local functions of this frame that `stmts` use
    (its definition goes on in the resume function, as its own code). One defined in another
    frame (an argument) is a live value, made from its source (Materializer.local_function)."""
    out, seen = [], set()
    todo = sorted(loaded_names(stmts))
    while todo:
        n = todo.pop()
        v = frame.vars.get(n)
        if not isinstance(v, LocalFunction) or n in seen:
            continue
        if v.env is not frame.scope:
            continue
        seen.add(n)
        if isinstance(v.node, ast.Lambda):
            d = ast.Assign(targets=[ast.Name(id=n, ctx=ast.Store())], value=v.node, type_comment=None)
        else:
            d = copy.copy(v.node)
            d.name = n
        d = ast.copy_location(d, v.node)
        ast.fix_missing_locations(d)
        out.append(d)
        todo += sorted(loaded_names([d]) - seen)
    return out


def unbound_locals(fn, stmts, bound) -> list:
    """`name: object` for each local of the user's function `fn` that `stmts` read and that is
    not in `bound` (unbound where the generated code starts): it stays local there, so reading it
    raises UnboundLocalError as in eager, not NameError (or a global's value) as a free name."""
    a = fn.args
    local = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]}
    todo = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while todo:  # fn's own scope: not the bodies of nested functions, classes, comprehensions
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            local.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            local.add(n.name)
            continue
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            local.update((x.asname or x.name).split(".")[0] for x in n.names)
        elif isinstance(n, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        todo += ast.iter_child_nodes(n)
    read = {x.id for n in stmts for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
    # a name `stmts` assign is local there already
    names = sorted((read & local) - set(bound) - stored_names(stmts))
    at = stmts[0] if stmts else fn
    return [ast.fix_missing_locations(ast.copy_location(ast.AnnAssign(
        target=ast.Name(id=n, ctx=ast.Store()), annotation=ast.Name(id="object", ctx=ast.Load()),
        value=None, simple=1), at)) for n in names]


def _bind_rest_items(frame, body) -> None:
    """The iterations left of an unrolled loop are a variable of the frame: passed to the
    resume function like any live value (tensors among them become graph outputs)."""
    for s in body:
        for n in ast.walk(s):
            # a loop reused from an earlier resume already has its items as a parameter
            if isinstance(n, ast.Name) and hasattr(n, "_fl_value") and n.id not in frame.vars:
                frame.vars[n.id] = n._fl_value


def signature(args: ast.arguments, defaults: dict) -> tuple[str, dict]:
    """The original parameter list, defaults referring to constants `__fl_default_<name>`."""
    a = copy.deepcopy(args)
    consts = {}

    def dflt(name):
        if name not in defaults:
            return None
        consts[f"__fl_default_{name}"] = defaults[name]
        return ast.Name(id=f"__fl_default_{name}", ctx=ast.Load())
    pos = a.posonlyargs + a.args
    a.defaults = [d for d in (dflt(p.arg) for p in pos) if d is not None]
    a.kw_defaults = [dflt(p.arg) for p in a.kwonlyargs]
    for p in pos + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
        p.annotation = None
    return ast.unparse(a), consts


def _unparse_fn(node) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # generated AST with a construct unparse dislikes: still usable
        return f"def {node.name}(...): ..."
