"""The symbolic evaluator: walks a function's AST with a frame of values and records tensor
operations into an FX graph.

It runs in two domains. **Concrete**: real example inputs; the first graph break stops the
walk and raises `BreakSignal`, which collects, frame by frame as it unwinds, what
`resume.py` needs to write the transformed function. **Abstract**: nothing is executed,
tensors have unknown shapes; a break is recorded and the walk goes on, so the editor sees
every break of a function in one pass. Both domains raise breaks from the same places."""
from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import dataclasses
import inspect
import math
import operator
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import breaks as B
from ..ops import effects as E
from . import calls as C
from . import side_effects as S
from .side_effects import MUTABLE, SideEffects
from .graph import GraphBuilder, MetaEvalError
from .source import FunctionSource, NoSourceError, function_source
from .values import (UNKNOWN, BoundUserMethod, LocalFunction, SymInt, SymShape, TensorVar, Unknown,
                     contains_tensor, leaves)

MAX_INLINE_DEPTH = 40  # real models nest deep: decorators, layers, attention interfaces
_TORCH_DIR = __import__("os").path.dirname(torch.__file__)
MAX_UNROLL = 512


# -- control-flow signals -------------------------------------------------------------------
class _Return(Exception):
    def __init__(self, value):
        self.value = value


class _LoopBreak(Exception):
    pass


class _LoopContinue(Exception):
    pass


@dataclass
class FrameAtBreak:
    """One frame's state where a graph break stopped the walk (see resume.py)."""
    scope: "Scope"
    stmt: ast.stmt               # the statement that was executing in this frame
    levels: list                 # block positions, outermost first: (owner, node, stmts, idx, extra)
    completed: dict              # id(expr) -> (expr, value): sub-expressions already evaluated
    vars: dict                   # variables at the break
    call: ast.Call | None = None  # in outer frames: the call that led to the inner frame


class CannotCapture(Exception):
    """Code that cannot even be split by a graph break: the runtime runs the function eagerly
    (with a warning naming this)."""


class BreakSignal(Exception):
    """A graph break in the concrete domain. `whole_stmt`: the statement runs entirely in
    Python (graph work of the statement rolled back); `cond`: data-dependent `if`."""

    def __init__(self, brk: B.GraphBreak, whole_stmt=False, cond=None):
        super().__init__(brk.title)
        self.brk = brk
        self.whole_stmt = whole_stmt
        self.cond = cond
        self.frames: list[FrameAtBreak] = []   # innermost first
        self.pending_call = None


class Scope:
    """A frame: the variables of one (inlined) function call."""

    def __init__(self, fs: FunctionSource, parent: "Scope | None", depth: int, vars=None,
                 enclosing: "Scope | None" = None):
        self.fs = fs
        self.parent = parent          # the caller (for the inlined-call stack)
        self.enclosing = enclosing    # for closures of local functions
        self.depth = depth
        self.vars: dict = vars if vars is not None else {}
        self.levels: list = []
        self.completed: dict = {}
        self.call_node: ast.Call | None = None  # the call in the parent that made this frame

    def lookup(self, name):
        if name in self.vars:
            return self.vars[name]
        s = self.enclosing
        while s is not None:
            if name in s.vars:
                return s.vars[name]
            s = s.enclosing
        raise KeyError(name)


@dataclass
class Guard:
    """One condition the inputs must meet for a cache entry to be reused. `expr` is Python
    over the guard function's parameters and constants."""
    expr: str
    reason: str  # what it checks, in words


class Evaluator:
    def __init__(self, builder: GraphBuilder, *, abstract=False, sources=None, on_break=None,
                 dynamic: dict | None = None):
        self.g = builder
        self.abstract = abstract
        self.sources = sources          # capture.Sources (concrete): guards and constants
        self.on_break = on_break        # abstract domain: called with each GraphBreak
        self.dynamic = dynamic or {}    # source expr -> set of dynamic dims
        self.autocast: list = []        # stack of (device_type, dtype) of active autocast
        self.grad_enabled = torch.is_grad_enabled()
        self.value_sources: dict[int, str] = {}   # id(object) -> source expression
        self.mutated_inputs: dict[str, TensorVar] = {}  # input source -> its latest value
        self._newer: dict[int, tuple] = {}  # id(TensorVar) -> (it, its value after an in-place op)
        self.in_try = 0  # how many captured `try` bodies the evaluation is in (raise is captured there)
        self.effects = SideEffects(sources)  # containers from outside are modelled, mutations replayed

    # ===================================================================== functions
    def run(self, fs: FunctionSource, bound: dict) -> object:
        scope = Scope(fs, None, 0, dict(bound))
        return self._run_body(fs, scope)

    def _run_body(self, fs, scope):
        node = fs.node
        try:
            if isinstance(node, ast.Lambda):
                return self.eval(node.body, scope)
            self.exec_block(node.body, scope, ("body", node))
        except _Return as r:
            return r.value
        return None

    def inline(self, fn, args, kwargs, call: ast.Call, caller: Scope, self_value=None):
        if caller.depth + 1 > MAX_INLINE_DEPTH:
            self.brk(B.INLINE_DEPTH, call, caller, detail=f"depth limit {MAX_INLINE_DEPTH}")
        if isinstance(fn, LocalFunction):
            fs = dataclasses.replace(caller.fs if fn.env is None else fn.env.fs, node=fn.node,
                                     name=fn.name, qualname=fn.name, defaults=fn.defaults)
            enclosing = fn.env
        elif isinstance(fn, FunctionSource):
            fs, enclosing = fn, None
        else:
            try:
                fs = function_source(fn)
            except NoSourceError as e:
                every = ([self_value] if self_value is not None else []) + list(args) + list(kwargs.values())
                if not self.abstract and not any(contains_tensor(v) or type(v) in MUTABLE
                                                 or isinstance(v, (Unknown, SymInt)) for v in every):
                    # Python with no source to read (a frozen module's `Mapping.get`) touching
                    # no tensor and no container capture models: Python runs it
                    return fn(self_value, *args, **kwargs) if self_value is not None else fn(*args, **kwargs)
                self.brk(B.UNKNOWN_CALL, call, caller, detail=str(e))
            enclosing = None
        if self_value is not None:
            args = [self_value] + list(args)
        try:
            bound = self.bind(fs, args, kwargs)
        except TypeError as e:
            self.brk(B.UNSUPPORTED_EXPR, call, caller, detail=f"cannot bind arguments: {e}")
        if isinstance(fn, FunctionSource) or not isinstance(fn, LocalFunction):
            for k, v in fs.closure.items():
                if k not in bound:
                    bound[k] = self.external_constant(v, fs.cells.get(k), k)
            for k, v in fs.defaults.items():  # a mutable default lives on with the function
                if bound.get(k) is v and type(v) in MUTABLE:
                    bound[k] = self.external_constant(v, None, k)
        scope = Scope(fs, caller, caller.depth + 1, bound, enclosing)
        scope.call_node = call
        try:
            return self._run_body(fs, scope)
        except BreakSignal as b:
            b.pending_call = call
            raise

    def external_constant(self, v, cell, name):
        """A callee's closure variable (in `cell`) or default: a container is modelled."""
        if type(v) not in MUTABLE or self.abstract:
            return v
        if cell is not None:
            v = cell.cell_contents
            return self.wrap_external(v, f"{self.sources.constant(cell, 'cell_' + name)}.cell_contents")
        return self.wrap_external(v, self.sources.constant(v, name))

    def bind(self, fs: FunctionSource, args, kwargs) -> dict:
        a = fs.params
        pos = [p.arg for p in a.posonlyargs + a.args]
        out = {}
        args = list(args)
        for name, v in zip(pos, args):
            out[name] = v
        extra = args[len(pos):]
        if extra:
            if a.vararg is None:
                raise TypeError(f"{fs.name}() takes {len(pos)} positional arguments but {len(args)} were given")
        if a.vararg is not None:
            out[a.vararg.arg] = tuple(extra)
        kw = {}
        for k, v in kwargs.items():
            if k in pos[:len(a.posonlyargs)]:
                raise TypeError(f"{k} is positional-only")
            if k in pos or k in [p.arg for p in a.kwonlyargs]:
                if k in out:
                    raise TypeError(f"{fs.name}() got multiple values for argument '{k}'")
                out[k] = v
            elif a.kwarg is not None:
                kw[k] = v
            else:
                raise TypeError(f"{fs.name}() got an unexpected keyword argument '{k}'")
        if a.kwarg is not None:
            out[a.kwarg.arg] = kw
        for name in pos + [p.arg for p in a.kwonlyargs]:
            if name not in out:
                if name in fs.defaults:
                    out[name] = fs.defaults[name]
                elif self.abstract:  # defaults of abstract functions are not evaluated
                    out[name] = UNKNOWN
                else:
                    raise TypeError(f"{fs.name}() missing required argument '{name}'")
        return out

    # ===================================================================== breaks
    def loc(self, node, scope) -> tuple:
        return (scope.fs.filename, node.lineno, node.col_offset,
                node.end_lineno or node.lineno, node.end_col_offset or node.col_offset)

    def user_loc(self, node, scope) -> tuple:
        """Where an op comes from in the user's code: inside torch's own modules (an inlined
        nn.Linear.forward, say) that is the call site in the user's file."""
        while scope.parent is not None and scope.fs.filename.startswith(_TORCH_DIR):
            node, scope = scope.call_node, scope.parent
        return self.loc(node, scope)

    def stack(self, scope) -> tuple:
        frames = []
        s = scope
        while s.parent is not None:
            c = s.call_node
            frames.append(B.Frame(s.parent.fs.qualname, s.parent.fs.filename, c.lineno,
                                  c.col_offset, c.end_lineno, c.end_col_offset))
            s = s.parent
        return tuple(reversed(frames))

    def brk(self, kind, node, scope, *, detail="", whole_stmt=False, cond=None):
        """Stop here with a graph break (concrete) / report it (abstract: raises _Abstract)."""
        gb = B.make_break(kind, self.loc(node, scope), detail=detail, stack=self.stack(scope),
                          function=scope.fs.qualname)
        raise BreakSignal(gb, whole_stmt=whole_stmt, cond=cond)

    # ===================================================================== statements
    def exec_block(self, stmts, scope, owner, extra=None):
        level = [owner[0], owner[1], stmts, 0, extra]
        scope.levels.append(level)
        try:
            for i, s in enumerate(stmts):
                level[3] = i
                self.exec_stmt(s, scope)
        finally:
            scope.levels.pop()

    def exec_stmt(self, s, scope):
        scope.completed = {}
        mark = self._mark(scope)
        try:
            self._exec(s, scope)
        except BreakSignal as b:
            if self.abstract:
                self._abstract_continue(b, s, scope)
                return
            if not b.frames or b.frames[-1].scope is not scope:
                if b.whole_stmt and not b.frames:
                    self._rollback(scope, mark)
                b.frames.append(FrameAtBreak(scope, s, [list(l) for l in scope.levels],
                                             dict(scope.completed), dict(scope.vars),
                                             call=b.pending_call))
                b.pending_call = None
            raise

    def _abstract_continue(self, b: BreakSignal, s, scope):
        """Abstract domain: report the break; names the statement assigns become unknown."""
        self.on_break(b.brk)
        if isinstance(s, (ast.If, ast.While)) and b.cond is not None:
            # both arms (and the loop body) are analysed like any code
            self._exec_abstract_arms(s, scope, dict(scope.vars))
            return
        for name in _assigned_names(s):
            scope.vars[name] = UNKNOWN

    def _exec_abstract_arms(self, s, scope, saved):
        arms = [s.body, s.orelse] if isinstance(s, ast.If) else [s.body]
        results = []
        for arm in arms:
            scope.vars = dict(saved)
            try:
                self.exec_block(arm, scope, ("if", s))
            except (_Return, _LoopBreak, _LoopContinue):
                pass
            results.append(scope.vars)
        scope.vars = _join(results)

    def _mark(self, scope):
        nodes = list(self.g.graph.nodes)
        chain, s = [], scope  # rebind() updates the callers' variables too
        while s is not None:
            chain.append((s, dict(s.vars)))
            s = s.parent if s.parent is not None else s.enclosing
        return (nodes[-1] if nodes else None, chain, self.g.n_ops,
                dict(self.mutated_inputs), dict(self._newer), self.effects.mark())

    def _rollback(self, scope, mark):
        last, chain, n_ops, mutated, newer, effects = mark
        self.effects.rollback(effects)  # the statement makes its own mutations in Python
        # in-place ops of the rolled-back statement did not happen (their nodes are erased)
        self.mutated_inputs.clear()
        self.mutated_inputs.update(mutated)
        self._newer = newer
        for n in reversed(list(self.g.graph.nodes)):
            if n is last:
                break
            if n.op == "placeholder":
                continue
            if not n.users:
                self.g.graph.erase_node(n)
        for s, vars_ in chain:
            s.vars.clear()
            s.vars.update(vars_)
        self.g.n_ops = n_ops

    def _exec(self, s, scope):
        m = getattr(self, "_stmt_" + type(s).__name__, None)
        if m is None:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"`{type(s).__name__}` statement",
                     whole_stmt=True)
        m(s, scope)

    def _stmt_Expr(self, s, scope):
        self.eval(s.value, scope)

    def _stmt_Global(self, s, scope):
        # the declaration holds for the whole function: run as a break, a resume function
        # would treat later writes to the name as local ones and lose them
        kind = type(s).__name__.lower()
        if self.abstract:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"`{kind}` statement", whole_stmt=True)
        raise CannotCapture(f"`{kind} {', '.join(s.names)}` in {scope.fs.qualname}: "
                            "functions with global/nonlocal declarations run eagerly")

    _stmt_Nonlocal = _stmt_Global

    def _stmt_Pass(self, s, scope):
        pass

    def _stmt_Return(self, s, scope):
        raise _Return(None if s.value is None else self.eval(s.value, scope))

    def _stmt_Break(self, s, scope):
        raise _LoopBreak()

    def _stmt_Continue(self, s, scope):
        raise _LoopContinue()

    def _stmt_Assign(self, s, scope):
        v = self.eval(s.value, scope)
        for t in s.targets:
            self.assign(t, v, scope)

    def _stmt_AnnAssign(self, s, scope):
        if s.value is not None:
            self.assign(s.target, self.eval(s.value, scope), scope)

    def _stmt_AugAssign(self, s, scope):
        op = type(s.op).__name__
        cur = self.eval(_as_load(s.target), scope)
        rhs = self.eval(s.value, scope)
        if isinstance(cur, TensorVar) and op in C.INPLACE_BINOPS:
            v = self.tensor_method(cur, C.INPLACE_BINOPS[op], [rhs], {}, s, scope)
        elif type(cur) is list and op == "Add":
            self.effects.call(cur, "extend", [self.iterate(rhs, s, scope)], {})
            v = cur
        else:
            v = self.binop(op, cur, rhs, s, scope)
        self.assign(s.target, v, scope)

    def _stmt_Delete(self, s, scope):
        for t in s.targets:
            if isinstance(t, ast.Name):
                scope.vars.pop(t.id, None)
                continue
            obj = self.eval(t.value, scope) if isinstance(t, ast.Subscript) else None
            if type(obj) in (list, dict):
                self.effects.observe(obj)
                self.effects.call(obj, "__delitem__", [self.container_key(t.slice, scope)], {})
            elif isinstance(obj, Unknown):
                pass
            else:
                self.brk(B.UNSUPPORTED_STMT, s, scope, detail="`del` of an item or attribute",
                         whole_stmt=True)

    def _stmt_Assert(self, s, scope):
        v = self.eval(s.test, scope)
        if isinstance(v, TensorVar):
            self.brk(B.DATA_ASSERT, s.test, scope)
        if isinstance(v, (Unknown, SymInt)):
            return
        if not v:
            msg = self.eval(s.msg, scope) if s.msg is not None else None
            raise AssertionError(msg) if msg is not None else AssertionError()

    def _stmt_If(self, s, scope):
        test = self.eval(s.test, scope)
        t = self.truth(test, s.test, scope, kind=B.DATA_IF)
        if t is UNKNOWN:
            saved = dict(scope.vars)
            self._exec_abstract_arms(s, scope, saved)
            return
        body = s.body if t else s.orelse
        self.exec_block(body, scope, ("if", s))

    def _stmt_While(self, s, scope):
        for _ in range(MAX_UNROLL):
            try:
                test = self.eval(s.test, scope)
            except BreakSignal as b:  # e.g. `while x.sum() > 0 and n < 3`, `while t.item()`:
                # the test runs again on every iteration, so the whole loop runs in Python
                raise BreakSignal(b.brk, whole_stmt=True, cond=b.cond) from None
            t = self.truth(test, s.test, scope, kind=B.DATA_WHILE, whole_stmt=True)
            if t is UNKNOWN:
                self._abstract_loop_body(s, scope)
                return
            if not t:
                self.exec_block(s.orelse, scope, ("if", s))
                return
            try:
                self.exec_block(s.body, scope, ("while", s))
            except _LoopBreak:
                return
            except _LoopContinue:
                continue
        self.brk(B.UNROLLABLE_LOOP, s, scope, detail=f"more than {MAX_UNROLL} iterations",
                 whole_stmt=True)

    def _stmt_For(self, s, scope):
        it = self.eval(s.iter, scope)
        if isinstance(it, Unknown) or (self.abstract and isinstance(it, TensorVar)):
            self._abstract_loop_body(s, scope)
            return
        items = self.iterate(it, s.iter, scope, whole_stmt=True)
        if len(items) > MAX_UNROLL:
            self.brk(B.UNROLLABLE_LOOP, s.iter, scope,
                     detail=f"{len(items)} iterations (limit {MAX_UNROLL})", whole_stmt=True)
        has_jump = _has_loop_jump(s.body)
        for i, item in enumerate(items):
            self.assign(s.target, self.latest(item), scope)
            try:
                self.exec_block(s.body, scope, ("for", s), extra=items[i + 1:])
            except _LoopBreak:
                return
            except _LoopContinue:
                continue
            except BreakSignal as b:
                if has_jump and not self.abstract:
                    # resuming mid-iteration would need break/continue outside a loop
                    raise BreakSignal(b.brk.replace(code=B.UNROLLABLE_LOOP.code,
                                                    title=B.UNROLLABLE_LOOP.title,
                                                    explanation=B.UNROLLABLE_LOOP.explanation
                                                    + f" (inside: {b.brk.title})"),
                                      whole_stmt=True) from None
                raise
        self.exec_block(s.orelse, scope, ("if", s))

    def _abstract_loop_body(self, s, scope):
        if not isinstance(s, ast.While):
            self.assign(s.target, UNKNOWN if not isinstance(self._peek_iter(s, scope), TensorVar)
                        else TensorVar(None, None, None), scope)
        saved = dict(scope.vars)
        try:
            self.exec_block(s.body, scope, ("while" if isinstance(s, ast.While) else "for", s))
        except (_LoopBreak, _LoopContinue):
            pass
        scope.vars = _join([saved, scope.vars])

    def _peek_iter(self, s, scope):
        try:
            return self.eval(s.iter, scope)
        except BreakSignal:
            return UNKNOWN

    def _stmt_Try(self, s, scope):
        """`try` is captured: an exception the evaluated code raises (a lookup on plain values,
        a user's `raise`) goes to the first handler whose type matches, `else` runs after a body
        that raised nothing, `finally` always. A graph break inside makes the whole statement run
        in Python (a resume cannot re-enter the handlers)."""
        try:
            try:
                self.in_try += 1
                try:
                    self.exec_block(s.body, scope, ("try", s))
                finally:
                    self.in_try -= 1
            except _NOT_USER_EXCEPTIONS:
                raise
            except Exception as exc:  # noqa: BLE001 (the user's code raised it: its handlers decide)
                handler = self._handler_for(s.handlers, exc, scope)
                if handler is None:
                    raise
                if handler.name:
                    scope.vars[handler.name] = exc
                self.exec_block(handler.body, scope, ("try", s))
                if handler.name:
                    scope.vars.pop(handler.name, None)  # Python unbinds it after the handler
            else:
                self.exec_block(s.orelse, scope, ("try", s))
        except BreakSignal as b:
            raise BreakSignal(b.brk, whole_stmt=True) from None
        except BaseException:
            self.exec_block(s.finalbody, scope, ("try", s))
            raise
        self.exec_block(s.finalbody, scope, ("try", s))

    def _stmt_Raise(self, s, scope):
        """Inside a captured `try` body, `raise` raises (a handler may take it); elsewhere the
        statement runs in Python, after the graph of what came before it."""
        if not self.in_try or self.abstract or s.exc is None:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail="`Raise` statement", whole_stmt=True)
        exc = self.eval(s.exc, scope)
        cause = self.eval(s.cause, scope) if s.cause is not None else None
        if isinstance(exc, type) and issubclass(exc, BaseException):
            exc = exc()
        if not isinstance(exc, BaseException):
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail="`Raise` statement", whole_stmt=True)
        if s.cause is None:
            raise exc
        raise exc from cause

    def _handler_for(self, handlers, exc, scope):
        for h in handlers:
            if h.type is None:
                return h
            types_ = self.eval(h.type, scope)
            if isinstance(types_, Unknown) or isinstance(exc, types_):
                return h
        return None

    def _stmt_With(self, s, scope):
        with contextlib.ExitStack() as stack:
            for item in s.items:
                cm = self.eval(item.context_expr, scope)
                self.enter_context(cm, item, scope, stack)
                if item.optional_vars is not None:
                    self.assign(item.optional_vars, None, scope)
            self.exec_block(s.body, scope, ("with", s))

    def enter_context(self, cm, item, scope, stack):
        if isinstance(cm, Unknown):
            return
        if isinstance(cm, (torch.no_grad, torch.enable_grad)) or type(cm).__name__ == "set_grad_enabled":
            prev = self.grad_enabled
            self.grad_enabled = not isinstance(cm, torch.no_grad) if not hasattr(cm, "mode") else cm.mode
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.callback(lambda: setattr(self, "grad_enabled", prev))
            return
        if isinstance(cm, torch.autocast):
            dtype = cm.fast_dtype if cm._enabled else None
            self.autocast.append((cm.device, dtype))
            stack.callback(self.autocast.pop)
            return
        self.brk(B.UNSUPPORTED_STMT, item.context_expr, scope,
                 detail=f"context manager {type(cm).__name__}", whole_stmt=True)

    def _stmt_Import(self, s, scope):
        # only modules already imported: importing anew would run module code at capture time
        for a in s.names:
            root = a.name if a.asname else a.name.split(".")[0]
            mod = sys.modules.get(a.name if a.asname else root)
            if mod is None:
                self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"import of {a.name} (not imported yet)",
                         whole_stmt=True)
            scope.vars[a.asname or root] = mod

    def _stmt_ImportFrom(self, s, scope):
        mod = sys.modules.get(s.module or "") if s.level == 0 else None
        if mod is None:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"import from {s.module}", whole_stmt=True)
        for a in s.names:
            if not hasattr(mod, a.name):
                self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"from {s.module} import {a.name}",
                         whole_stmt=True)
            scope.vars[a.asname or a.name] = getattr(mod, a.name)

    def _stmt_FunctionDef(self, s, scope):
        if s.decorator_list:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail="decorated local function", whole_stmt=True)
        scope.vars[s.name] = LocalFunction(s, scope, self._local_defaults(s.args, scope), s.name)

    def _local_defaults(self, args, scope):
        d = {}
        pos = [p.arg for p in args.posonlyargs + args.args]
        for name, e in zip(pos[len(pos) - len(args.defaults):], args.defaults):
            d[name] = self.eval(e, scope)
        for p, e in zip(args.kwonlyargs, args.kw_defaults):
            if e is not None:
                d[p.arg] = self.eval(e, scope)
        return d

    # ===================================================================== assignment
    def assign(self, target, v, scope):
        if isinstance(target, ast.Name):
            scope.vars[target.id] = v
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = self.iterate(v, target, scope)
            star = [i for i, e in enumerate(target.elts) if isinstance(e, ast.Starred)]
            if star:
                k = star[0]
                n_after = len(target.elts) - k - 1
                if len(items) < len(target.elts) - 1:
                    raise ValueError("not enough values to unpack")
                parts = items[:k] + [list(items[k:len(items) - n_after])] + items[len(items) - n_after:]
                for e, x in zip(target.elts, parts):
                    self.assign(e.value if isinstance(e, ast.Starred) else e, x, scope)
            else:
                if len(items) != len(target.elts) and not isinstance(v, _AbstractSeq):
                    raise ValueError(f"cannot unpack {len(items)} values into {len(target.elts)}")
                for e, x in zip(target.elts, items):
                    self.assign(e, x, scope)
        elif isinstance(target, ast.Subscript):
            obj = self.eval(target.value, scope)
            idx = self.eval(target.slice, scope)
            if isinstance(obj, TensorVar):
                new = self.op(_setitem, [obj, idx, v], {}, target, scope)
                self.rebind(obj, new, scope, target)
            elif type(obj) in (list, dict):
                idx = self.specialize(idx, target, scope) if isinstance(idx, SymInt) else idx
                if isinstance(obj, list):  # the index must be in range on the next call too
                    self.effects.observe(obj)
                self.effects.call(obj, "__setitem__", [idx, v], {})
            elif isinstance(obj, Unknown):
                pass
            else:
                self.brk(B.UNSUPPORTED_STMT, target, scope,
                         detail=f"item assignment on {type(obj).__name__}", whole_stmt=True)
        elif isinstance(target, ast.Attribute):
            obj = self.eval(target.value, scope)
            if isinstance(obj, Unknown):
                return
            src = None if self.abstract else self.value_sources.get(id(obj))
            if (src is not None or self.abstract) and S.plain_setattr(obj, target.attr):
                self.effects.setattr(obj, src, target.attr, v)
                return
            self.brk(B.UNSUPPORTED_STMT, target, scope,
                     detail=f"attribute assignment `.{target.attr} = ...`", whole_stmt=True)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, v, scope)
        else:
            self.brk(B.UNSUPPORTED_STMT, target, scope, whole_stmt=True)

    def container_key(self, e, scope):
        k = self.eval(e, scope)
        return self.specialize(k, e, scope) if isinstance(k, SymInt) else k

    def rebind(self, old: TensorVar, new: TensorVar, scope, node):
        """An in-place op gave `old` the value `new`. In-place ops are functionalized: the
        base `old` views (if any) gets the new values written back (`_setitem` and friends),
        every live view of that base is derived again from its new value, and every variable
        holding an old TensorVar (in any live frame) now holds the new one. Graph inputs
        mutated this way are written back by the runtime."""
        if self.abstract:
            self._replace(old, new, scope)
            return
        chain, root = [], old
        while root.view_of is not None:
            chain.append(root)
            root = root.view_of[0]
        if root.source is not None:
            self.check_no_alias(root, node, scope)
        new_root = new
        # an alias of its parent (`detach`, `x[:]`, `view` to the same shape): the same elements
        chain = [v for v in chain if not _same_layout(v.meta, v.view_of[0].meta)]
        if all(v.view_of[1] in _SCATTER and v.view_of[4] is None
               and v.meta.dtype == v.view_of[0].meta.dtype for v in chain):
            for v in chain:  # write back level by level: view → its parent → ... → root
                new_root = _SCATTER[v.view_of[1]](self, v.view_of[0], v.view_of, new_root, node, scope)
        else:  # any other view (narrow, select, diagonal, an item of split...): by its strides
            new_root = self.scatter_strided(root, old, new, node, scope)
        replaced = {id(root): (root, new_root)}
        for v in self.live_views(root, scope, also=old):
            parent, fn, args, kwargs, item = v.view_of
            p_new = replaced[id(parent)][1]
            derived = self.op(fn, [p_new, *args], kwargs, node, scope)
            if item is not None:
                derived = derived[item]
            replaced[id(v)] = (v, derived)
        if old is not root:
            new = replaced[id(old)][1]
        for tv, tv_new in replaced.values():
            self._replace(tv, tv_new, scope)

    def scatter_strided(self, root: TensorVar, view: TensorVar, new: TensorVar, node, scope):
        """`root` with `view`'s elements replaced by `new`, placed by the view's sizes, strides and
        offset in root's storage (root dense, so that a copy of it keeps that layout)."""
        r, v = root.meta, view.meta
        if _has_symint([self.sizes(root), self.sizes(view)]) or v.dtype != r.dtype \
                or not _dense(r):
            self.brk(B.INPLACE_VIEW, node, scope, whole_stmt=True,
                     detail=f"through `{getattr(view.view_of[1], '__name__', view.view_of[1])}`")
        # as_strided_scatter places by the strides of a contiguous copy of its input: scatter
        # into root with its dims in memory order (a contiguous view), then put them back
        order = sorted(range(r.dim()), key=lambda d: -r.stride(d))
        base = self.op(torch.permute, [root, order], {}, node, scope) if order != list(range(r.dim())) else root
        out = self.op(torch.as_strided_scatter, [base, new, tuple(v.size()), tuple(v.stride()),
                                                 v.storage_offset() - r.storage_offset()], {}, node, scope)
        if base is root:
            return out
        return self.op(torch.permute, [out, sorted(range(r.dim()), key=lambda d: order[d])], {}, node, scope)

    def check_no_alias(self, inp: TensorVar, node, scope):
        """An input written in place must not share memory with another input: the graph
        reads each input once, so it would not see the write through the other name."""
        t = self.sources.resolve(inp.source)
        ptr = t.untyped_storage().data_ptr()
        for src, other in self.g.inputs:
            if src == inp.source or not isinstance(other, torch.Tensor) or other.numel() == 0:
                continue
            if other.untyped_storage().data_ptr() == ptr:
                self.brk(B.INPLACE_VIEW, node, scope, whole_stmt=True,
                         detail=f"`{inp.source}` shares memory with `{src}`")
            self.sources.guard(f"{inp.source}.untyped_storage().data_ptr() != {src}.untyped_storage().data_ptr()",
                               f"{inp.source} does not share memory with {src}")

    def _replace(self, old, new, scope):
        if new is old:  # the functional form gave its input back (`conj_physical` of a real tensor)
            return
        if old.source is not None:
            new.source = None
            self.mutated_inputs[old.source] = new
        s = scope
        while s is not None:
            _replace_in(s.vars, old, new)
            s = s.parent if s.parent is not None else s.enclosing
        for k, v in list(self.mutated_inputs.items()):
            if v is old:
                self.mutated_inputs[k] = new
        self._newer[id(old)] = (old, new)

    def live_views(self, root, scope, also=None) -> list:
        """TensorVars in live frames (and `also`) that view `root` (directly or through other
        views), parents before their views."""
        found: dict[int, TensorVar] = {}

        def visit(value):
            for v in leaves(value):
                if isinstance(v, TensorVar):
                    chain, p = [], v
                    while p.view_of is not None:
                        chain.append(p)
                        p = p.view_of[0]
                    if p is root:
                        for c in chain:
                            found[id(c)] = c
        visit(also)
        s = scope
        while s is not None:
            for v in s.vars.values():
                visit(self.latest(v))
            s = s.parent if s.parent is not None else s.enclosing

        def depth(v):
            d = 0
            while v.view_of is not None:
                v, d = v.view_of[0], d + 1
            return d
        return sorted(found.values(), key=depth)

    def latest(self, v):
        """A tensor's value after the in-place ops on it: references outside the frames'
        variables (the items of a loop, nested containers) still hold the old TensorVar."""
        while isinstance(v, TensorVar) and id(v) in self._newer:
            v = self._newer[id(v)][1]
        return v

    # ===================================================================== expressions
    def eval(self, e, scope):
        m = getattr(self, "_ex_" + type(e).__name__, None)
        if m is None:
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"`{type(e).__name__}` expression")
        v = self.latest(m(e, scope))
        scope.completed[id(e)] = (e, v)
        return v

    def _ex_Constant(self, e, scope):
        return e.value

    def _ex_Name(self, e, scope):
        name = e.id
        try:
            return scope.lookup(name)
        except KeyError:
            pass
        g = scope.fs.globals
        if name in g:
            v = g[name]
            return self.global_value(name, v, scope)
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise NameError(f"name '{name}' is not defined")

    def global_value(self, name, v, scope):
        if self.abstract:  # the editor's walk must not change the program's lists either
            return self.effects.model(v, None, lambda x, _: x) if type(v) in MUTABLE else v
        src = self.sources.global_source(scope.fs.globals, name, v)
        return self.wrap_external(v, src)

    def wrap_external(self, v, src):
        """A value from outside the frame (argument, global, attribute, closure): tensors
        become graph inputs; lists, dicts and sets are modelled (side_effects.py), their items
        wrapped; tuples are wrapped item by item."""
        if isinstance(v, torch.Tensor):
            return self.input(v, src)
        if type(v) in MUTABLE and not self.abstract:
            return self.effects.model(v, src, self.wrap_external)
        if type(v) is tuple:
            out = tuple(self.wrap_external(x, None if src is None else f"{src}[{i}]")
                        for i, x in enumerate(v))
            return v if all(a is b for a, b in zip(out, v)) else out
        if src is not None and not isinstance(v, (int, float, str, bool, type(None))):
            self.value_sources[id(v)] = src
        return v

    def input(self, t: torch.Tensor, src: str) -> TensorVar:
        """A tensor from outside the graph: a graph input, guarded on its metadata."""
        if self.abstract:
            return self.g.abstract_input(src)
        tv = self.g.input(t, src)
        if tv.source == src:
            self.sources.guard_tensor(src, t, self.dynamic.get(src, ()))
        else:  # the same tensor reached by two names: guard the aliasing
            self.sources.guard(f"{src} is {tv.source}", f"{src} is the same tensor as {tv.source}")
        # read again after an in-place op on it (e.g. `self.buf.add_(1)`): the new value
        return self.mutated_inputs.get(tv.source, tv)

    def _ex_Attribute(self, e, scope):
        obj = self.eval(e.value, scope)
        return self.getattr(obj, e.attr, e, scope)

    def getattr(self, obj, attr, e, scope):
        if isinstance(obj, Unknown):
            return UNKNOWN
        if isinstance(obj, TensorVar):
            return self.tensor_attr(obj, attr, e, scope)
        if isinstance(obj, _AbstractSeq):
            return UNKNOWN
        assigned, v = self.effects.getattr(obj, attr)
        if assigned:
            return v
        if isinstance(obj, nn.Module):
            return self.module_attr(obj, attr, e, scope)
        try:
            v = getattr(obj, attr)
        except AttributeError:
            raise
        if isinstance(obj, types.ModuleType):
            if self.abstract:
                return v
            if isinstance(v, torch.Tensor) or type(v) in MUTABLE:
                src = self.sources.attr_source(obj, attr)
                return self.wrap_external(v, src)
            return v
        src = self.value_sources.get(id(obj))
        if src is not None and not self.abstract and not isinstance(v, torch.Tensor) \
                and not isinstance(obj, (type, types.FunctionType)):
            self.sources.guard_value(f"{src}.{attr}", v)
        if type(v) in MUTABLE and not self.abstract:
            if src is None:  # found through an object of no source: that very object
                src = self.sources.constant(obj, type(obj).__name__)
            return self.wrap_external(v, f"{src}.{attr}")
        if isinstance(v, torch.Tensor):
            if src is None:
                if self.abstract:
                    return TensorVar(None, None, None)
                src = self.sources.constant(v, f"{type(obj).__name__}_{attr}")
                return self.input(v, src)
            return self.input(v, f"{src}.{attr}")
        if src is not None and not isinstance(v, (int, float, str, bool, type(None))):
            self.value_sources[id(v)] = f"{src}.{attr}"
        return v

    def module_attr(self, mod, attr, e, scope):
        if self.abstract:
            return getattr(mod, attr)
        src = self.value_sources.get(id(mod)) or self.sources.constant(mod, type(mod).__name__)
        self.value_sources[id(mod)] = src
        v = getattr(mod, attr)
        if attr == "training":
            self.sources.guard(f"{src}.training is {v}", f"{src}.training (train/eval mode)")
        elif isinstance(v, torch.Tensor):
            return self.input(v, f"{src}.{attr}")
        elif isinstance(v, (int, float, bool, str, type(None))):
            # hyper-parameters such as Dropout.p: constants, guarded by value
            self.sources.guard(f"{src}.{attr} == {v!r}", f"{src}.{attr} (module attribute)")
        elif isinstance(v, nn.Module):
            self.value_sources[id(v)] = f"{src}.{attr}"
            self.sources.guard_module(v, f"{src}.{attr}")
        elif type(v) in MUTABLE or isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v):
            return self.wrap_external(v, f"{src}.{attr}")
        return v

    def tensor_attr(self, t: TensorVar, attr, e, scope):
        if attr in C.META_ATTRS:
            if t.meta is None:
                return UNKNOWN
            if attr == "shape":
                return self.sizes(t)
            if attr == "ndim":
                return t.meta.dim()
            if attr == "device":
                return t.device
            return getattr(t.meta, attr)
        if attr == "T":
            return self.op(torch.Tensor.permute, [t, list(range(t.meta.dim()))[::-1]] if t.meta is not None
                           else [t, 1, 0], {}, e, scope)
        if attr == "mT":
            return self.op(torch.Tensor.transpose, [t, -2, -1], {}, e, scope)
        if attr in ("real", "imag", "data", "grad"):
            if attr == "data":
                return self.op(torch.Tensor.detach, [t], {}, e, scope)
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"Tensor.{attr}")
        if attr.startswith("is_") and isinstance(inspect.getattr_static(torch.Tensor, attr, None),
                                                 types.GetSetDescriptorType):
            # a flag of the tensor's kind (`is_nested`, `is_sparse`, `is_cpu`...): what an empty
            # tensor of its dtype on its device says (the meta tensor would say `is_meta`)
            if t.meta is None:
                return UNKNOWN
            return getattr(torch.empty(0, dtype=t.meta.dtype, device=t.device), attr)
        if isinstance(inspect.getattr_static(torch.Tensor, attr, None), types.GetSetDescriptorType) \
                and not callable(getattr(torch.Tensor, attr, None)):
            return self.op(E.tensor_property(attr), [t], {}, e, scope)  # `x.H`, `x.mH`, `x.real`...
        # a method: bound lazily
        return _TensorMethod(t, attr)

    def sizes(self, t: TensorVar):
        """`t.shape` as a tuple of ints, with SymInts for dynamic dims of graph inputs."""
        shape = tuple(t.meta.shape)
        src = t.source
        dyn = self.dynamic.get(src, ()) if src is not None else ()
        if src is None and self.dynamic and not self.abstract:
            # an intermediate's meta shape holds the example sizes: pin the dynamic dims of
            # the inputs (guarded) rather than bake sizes that may change into the graph
            for s, obj in self.g.inputs:
                for d in self.dynamic.get(s, ()):
                    if isinstance(obj, torch.Tensor) and d < obj.dim():
                        self.sources.guard(f"{s}.shape[{d}] == {obj.shape[d]}",
                                           f"{s}.shape[{d}] (an intermediate's size is read)")
        if not dyn:
            return torch.Size(shape)
        out = []
        for d, n in enumerate(shape):
            if d in dyn:
                out.append(SymInt(n, f"{src}.shape[{d}]",
                                  lambda d=d: self.g.sym_node(torch.ops.aten.sym_size.int, (t, d), shape[d])))
            else:
                out.append(n)
        return SymShape(out)

    def _ex_Subscript(self, e, scope):
        obj = self.eval(e.value, scope)
        idx = self.eval(e.slice, scope)
        return self.getitem(obj, idx, e, scope)

    def getitem(self, obj, idx, e, scope):
        if isinstance(obj, TensorVar):
            if isinstance(idx, TensorVar) and idx.is_bool:
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            if isinstance(idx, tuple) and any(isinstance(i, TensorVar) and i.is_bool for i in idx):
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            return self.op(operator.getitem, [obj, idx], {}, e, scope)
        if isinstance(obj, (Unknown, _AbstractSeq)) or isinstance(idx, Unknown):
            return obj.item() if isinstance(obj, _AbstractSeq) else UNKNOWN
        if isinstance(idx, SymInt):
            idx = self.specialize(idx, e, scope)
        if isinstance(obj, nn.Module):  # ModuleList / Sequential / ModuleDict
            v = obj[idx]
            if isinstance(v, nn.Module) and not self.abstract:
                src = self.value_sources.get(id(obj))
                if src is not None:
                    self.value_sources[id(v)] = f"{src}[{idx!r}]"
            return v
        if isinstance(idx, TensorVar):
            self.brk(B.TENSOR_TO_PY, e, scope, detail="indexing a Python container with a tensor")
        self.effects.observe_item(obj, idx)
        return obj[idx]

    def _ex_Slice(self, e, scope):
        f = lambda x: None if x is None else self.eval(x, scope)
        return slice(f(e.lower), f(e.upper), f(e.step))

    def _ex_Tuple(self, e, scope):
        return tuple(self._elts(e.elts, scope))

    def _ex_List(self, e, scope):
        return list(self._elts(e.elts, scope))

    def _ex_Set(self, e, scope):
        return set(self._elts(e.elts, scope))

    def _elts(self, elts, scope):
        out = []
        for x in elts:
            if isinstance(x, ast.Starred):
                out.extend(self.iterate(self.eval(x.value, scope), x, scope))
            else:
                out.append(self.eval(x, scope))
        return out

    def _ex_Dict(self, e, scope):
        d = {}
        for k, v in zip(e.keys, e.values):
            if k is None:
                d.update(self.observed(self.eval(v, scope)))
            else:
                d[self.eval(k, scope)] = self.eval(v, scope)
        return d

    def _ex_JoinedStr(self, e, scope):
        parts = []
        for v in e.values:
            x = self.eval(v, scope)
            if isinstance(x, Unknown):
                return UNKNOWN
            parts.append(x)
        return "".join(parts)

    def _ex_FormattedValue(self, e, scope):
        v = self.eval(e.value, scope)
        if isinstance(v, TensorVar):
            self.brk(B.TENSOR_TO_PY, e, scope, detail="formatting a tensor into a string")
        if isinstance(v, Unknown):
            return UNKNOWN
        if isinstance(v, SymInt):
            v = self.specialize(v, e, scope)
        if isinstance(v, SymShape):  # the text holds this call's sizes
            v = torch.Size([self.specialize(d, e, scope) if isinstance(d, SymInt) else d for d in v])
        self.effects.observe(v)
        conv = {115: str, 114: repr, 97: ascii}.get(e.conversion, lambda x: x)
        spec = self.eval(e.format_spec, scope) if e.format_spec is not None else ""
        return format(conv(v), spec)

    def _ex_NamedExpr(self, e, scope):
        v = self.eval(e.value, scope)
        self.assign(e.target, v, scope)
        return v

    def _ex_IfExp(self, e, scope):
        t = self.truth(self.eval(e.test, scope), e.test, scope, kind=B.DATA_IF)
        if t is UNKNOWN:
            a, b = self.eval(e.body, scope), self.eval(e.orelse, scope)
            return a if isinstance(a, TensorVar) else b if isinstance(b, TensorVar) else UNKNOWN
        return self.eval(e.body if t else e.orelse, scope)

    def _ex_BoolOp(self, e, scope):
        is_and = isinstance(e.op, ast.And)
        v = None
        for x in e.values:
            v = self.eval(x, scope)
            t = self.truth(v, x, scope, kind=B.DATA_IF)
            if t is UNKNOWN:
                return UNKNOWN
            if is_and and not t or not is_and and t:
                return v
        return v

    def _ex_UnaryOp(self, e, scope):
        v = self.eval(e.operand, scope)
        op = type(e.op).__name__
        if op == "Not":
            t = self.truth(v, e.operand, scope, kind=B.DATA_IF)
            return UNKNOWN if t is UNKNOWN else not t
        if isinstance(v, TensorVar):
            return self.op(C.UNARYOPS[op], [v], {}, e, scope)
        if isinstance(v, Unknown):
            return UNKNOWN
        if isinstance(v, SymInt):
            return self.sym_arith(C.UNARYOPS[op], [v], e, scope)
        self.require_foldable([v], e, scope)
        return C.UNARYOPS[op](v)

    def _ex_BinOp(self, e, scope):
        a = self.eval(e.left, scope)
        b = self.eval(e.right, scope)
        return self.binop(type(e.op).__name__, a, b, e, scope)

    def binop(self, op, a, b, e, scope):
        fn = C.BINOPS[op]
        if isinstance(a, TensorVar) or isinstance(b, TensorVar):
            return self.op(fn, [a, b], {}, e, scope)
        if isinstance(a, (Unknown, _AbstractSeq)) or isinstance(b, (Unknown, _AbstractSeq)):
            return UNKNOWN
        if isinstance(a, SymInt) or isinstance(b, SymInt):
            return self.sym_arith(fn, [a, b], e, scope)
        if isinstance(a, (list, tuple)) and contains_tensor(a) and op == "Mult":
            return a * b
        self.require_foldable([a, b], e, scope)
        return fn(self.observed(a), self.observed(b))

    def _ex_Compare(self, e, scope):
        left = self.eval(e.left, scope)
        result = True
        for opnode, right_e in zip(e.ops, e.comparators):
            right = self.eval(right_e, scope)
            op = type(opnode).__name__
            fn = C.CMPOPS[op]
            if op in ("Is", "IsNot"):
                r = fn(left, right) if not isinstance(left, Unknown) and not isinstance(right, Unknown) \
                    or left is None and right is None else UNKNOWN
                if isinstance(left, TensorVar) or isinstance(right, TensorVar):
                    r = fn(left, right)
            elif isinstance(left, TensorVar) or isinstance(right, TensorVar):
                if op in ("In", "NotIn"):
                    self.brk(B.TENSOR_TO_PY, e, scope, detail="`in` on a tensor")
                r = self.op(fn, [left, right], {}, e, scope)
            elif isinstance(left, (Unknown, _AbstractSeq)) or isinstance(right, (Unknown, _AbstractSeq)):
                r = UNKNOWN
            elif isinstance(left, SymInt) or isinstance(right, SymInt):
                r = self.sym_compare(fn, left, right, e, scope)
            elif isinstance(left, SymShape) or isinstance(right, SymShape):
                # SymInts compare by identity: compare the exact sizes (guarded) instead
                spec = lambda v: tuple(self.specialize(d, e, scope) if isinstance(d, SymInt) else d  # noqa: E731
                                       for d in v) if isinstance(v, tuple) else v
                r = fn(spec(left), spec(right))
            else:
                # `k in d` reads d's keys alone (`"output_attentions" in kwargs`); on an object
                # of a user class, its own `__contains__` answers (as its `__getitem__` does)
                member = op in ("In", "NotIn")
                keys = list(right) if member and isinstance(right, dict) else right
                self.require_foldable([left] if member and _user_mapping(right) else [left, keys], e, scope)
                r = fn(self.observed(left), self.observed(right))
            if len(e.ops) == 1:
                return r
            t = self.truth(r, e, scope, kind=B.DATA_IF)
            if t is UNKNOWN:
                return UNKNOWN
            if not t:
                return r
            result = r
            left = right
        return result

    def _ex_Lambda(self, e, scope):
        return LocalFunction(e, scope, self._local_defaults(e.args, scope))

    def _comprehension(self, e, scope, make):
        inner = Scope(scope.fs, scope.parent, scope.depth, dict(scope.vars), scope.enclosing)
        inner.call_node = scope.call_node
        out = []

        def loop(gens):
            if not gens:
                out.append(make(inner))
                return
            g = gens[0]
            it = self.eval(g.iter, inner)
            if isinstance(it, Unknown) or (self.abstract and isinstance(it, TensorVar)):
                self.assign(g.target, UNKNOWN, inner)
                make(inner)
                raise _Opaque()
            for item in self.iterate(it, g.iter, inner):
                self.assign(g.target, item, inner)
                ok = True
                for cond in g.ifs:
                    t = self.truth(self.eval(cond, inner), cond, inner, kind=B.DATA_IF)
                    if t is UNKNOWN or not t:
                        ok = False
                        break
                if ok:
                    loop(gens[1:])
        try:
            loop(e.generators)
        except _Opaque:
            return UNKNOWN
        return out

    def _ex_ListComp(self, e, scope):
        return self._comprehension(e, scope, lambda s: self.eval(e.elt, s))

    def _ex_GeneratorExp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: self.eval(e.elt, s))
        return r if isinstance(r, Unknown) else tuple(r)

    def _ex_SetComp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: self.eval(e.elt, s))
        return r if isinstance(r, Unknown) else set(r)

    def _ex_DictComp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: (self.eval(e.key, s), self.eval(e.value, s)))
        return r if isinstance(r, Unknown) else dict(r)

    def _ex_Starred(self, e, scope):
        return self.eval(e.value, scope)

    # ===================================================================== truth, iteration
    def truth(self, v, node, scope, *, kind, whole_stmt=False):
        if isinstance(v, TensorVar):
            self.brk(kind, node, scope, detail=f"`{_short(node)}` is a tensor", whole_stmt=whole_stmt
                     or kind is B.DATA_WHILE, cond=v)
        if isinstance(v, Unknown) or isinstance(v, _AbstractSeq):
            return UNKNOWN
        if isinstance(v, SymInt):
            return bool(self.specialize(v, node, scope))
        self.effects.observe_len(v)  # a container's truth is its length's
        return bool(v)

    def observed(self, v):
        """`v`, whose contents the capture reads (guarded if it is a model: side_effects.py)."""
        self.effects.observe(v)
        return v

    def iterate(self, v, node, scope, whole_stmt=False) -> list:
        self.effects.observe(v)
        if isinstance(v, (list, tuple)):
            return list(v)
        if isinstance(v, _AbstractSeq):
            return v
        if isinstance(v, TensorVar):
            if v.meta is None:
                return _AbstractSeq()
            if v.meta.dim() == 0:
                raise TypeError("iteration over a 0-d tensor")
            n = self.sizes(v)[0]  # guarded: the loop is unrolled for this many rows
            n = self.specialize(n, node, scope) if isinstance(n, SymInt) else n
            return [self.op(operator.getitem, [v, i], {}, node, scope) for i in range(n)]
        if isinstance(v, dict):
            return list(v)
        if isinstance(v, (range, str, set, frozenset, zip, enumerate, map, filter, type({}.items()),
                          type({}.keys()), type({}.values()), reversed)):
            return list(v)
        if isinstance(v, (nn.ModuleList, nn.Sequential)):
            src = self.value_sources.get(id(v))
            items = list(v)
            if src is not None and not self.abstract:
                self.sources.guard(f"len({src}) == {len(items)}", f"len({src})")
                for i, m in enumerate(items):
                    self.value_sources[id(m)] = f"{src}[{i}]"
            return items
        if isinstance(v, nn.ModuleDict):
            return list(v.keys())
        if isinstance(v, Unknown):
            return _AbstractSeq()
        self.brk(B.UNROLLABLE_LOOP, node, scope, detail=f"iteration over {type(v).__name__}",
                 whole_stmt=True)

    # ===================================================================== symbolic ints
    def specialize(self, s: SymInt, node, scope):
        """A dynamic size used as a Python value: guard on its exact value."""
        if not self.abstract:
            self.sources.guard(f"{s.expr} == {s.hint}", f"{s.expr} (used as a Python value)")
        return s.hint

    def sym_arith(self, fn, args, e, scope):
        hints = [a.hint if isinstance(a, SymInt) else a for a in args]
        if not all(isinstance(h, int) for h in hints) or fn is operator.truediv:
            return fn(*[self.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args])
        hint = fn(*hints)
        sym = _SYM_TEXT.get(fn)
        exprs = [a.expr if isinstance(a, SymInt) else repr(a) for a in args]
        expr = f"({sym.join(exprs)})" if len(args) == 2 else f"({sym}{exprs[0]})"
        return SymInt(hint, expr, lambda: self.g.sym_node(fn, args, hint))

    def sym_compare(self, fn, a, b, e, scope):
        ha = a.hint if isinstance(a, SymInt) else a
        hb = b.hint if isinstance(b, SymInt) else b
        r = fn(ha, hb)
        if not self.abstract:
            ea = a.expr if isinstance(a, SymInt) else repr(a)
            eb = b.expr if isinstance(b, SymInt) else repr(b)
            text = {operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=",
                    operator.gt: ">", operator.ge: ">="}.get(fn)
            if text is None:
                return fn(self.specialize(a, e, scope) if isinstance(a, SymInt) else a,
                          self.specialize(b, e, scope) if isinstance(b, SymInt) else b)
            self.sources.guard(f"({ea} {text} {eb}) is {r}", f"{ea} {text} {eb}")
        return r

    # ===================================================================== calls
    def _ex_Call(self, e, scope):
        fn = self.eval(e.func, scope)
        args = []
        for a in e.args:
            if isinstance(a, ast.Starred):
                args.extend(self.iterate(self.eval(a.value, scope), a, scope))
            else:
                args.append(self.eval(a, scope))
        kwargs = {}
        for k in e.keywords:
            v = self.eval(k.value, scope)
            if k.arg is None:
                if isinstance(v, Unknown):
                    return UNKNOWN
                kwargs.update(self.observed(v))
            else:
                kwargs[k.arg] = v
        return self.call(fn, args, kwargs, e, scope)

    def call(self, fn, args, kwargs, e, scope):
        if isinstance(fn, _TensorMethod):
            return self.tensor_method(fn.t, fn.name, args, kwargs, e, scope)
        if isinstance(fn, Unknown):
            if any(isinstance(a, TensorVar) for a in args):
                return TensorVar(None, None, None)  # abstract: probably a tensor function
            return UNKNOWN
        if isinstance(fn, (LocalFunction, FunctionSource)):
            return self.inline(fn, args, kwargs, e, scope)
        if hasattr(type(fn), "__fl_abstract_call__"):  # the editor's stand-ins (analyze.py)
            return fn.__fl_abstract_call__(self, args, kwargs, e, scope)
        if isinstance(fn, BoundUserMethod):
            return self.inline(fn.fn, args, kwargs, e, scope, self_value=fn.self_value)
        if C.compile_time_answer(fn) is not None:
            return C.compile_time_answer(fn)
        if C.is_usage_log(fn):
            return None
        if C.is_torch_function_query(fn) and all(
                isinstance(v, TensorVar) or v is None or _foldable(v) for v in leaves([args, kwargs])):
            return False
        if fn is torch._assert and not contains_tensor(args):  # a check on plain values
            if not args[0]:
                raise AssertionError(args[1] if len(args) > 1 else "")
            return None
        if fn is print:
            self.brk(B.PRINT, e, scope)
        if C.is_logging_call(fn):
            self.brk(B.LOGGING, e, scope, detail=f"call to {getattr(fn, '__qualname__', fn)}")
        if isinstance(fn, nn.Module):
            return self.call_module(fn, args, kwargs, e, scope)
        if fn is isinstance:
            return self.isinstance_(args, e, scope)
        if fn in (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.autocast):
            return fn(*args, **kwargs)  # context managers, entered by `with`
        if fn in _BUILTIN_HANDLERS:
            return _BUILTIN_HANDLERS[fn](self, args, kwargs, e, scope)
        if C.is_torch_callable(fn):
            if isinstance(fn, types.FunctionType) and not contains_tensor([args, kwargs]):
                # torch's own Python helpers on plain values (`F._canonical_mask(None, ...)`,
                # `F._none_or_dtype(None)`) are code like the user's: what they touch decides
                return self.inline(fn, args, kwargs, e, scope)
            return self.torch_call(fn, args, kwargs, e, scope)
        if isinstance(fn, types.MethodType) and isinstance(fn.__self__, nn.Module):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.MethodType) and not isinstance(fn.__func__, types.BuiltinFunctionType):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.BuiltinMethodType) and isinstance(fn.__self__, MUTABLE):
            return self.container_method(fn, args, kwargs, e, scope)
        if isinstance(fn, types.BuiltinMethodType) and type(fn.__self__) in _IMMUTABLE:
            return self.fold(fn, args, kwargs, e, scope)  # `name.startswith("x")`, `"{}".format(n)`
        if isinstance(fn, types.FunctionType) and _stdlib(fn) and not self.abstract and not any(
                contains_tensor(v) or type(v) in MUTABLE or isinstance(v, (Unknown, SymInt))
                for v in list(args) + list(kwargs.values())):
            return fn(*args, **kwargs)  # the standard library on plain values (inspect, re...)
        if isinstance(fn, (types.FunctionType,)):
            return self.inline(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and issubclass(fn, (int, float, bool, str, tuple, list, dict, set,
                                                   range, slice, enumerate, zip, reversed)):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, (torch.dtype, torch.device)):
            self.brk(B.UNSUPPORTED_EXPR, e, scope)
        if isinstance(fn, functools_partial):
            return self.call(fn.func, list(fn.args) + list(args), {**fn.keywords, **kwargs}, e, scope)
        if C.is_pure_foldable(fn):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and fn.__module__.startswith("torch"):
            # constructing torch objects (Size, dtype, device...) with constant args
            if not any(contains_tensor(a) for a in args):
                return fn(*args, **kwargs)
        if isinstance(fn, type):  # a class with Python source: the object runs in Python
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"creating a `{fn.__qualname__}` object")
        self.brk(B.UNKNOWN_CALL, e, scope,
                 detail=f"call to {getattr(fn, '__qualname__', type(fn).__name__)}")

    def container_method(self, fn, args, kwargs, e, scope):
        """list.append, dict.get...: on the capture's containers (its own, or models of the
        real ones, side_effects.py), mutations logged."""
        obj, name = fn.__self__, fn.__name__
        if args and isinstance(args[0], SymInt) and isinstance(obj, list) and name in _INDEXED:
            args = [self.specialize(args[0], e, scope)] + list(args[1:])  # a position
        if type(obj) in MUTABLE:
            if name == "get" and args and args[0] in obj:
                self.effects.observe_item(obj, args[0])
            elif name not in _BLIND_WRITES and not (name == "__setitem__" and isinstance(obj, dict)):
                self.effects.observe(obj)
            return self.effects.call(obj, name, args, kwargs)
        # a subclass (OrderedDict, defaultdict...) from outside, not modelled: run on a copy,
        # and a call that would change it runs in Python
        dup = copy.copy(obj)
        before = S.contents(dup)
        r = getattr(dup, name)(*args, **kwargs)
        if S.changed(dup, before):
            self.brk(B.UNKNOWN_CALL, e, scope,
                     detail=f"{type(obj).__name__}.{fn.__name__}() changes an object from outside")
        return r

    def require_foldable(self, vals, e, scope):
        """Folding is sound only for values guarded by value: an opaque object (a NumPy array,
        say) is guarded by its type alone, so computing with it must happen in Python."""
        for v in vals:
            if not _foldable(v) and not self.abstract:
                self.brk(B.UNSUPPORTED_EXPR, e, scope,
                         detail=f"operation on a {type(v).__name__} object")

    def fold(self, fn, args, kwargs, e, scope):
        """A pure Python function: evaluated now if its arguments are known."""
        vals = list(args) + list(kwargs.values())
        if any(isinstance(a, Unknown) for a in vals):
            return UNKNOWN
        if fn not in (isinstance, type, id, callable, hasattr, getattr):
            self.require_foldable(vals, e, scope)
            for v in vals:
                self.effects.observe(v)
        if any(isinstance(a, TensorVar) for a in vals) or fn is sum and contains_tensor(vals):
            if fn in (int, float, bool, complex):
                self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() of a tensor")
            if fn in (tuple, list) and len(args) == 1:
                return fn(self.iterate(args[0], e, scope))
            if fn is len and len(args) == 1 and isinstance(args[0], TensorVar):
                if args[0].meta is None:
                    return UNKNOWN
                return self.sizes(args[0])[0]
            if fn in (enumerate, zip, reversed, sorted) and not any(isinstance(a, TensorVar) for a in args):
                return list(fn(*args, **kwargs))
            if fn in (enumerate, zip, reversed):
                return list(fn(*[self.iterate(a, e, scope) if isinstance(a, TensorVar) else a for a in args]))
            if fn is math.sqrt or fn in (abs, pow, max, min, round):
                m = {abs: torch.abs, pow: torch.pow}.get(fn)
                if m is not None:
                    return self.op(m, args, kwargs, e, scope)
            if fn in (tuple, list) or fn in (enumerate, zip):
                return fn(*args)
            if fn is sum:
                acc = args[1] if len(args) > 1 else 0
                for x in self.iterate(args[0], e, scope):
                    acc = self.binop("Add", acc, x, e, scope)
                return acc
            self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{getattr(fn, '__name__', fn)}() of a tensor")
        args = [self.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args]
        containers = [(a, S.contents(a)) for a in args if type(a) in MUTABLE]
        r = fn(*args, **kwargs)
        for a, before in containers:
            if S.changed(a, before):  # operator.setitem, operator.iadd...: Python makes it
                S.restore(a, before)
                self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{getattr(fn, '__name__', fn)}() "
                         "changes its argument")
        if isinstance(r, (zip, map, filter, enumerate, reversed)) or type(r).__name__.endswith("iterator"):
            return list(r)
        return r

    def isinstance_(self, args, e, scope):
        obj, cls = args
        if isinstance(obj, TensorVar):
            types_ = cls if isinstance(cls, tuple) else (cls,)
            if any(isinstance(c, type) and issubclass(torch.Tensor, c) for c in types_):
                return True
            if nn.Parameter in types_ and obj.source is not None and not self.abstract:
                return isinstance(self.sources.resolve(obj.source), nn.Parameter)
            return False
        if isinstance(obj, (Unknown, _AbstractSeq)):
            return UNKNOWN
        return isinstance(obj, cls)

    def call_module(self, mod, args, kwargs, e, scope):
        if mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "_backward_hooks", None):
            self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{type(mod).__name__} has hooks")
        if not self.abstract:
            src = self.value_sources.get(id(mod))
            if src is None:
                src = self.sources.constant(mod, type(mod).__name__)
                self.value_sources[id(mod)] = src
            # identity and .training, however the module was reached (a global, a list item)
            self.sources.guard_module(mod, src)
        fwd = type(mod).forward
        return self.inline(fwd, args, kwargs, e, scope, self_value=mod)

    # ----------------------------------------------------------------- tensor ops
    def torch_call(self, fn, args, kwargs, e, scope):
        if self.abstract and E.has_dynamic_output_shape(fn) and any(isinstance(a, TensorVar) for a in args):
            self.brk(B.DYNAMIC_SHAPE, e, scope, detail=_name_of(fn))
        tensors = [a for a in list(args) + list(kwargs.values()) if contains_tensor(a)]
        if fn in (torch.is_tensor,):
            return isinstance(args[0], TensorVar)
        if fn in C.STATE_QUERIES:
            return fn(*args)
        if fn is torch.Size:
            return torch.Size(args[0])
        return self.op(fn, args, kwargs, e, scope)

    def tensor_method(self, t: TensorVar, name, args, kwargs, e, scope):
        if name in C.DATA_READS:
            self.brk(C.DATA_READS[name], e, scope, detail=f"Tensor.{name}()")
        if self.abstract and E.has_dynamic_output_shape(getattr(torch.Tensor, name, None)):
            self.brk(B.DYNAMIC_SHAPE, e, scope, detail=f"Tensor.{name}()")
        if name in C.META_METHODS:
            if t.meta is None:
                return UNKNOWN
            if name == "size":
                s = self.sizes(t)
                return s if not args and "dim" not in kwargs else s[args[0] if args else kwargs["dim"]]
            if name == "dim" or name == "ndimension":
                return t.meta.dim()
            if name in ("numel", "nelement"):
                s = self.sizes(t)
                n = 1
                for d in s:
                    n = self.sym_arith(operator.mul, [n, d], e, scope) if isinstance(d, SymInt) \
                        or isinstance(n, SymInt) else n * d
                return n
            if name == "get_device":
                return -1 if t.device.type == "cpu" else t.device.index
            return getattr(t.meta, name)(*args, **kwargs)
        if name in ("backward", "register_hook", "retain_grad", "requires_grad_", "share_memory_",
                    "resize_", "set_", "storage", "untyped_storage", "__array__", "data_ptr"):
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"Tensor.{name}()", whole_stmt=True)
        if name in ("__bool__", "__int__", "__float__", "__index__"):
            self.brk(B.TENSOR_TO_PY, e, scope, detail=f"Tensor.{name}()")
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"'Tensor' object has no attribute '{name}'")
        return self.op(method, [t] + list(args), kwargs, e, scope)

    def op(self, fn, args, kwargs, e, scope):
        """Record `fn(*args, **kwargs)` on tensors into the graph. What the call writes and which
        arguments its results view come from ATen's schemas (ops/effects.py), whatever its
        spelling; a call that writes is functionalized (`functionalize`)."""
        if self.autocast and not self.abstract:
            args, kwargs = self.autocast_args(fn, args, kwargs, e, scope)
        try:
            out_meta, device, eff = self.g.evaluate(fn, args, kwargs)
            if eff is not None and eff.writes:
                return self.functionalize(fn, args, kwargs, eff, e, scope)
            r = self.g.add(fn, args, kwargs, self.user_loc(e, scope), out_meta, device)
        except MetaEvalError as err:
            if getattr(err, "not_a_tensor", False) and isinstance(fn, types.FunctionType):
                # torch's Python code answering a question (`_check_arg_device(x)`): interpreted
                return self.inline(fn, args, kwargs, e, scope)
            self.brk(B.DYNAMIC_SHAPE if err.dynamic_shape else B.UNSUPPORTED_OP, e, scope,
                     detail=_name_of(fn) if err.dynamic_shape else str(err)[:300])
        if self.abstract:
            if E.returns_sequence(fn, len(args), kwargs):
                return _AbstractSeq()
            return r
        outs = r if isinstance(r, (tuple, list)) else (r,)
        tvs = eff.tensor_vars
        for i, o in enumerate(outs):
            if not isinstance(o, TensorVar):
                continue
            if eff.returns_arg[i] is not None and o is r:
                return tvs[eff.returns_arg[i]]  # `x.float()` of a float tensor, `.contiguous()`...: x itself
            a = eff.aliases[i]
            if a is not None and args and tvs[a] is args[0]:
                o.view_of = (args[0], fn, tuple(args[1:]), dict(kwargs), i if o is not r else None)
        if not self.grad_enabled and isinstance(r, TensorVar) and any(
                isinstance(a, TensorVar) and a.meta.requires_grad for a in list(args) + list(kwargs.values())):
            # the graph runs with grad mode on: results computed under no_grad are detached
            d = self.g.call(torch.Tensor.detach, [r], {}, self.user_loc(e, scope))
            d.view_of = (r, torch.Tensor.detach, (), {}, None)
            r = d
        return r

    def functionalize(self, fn, args, kwargs, eff, e, scope):
        """A call that writes into tensor arguments, as out-of-place graph ops: each written
        argument gets its new value (`rebind` writes it back into the tensor it views and
        derives that tensor's other live views again), and the call returns what it returned
        in eager (the written argument, as it is now)."""
        tvs, loc = eff.tensor_vars, self.user_loc(e, scope)
        form = eff.functional_form()
        if any(w.metadata for w in eff.writes):  # squeeze_, t_, transpose_...: a new view
            t = tvs[eff.writes[0].arg]
            if form is None or len(eff.writes) != 1 or self.reaches_caller(t, scope):
                self.brk(B.INPLACE_VIEW, e, scope, whole_stmt=True,
                         detail=f"`{_name_of(fn)}` changes the shape of a tensor the caller holds")
            new = self.op(form[0], *self.fill_args(form, tvs), e, scope)
            self._replace(t, new, scope)
            return new
        news = {}
        if form is not None and not _has_symint([args, kwargs]):
            k = form[3]
            new = self.op(form[0], *self.fill_args(form, tvs), e, scope)
            if isinstance(new, TensorVar) and new.meta.shape == tvs[k].meta.shape:
                if not torch.can_cast(new.meta.dtype, tvs[k].meta.dtype):
                    # eager refuses (`logit_` of an int tensor): Python runs it and raises that
                    self.brk(B.UNSUPPORTED_OP, e, scope, whole_stmt=True, detail=(
                        f"result type {new.meta.dtype} can't be cast to {tvs[k].meta.dtype}"))
                if new.meta.dtype != tvs[k].meta.dtype:  # in-place results keep the tensor's dtype
                    new = self.op(torch.Tensor.to, [new, tvs[k].meta.dtype], {}, e, scope)
                news[k] = new
        fresh = []  # tensors of the result that are no argument (BatchNorm's output)
        if not news:  # any other write: the call itself, run on copies of what it writes
            written = eff.written
            out = self.g.call(E.OnCopies(fn, tuple(written)), args, kwargs, loc)
            news = dict(zip(written, out))
            fresh = list(out[len(written):])
        for k, new in news.items():
            t = tvs[k]
            if new is t:  # an identity on these values: nothing changes
                continue
            if not self.grad_enabled and t.meta.requires_grad:
                # in eager, an in-place op under no_grad keeps t's autograd history (autograd
                # does not see the change): new = t + (f(t) - t).detach()
                delta = self.g.call(operator.sub, [new, t], {}, loc)
                delta = self.g.call(torch.Tensor.detach, [delta], {}, loc)
                new = self.g.call(operator.add, [t, delta], {}, loc)
                new.meta.requires_grad_(True)
            new.node.meta["writes"] = t.node  # eager wrote t in place: autograd's version check
            self.rebind(t, new, scope, e)
        if len(fresh) != eff.returns_arg.count(None):
            self.brk(B.UNSUPPORTED_OP, e, scope, whole_stmt=True,
                     detail=f"`{_name_of(fn)}` writes into an argument and returns a new tensor")
        fresh = iter(fresh)
        results = [self.latest(tvs[k]) if k is not None else next(fresh) for k in eff.returns_arg]
        if isinstance(eff.result, torch.Tensor):
            return results[0]
        if isinstance(eff.result, (tuple, list)) and len(results) == len(eff.result):
            return type(eff.result)(results)  # a tuple, list or named tuple (torch.return_types)
        return None

    def fill_args(self, form, tvs):
        """A functional form's (args, kwargs), its argument placeholders filled with TensorVars."""
        def fill(v):
            if isinstance(v, E.Arg):
                return tvs[v.index]
            if isinstance(v, (list, tuple)):
                return type(v)(fill(x) for x in v)
            return v
        return [fill(a) for a in form[1]], {k: fill(v) for k, v in form[2].items()}

    def reaches_caller(self, t: TensorVar, scope) -> bool:
        """`t` is (a view of) a graph input: a change of its metadata would have to reach the
        caller's tensor object."""
        while t is not None:
            if t.source is not None:
                return True
            t = t.view_of[0] if t.view_of is not None else None
        return False

    def autocast_args(self, fn, args, kwargs, e, scope):
        device_type, dtype = self.autocast[-1]
        if dtype is None:
            return args, kwargs
        fp32 = C.AUTOCAST_FP32_CPU if device_type == "cpu" else C.AUTOCAST_FP32
        target = dtype if fn in C.AUTOCAST_LOWER else torch.float32 if fn in fp32 else None
        if target is None:
            return args, kwargs

        def cast(a):
            if isinstance(a, TensorVar) and a.meta is not None and a.meta.is_floating_point() \
                    and a.meta.dtype != target and a.device.type == device_type:
                return self.g.call(torch.Tensor.to, [a, target], {}, self.loc(e, scope))
            return a
        return [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}


# -- helpers --------------------------------------------------------------------------------------
from functools import partial as functools_partial  # noqa: E402

# container methods whose effect and result do not depend on the contents: a model only
# written this way needs no guard on them (a global log keeps one cache entry)
_BLIND_WRITES = {"append", "extend", "insert", "add", "update", "clear", "discard"}
_INDEXED = {"pop", "insert", "__getitem__", "__setitem__", "__delitem__"}  # list methods: arg 0
_SYM_TEXT = {operator.add: " + ", operator.sub: " - ", operator.mul: " * ",
             operator.floordiv: " // ", operator.mod: " % ", operator.neg: "-", operator.pos: "+"}
_FOLDABLE_ATOMS = (int, float, complex, bool, str, bytes, type(None), range, slice, torch.dtype,
                   torch.device, torch.memory_format, torch.layout, type, types.FunctionType,
                   types.BuiltinFunctionType, types.ModuleType, nn.Module, TensorVar, SymInt,
                   Unknown, LocalFunction, BoundUserMethod, type(Ellipsis), types.MethodType,
                   BaseException,  # an exception capture raised and a captured handler took
                   inspect.Parameter)


# values whose methods compute a new value and change nothing: called on constants, they fold
_IMMUTABLE = (str, bytes, int, float, complex, bool, tuple, frozenset, range, type(None))


def _stdlib(fn) -> bool:
    """A function of Python's standard library (its module is one of `sys.stdlib_module_names`)."""
    return (getattr(fn, "__module__", None) or "").split(".")[0] in sys.stdlib_module_names


def _user_mapping(v) -> bool:
    """An object of a user class that answers `in` itself (transformers' AttentionInterface)."""
    cls = type(v)
    return cls.__module__ not in ("builtins", "torch") and hasattr(cls, "__contains__") \
        and not isinstance(v, (TensorVar, Unknown, nn.Module))


def _foldable(v) -> bool:
    if isinstance(v, _FOLDABLE_ATOMS):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):  # torch.Size too
        return all(_foldable(x) for x in v)
    if isinstance(v, (dict, types.MappingProxyType)):
        return all(_foldable(k) and _foldable(x) for k, x in v.items())
    return type(v).__module__ in ("enum",) or isinstance(v, __import__("enum").Enum)


class _Opaque(Exception):
    pass


# raised by capture itself, not by the user's code: a captured `try` never handles them
_NOT_USER_EXCEPTIONS = (_Return, _LoopBreak, _LoopContinue, CannotCapture, BreakSignal, _Opaque,
                        MetaEvalError, NoSourceError)


class _AbstractSeq(list):
    """Abstract domain: a sequence of tensors of unknown length (e.g. `x.split(n)`)."""

    def __iter__(self):
        return iter([TensorVar(None, None, None) for _ in range(8)])

    def item(self):
        return TensorVar(None, None, None)


class _TensorMethod:
    __slots__ = ("t", "name")

    def __init__(self, t, name):
        self.t, self.name = t, name


def _scatter_getitem(ev, base, view_of, new, node, scope):
    _, _, (idx,), _, _ = view_of
    return ev.op(_setitem, [base, idx, new], {}, node, scope)


def _scatter_reshape(ev, base, view_of, new, node, scope):
    return ev.op(torch.Tensor.reshape, [new, tuple(ev.sizes(base))], {}, node, scope)  # dynamic sizes stay symbolic


def _scatter_transpose(ev, base, view_of, new, node, scope):
    _, fn, args, kwargs, _ = view_of
    return ev.op(fn, [new, *args], kwargs, node, scope)  # its own inverse


def _scatter_permute(ev, base, view_of, new, node, scope):
    dims = view_of[2][0] if len(view_of[2]) == 1 and isinstance(view_of[2][0], (list, tuple)) \
        else view_of[2]
    dims = [d % base.meta.dim() for d in dims]
    inverse = sorted(range(len(dims)), key=lambda k: dims[k])
    return ev.op(torch.Tensor.permute, [new, inverse], {}, node, scope)


# how an in-place write through a view reaches its base (other views: a graph break)
_SCATTER = {
    operator.getitem: _scatter_getitem,
    **{f: _scatter_reshape for f in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                                     torch.Tensor.flatten, torch.flatten, torch.Tensor.squeeze,
                                     torch.squeeze, torch.Tensor.unsqueeze, torch.unsqueeze,
                                     torch.Tensor.view_as, torch.Tensor.unflatten)},
    **{f: _scatter_transpose for f in (torch.Tensor.transpose, torch.transpose, torch.Tensor.t,
                                       torch.t)},
    torch.Tensor.permute: _scatter_permute, torch.permute: _scatter_permute,
}


def _setitem(x, idx, v):
    """Functional `x[idx] = v` (capture functionalizes in-place writes)."""
    out = x.clone()
    out[idx] = v
    return out


def _same_layout(a, b) -> bool:
    return a.dtype == b.dtype and tuple(a.size()) == tuple(b.size()) and a.stride() == b.stride() \
        and a.storage_offset() == b.storage_offset()


def _dense(t) -> bool:
    """Non-overlapping and dense: its elements fill storage[offset : offset + numel]."""
    dims = sorted((st, n) for n, st in zip(t.size(), t.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _name_of(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or str(fn)


def _has_symint(v) -> bool:
    return any(isinstance(x, SymInt) for x in leaves(v))


def _replace_in(d, old, new):
    for k, v in list(d.items()):
        if v is old:
            d[k] = new
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if x is old:
                    v[i] = new
        elif isinstance(v, tuple) and any(x is old for x in v):
            d[k] = tuple(new if x is old else x for x in v)
        elif isinstance(v, dict):
            _replace_in(v, old, new)


def _join(frames):
    """Abstract domain: variables after two arms of a branch."""
    out = {}
    keys = set().union(*[f.keys() for f in frames])
    for k in keys:
        vals = [f.get(k, UNKNOWN) for f in frames]
        if all(v is vals[0] for v in vals):
            out[k] = vals[0]
        elif any(isinstance(v, TensorVar) for v in vals):
            out[k] = next(v for v in vals if isinstance(v, TensorVar))
        else:
            out[k] = UNKNOWN
    return out


def _short(node, limit=60) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _as_load(target):
    t = copy.copy(target)
    t.ctx = ast.Load()
    return t


def _assigned_names(s) -> set:
    names = set()
    for n in ast.walk(s):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
    return names


def _has_loop_jump(body) -> bool:
    for s in body:
        for n in _walk_no_loops(s):
            if isinstance(n, (ast.Break, ast.Continue)):
                return True
    return False


def _walk_no_loops(node):
    yield node
    for c in ast.iter_child_nodes(node):
        if isinstance(c, (ast.For, ast.While, ast.FunctionDef, ast.Lambda)):
            continue
        yield from _walk_no_loops(c)


# builtins with tensor-aware behaviour
def _b_len(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.meta is None:
            return UNKNOWN
        return ev.sizes(v)[0]
    if isinstance(v, (Unknown, _AbstractSeq)):
        return UNKNOWN
    ev.effects.observe_len(v)
    return len(v)


def _b_range(ev, args, kwargs, e, scope):
    if any(isinstance(a, Unknown) for a in args):
        return UNKNOWN
    if any(isinstance(a, TensorVar) for a in args):
        ev.brk(B.TENSOR_TO_PY, e, scope, detail="range() of a tensor")
    return range(*[ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args])


def _b_getattr(ev, args, kwargs, e, scope):
    obj, name = args[0], args[1]
    try:
        return ev.getattr(obj, name, e, scope)
    except AttributeError:
        if len(args) > 2:
            return args[2]
        raise


def _b_hasattr(ev, args, kwargs, e, scope):
    obj, name = args
    if isinstance(obj, Unknown):
        return UNKNOWN
    if isinstance(obj, TensorVar):
        return hasattr(torch.Tensor, name) or name in C.META_ATTRS
    return ev.effects.getattr(obj, name)[0] or hasattr(obj, name)


def _b_minmax(fn):
    def h(ev, args, kwargs, e, scope):
        items = ev.iterate(args[0], e, scope) if len(args) == 1 else list(args)
        if any(isinstance(a, TensorVar) for a in items):
            ev.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() compares tensors in Python")
        if any(isinstance(a, Unknown) for a in items):
            return UNKNOWN
        items = [ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in items]
        return fn(items, **kwargs)
    return h


def _b_type(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.source is not None and not ev.abstract:
            return type(ev.sources.resolve(v.source))
        return torch.Tensor
    if isinstance(v, Unknown):
        return UNKNOWN
    return type(v)


def _b_super(ev, args, kwargs, e, scope):
    """`super()` in an inlined method: the class from its `__class__` cell, the instance from its
    first parameter (what Python's zero-argument form reads from the frame)."""
    if not args:
        fs = scope.fs
        params = fs.params.posonlyargs + fs.params.args
        if "__class__" not in fs.closure or not params:
            ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() outside a method")
        args = [fs.closure["__class__"], scope.vars.get(params[0].arg)]
    if any(isinstance(a, (TensorVar, Unknown)) for a in args):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() of a tensor")
    return super(*args)


def _b_iter_next(ev, args, kwargs, e, scope):
    ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="iter()/next()")


_BUILTIN_HANDLERS = {len: _b_len, range: _b_range, getattr: _b_getattr, hasattr: _b_hasattr,
                     min: _b_minmax(min), max: _b_minmax(max), type: _b_type, super: _b_super,
                     next: _b_iter_next}
