"""Statements: the evaluator walks a function body statement by statement (`exec_stmt`), each
handled by `_stmt_<Kind>`. A graph break inside a statement rolls back its graph work when the
whole statement must run in Python (`_mark`/`_rollback`)."""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import sys
import types

import torch

from . import breaks as B
from . import calls as C
from .graph import MetaEvalError
from .source import NoSourceError, function_source
from .values import UNKNOWN, LocalFunction, SymInt, TensorVar, Unknown
from .frames import (AbstractSeq, BreakSignal, CannotCapture, FrameAtBreak, LoopBreak, LoopContinue,
                     Opaque, PathEnd, Return, Suspend, has_loop_jump)
from .resume import continuation
from .tensors import functional_setitem


class Statements:
    """Mixin of `Evaluator` (evaluator.py)."""

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
                                             call=b.pending_call, constructed=b.pending_constructed))
                b.pending_call = b.pending_constructed = None
            raise
        except NOT_USER_EXCEPTIONS:
            raise
        except Exception:
            if not self.abstract:
                raise
            # the editor's walk: an error here comes from values it does not know (a config's,
            # a library's); what the statement assigns is unknown, the walk goes on
            for name in _assigned_names(s):
                scope.vars[name] = UNKNOWN

    def _abstract_continue(self, b: BreakSignal, s, scope):
        """Abstract domain: report the break; names the statement assigns become unknown."""
        self.domain.on_break(b.brk)
        if isinstance(s, (ast.If, ast.While)) and b.cond is not None:
            # both arms (and the loop body) are analysed like any code
            self._exec_abstract_arms(s, scope, dict(scope.vars))
            return
        for name in _assigned_names(s):
            scope.vars[name] = UNKNOWN

    def _exec_abstract_arms(self, s, scope, saved):
        arms = [s.body, s.orelse] if isinstance(s, ast.If) else [s.body, []]
        results = []
        self.domain.uncertain.append(scope.fs.filename)
        try:
            for arm in arms:
                scope.vars = dict(saved)
                try:
                    self.exec_block(arm, scope, ("if", s))
                except PathEnd:
                    continue  # an arm that raises adds nothing to what follows
                except (Return, LoopBreak, LoopContinue):
                    pass
                results.append(scope.vars)
        finally:
            self.domain.uncertain.pop()
        if not results:
            raise PathEnd()
        scope.vars = _join(results)

    def _mark(self, scope):
        last = next(iter(reversed(self.g.graph.nodes)), None)
        chain, s = [], scope  # rebind() updates the callers' variables too
        while s is not None:
            chain.append((s, dict(s.vars)))
            s = s.parent if s.parent is not None else s.enclosing
        return last, chain, self.g.n_ops, self.tensor_writes.mark(), self.effects.mark()

    def _rollback(self, scope, mark):
        last, chain, n_ops, tensor_writes, effects = mark
        self.effects.rollback(effects)  # the statement makes its own mutations in Python
        # in-place ops of the rolled-back statement did not happen (their nodes are erased)
        self.tensor_writes.rollback(tensor_writes)
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
        raise Return(None if s.value is None else self.eval(s.value, scope))

    def _stmt_Break(self, s, scope):
        raise LoopBreak()

    def _stmt_Continue(self, s, scope):
        raise LoopContinue()

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
                if t.id not in scope.vars and not self.abstract:  # (a name of the function: its local)
                    raise UnboundLocalError(f"cannot access local variable '{t.id}' where it is not "
                                            "associated with a value")
                scope.vars.pop(t.id, None)
                continue
            obj = self.eval(t.value, scope) if isinstance(t, ast.Subscript) else None
            if type(obj) in (list, dict):
                self.effects.observe(obj)
                self.effects.call(obj, "__delitem__", [self.container_key(t.slice, scope)], {})
            elif isinstance(obj, Unknown):
                pass
            elif self.effects.is_fresh(obj):
                self.call_special(obj, "__delitem__", [self.container_key(t.slice, scope)], t, scope)
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
            except LoopBreak:
                return
            except LoopContinue:
                continue
            except BreakSignal as b:
                raise self._loop_break(b, scope, s) from None
        self.brk(B.UNROLLABLE_LOOP, s, scope, detail=f"more than {MAX_UNROLL} iterations",
                 whole_stmt=True)

    def _stmt_For(self, s, scope):
        it = self.eval(s.iter, scope)
        items = self.iterate(it, s.iter, scope, whole_stmt=True)
        if isinstance(items, AbstractSeq):  # abstract: unknown length, the body analysed once
            self._abstract_loop_body(s, scope, items.item())
            return
        if len(items) > MAX_UNROLL:
            self.brk(B.UNROLLABLE_LOOP, s.iter, scope,
                     detail=f"{len(items)} iterations (limit {MAX_UNROLL})", whole_stmt=True)
        for i, item in enumerate(items):
            self.assign(s.target, self.tensor_writes.latest(item), scope)
            try:
                self.exec_block(s.body, scope, ("for", s), extra=items[i + 1:])
            except LoopBreak:
                return
            except LoopContinue:
                continue
            except BreakSignal as b:
                raise self._loop_break(b, scope, s) from None
        self.exec_block(s.orelse, scope, ("if", s))

    def _loop_break(self, b: BreakSignal, scope, loop) -> BreakSignal:
        """A break inside a loop body resumes mid-iteration (resume.py runs the rest of the
        iteration in a one-pass loop, so its `continue`/`break` keep their meaning), unless the
        statement Python runs is itself a `continue`/`break` of this loop (`if t.item(): break`):
        outside any loop, the transformed function cannot run it; then the loop runs in Python.
        A data-dependent `if` is not run by Python: each branch continues in its own resume.
        After MAX_LOOP_RESUMES resumes of one loop (a break in every iteration: BigBird's NumPy
        mask building), or in a capture MAX_RESUME_DEPTH resumes deep (loops in loops), Python
        runs the rest of it: each resume is a capture and a nested call, and hundreds had taken
        seconds and then Python's recursion limit."""
        root = scope
        while root.parent is not None:
            root = root.parent
        if not self.abstract and (getattr(loop, "_fl_resumes", 0) >= MAX_LOOP_RESUMES
                                  or root.fs.resume_depth >= MAX_RESUME_DEPTH):
            return b.in_python(scope, b.brk.replace(
                code=B.UNROLLABLE_LOOP.code, title=B.UNROLLABLE_LOOP.title,
                explanation=B.UNROLLABLE_LOOP.explanation + f" (a break in each iteration: {b.brk.title})"))
        if self.abstract or not b.frames or b.frames[-1].scope is not scope:
            return b
        stmt = b.frames[-1].stmt
        if not has_loop_jump([stmt]):
            return b
        if len(b.frames) == 1 and b.cond is not None and isinstance(stmt, ast.If) and not b.whole_stmt:
            return b
        return b.in_python(scope, b.brk.replace(
            code=B.UNROLLABLE_LOOP.code, title=B.UNROLLABLE_LOOP.title,
            explanation=B.UNROLLABLE_LOOP.explanation + f" (inside: {b.brk.title})"))

    def _stmt_Try(self, s, scope):
        """`try` is captured: an exception the evaluated code raises (a lookup on plain values,
        a user's `raise`) goes to the first handler whose type matches, `else` runs after a body
        that raised nothing, `finally` always. A graph break in the body resumes inside the
        statement (resume.py re-enters the `try`, and gives what the breaking statement raises
        to its handlers); one in a handler, `else` or `finally` makes the whole statement run in
        Python."""
        in_body = True
        try:
            try:
                self.in_try += 1
                try:
                    self.exec_block(s.body, scope, ("try", s))
                finally:
                    self.in_try -= 1
            except NOT_USER_EXCEPTIONS:
                raise
            except Exception as exc:  # noqa: BLE001 (the user's code raised it: its handlers decide)
                in_body = False
                handler = self._handler_for(s.handlers, exc, scope)
                if handler is None:
                    raise
                if handler.name:
                    scope.vars[handler.name] = exc
                self.exec_block(handler.body, scope, ("try", s))
                if handler.name:
                    scope.vars.pop(handler.name, None)  # Python unbinds it after the handler
            else:
                in_body = False
                self.exec_block(s.orelse, scope, ("try", s))
        except BreakSignal as b:
            if in_body and self._resumable_in_try(b, scope):
                raise
            raise b.in_python(scope) from None
        except Suspend:
            if not in_body:  # (a yield in a handler: the exit would not know the exception)
                self.brk(B.UNSUPPORTED_EXPR, s, scope, detail="`yield` in an exception handler")
            raise  # the rest of the `try` runs at the generator's exit (_generator_with)
        except BaseException:
            self._finally(s, scope)
            raise
        self._finally(s, scope)

    def _finally(self, s, scope):
        """A break in `finally` makes the whole `try` run in Python: a resume inside it would
        have to re-enter the `try` to run the rest of the `finally`, and break there again."""
        try:
            self.exec_block(s.finalbody, scope, ("try", s))
        except BreakSignal as b:
            raise b.in_python(scope) from None

    def _resumable_in_try(self, b: BreakSignal, scope) -> bool:
        """Whether a break in a `try` body can resume inside it: the statement Python runs at
        the break is given a handler that passes its exception on to the `try` (resume.py),
        unless it is a `return` (Python would return without the `finally`)."""
        if self.abstract or not b.frames or b.frames[-1].scope is not scope:
            return False
        return len(b.frames) > 1 or not isinstance(b.frames[0].stmt, ast.Return)

    def _stmt_Raise(self, s, scope):
        """Inside a captured `try` body, `raise` raises (a handler may take it); elsewhere the
        statement runs in Python, after the graph of what came before it."""
        if self.abstract:
            raise PathEnd()  # eager raises here too: no break, the path ends
        if not self.in_try or s.exc is None:
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

    def _stmt_With(self, s, scope):
        self._with_items(s, s.items, scope)

    def _with_items(self, s, items, scope):
        """`with a, b: body` is `with a: with b: body`. Grad mode and autocast are the
        evaluator's state; a context manager whose `__enter__`/`__exit__` are Python code
        (`contextlib.nullcontext`, a user's class) is interpreted as Python runs it."""
        if not items:
            self.exec_block(s.body, scope, ("with", s))
            return
        item = items[0]
        self.with_expr = item.context_expr
        try:
            cm = self.eval(item.context_expr, scope)
        finally:
            self.with_expr = None
        if self._made_by_contextmanager(cm):
            self._generator_with(s, items, cm, scope)
            return
        methods = _python_cm_methods(cm)
        if methods is None:
            try:
                with contextlib.ExitStack() as stack:
                    self.enter_context(cm, item, scope, stack)
                    if item.optional_vars is not None:
                        self.assign(item.optional_vars, None, scope)
                    self._with_items(s, items[1:], scope)
            except Suspend:  # grad mode set around a `yield` stays on in the caller's body
                self.brk(B.UNSUPPORTED_EXPR, item.context_expr, scope, whole_stmt=True,
                         detail="`yield` inside a grad-mode or autocast block")
            return
        self._python_with(s, items, cm, methods, scope)

    def _python_with(self, s, items, cm, methods, scope):
        """The body between `__enter__` (its result bound by `as`) and `__exit__`: with
        (None, None, None) after a normal end, with the exception the body raised otherwise
        (a true result suppresses it). Their effects are the capture's (modelled, replayed
        once). A graph break in the body, in `__enter__` or in `__exit__` makes the whole
        statement run in Python: a resume would enter the manager a second time."""
        item, (enter, exit_) = items[0], methods
        at = item.context_expr
        try:
            v = self.inline(enter, [], {}, at, scope, self_value=cm)
            if item.optional_vars is not None:
                self.assign(item.optional_vars, v, scope)
            exc = self._rest_of_with(s, items[1:], scope)
            if exc is not None:  # __exit__ decides
                if self.abstract:
                    raise exc
                suppress = self.inline(exit_, [type(exc), exc, exc.__traceback__], {}, at, scope,
                                       self_value=cm)
                if isinstance(suppress, (TensorVar, SymInt, Unknown)):
                    self.brk(B.UNSUPPORTED_STMT, at, scope, whole_stmt=True,
                             detail="`__exit__` result that is not a Python value")
                if not suppress:
                    raise exc
                return
            self.inline(exit_, [None, None, None], {}, at, scope, self_value=cm)
        except Suspend:
            self.brk(B.UNSUPPORTED_EXPR, at, scope, whole_stmt=True,
                     detail="`yield` inside a context manager written in Python")
        except BreakSignal as b:
            if self.abstract or b.whole_stmt and not b.frames:  # (an inner `with` item's already)
                raise
            if b.frames[-1].scope is scope:  # from the body: its call is compiled on its own
                raise b.in_python(scope) from None
            raise BreakSignal(b.brk, whole_stmt=True) from None  # from __enter__/__exit__

    def _rest_of_with(self, s, items, scope):
        """The rest of a `with` (its other items, then its body) with a `raise` in it captured:
        the exception the user's code raised (the manager may suppress it), or None."""
        self.in_try += 1
        try:
            self._with_items(s, items, scope)
        except NOT_USER_EXCEPTIONS:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's code raised it)
            return exc
        finally:
            self.in_try -= 1
        return None

    def _made_by_contextmanager(self, cm) -> bool:
        """A `@contextlib.contextmanager` object this call made (one from outside may have been
        entered already: its generator is not this call's to run)."""
        if self.abstract or type(cm) is not contextlib._GeneratorContextManager:
            return False
        if self.value_sources.get(cm) is not None:
            return False
        try:
            function_source(cm.func)
        except NoSourceError:
            return False
        return True

    def _generator_with(self, s, items, cm, scope):
        """`with` a `@contextlib.contextmanager` object: its generator function's body runs to
        its `yield` (what it yields bound by `as`), the `with` body, then the rest of the
        generator from the `yield` (statements after it, in its enclosing `try`/`with`/loops:
        resume.continuation), or, where the body raised, that rest with the exception raised
        at the `yield` (the generator's handlers decide; ending without raising suppresses it).
        Anything else (a second `yield`, a graph break in the generator or in the body) makes
        the whole `with` run in Python."""
        item, at = items[0], items[0].context_expr
        gen = self.inline(cm.func, list(cm.args), dict(cm.kwds), at, scope)
        fs, gscope = gen.fs_scope
        gscope.suspends = True
        try:
            try:
                self._run_body(fs, gscope)
                raise RuntimeError("generator didn't yield")  # (contextlib's error)
            except Suspend as sus:
                suspended = sus
            if item.optional_vars is not None:
                self.assign(item.optional_vars, suspended.value, scope)
            at_yield = suspended.levels[-1][2][suspended.levels[-1][3]]
            resumed = []  # `v = yield`: v is None (nothing is sent)
            if isinstance(at_yield, ast.Assign):
                resumed = [ast.copy_location(ast.Assign(targets=at_yield.targets,
                                                        value=ast.Constant(value=None)), at_yield)]
            exc = self._rest_of_with(s, items[1:], scope)
            if exc is not None:  # the generator decides
                gscope.vars["__fl_exc"] = exc
                thrown = ast.copy_location(ast.Raise(exc=ast.Name(id="__fl_exc", ctx=ast.Load()),
                                                     cause=None), at_yield)
                ast.fix_missing_locations(thrown)
                try:
                    self._generator_exit(fs, gscope, continuation(suspended.levels, False, current=[thrown]))
                except Exception as out:  # noqa: BLE001
                    if out is exc:
                        raise
                    raise out from exc
                return  # the generator ended: the exception is suppressed
            self._generator_exit(fs, gscope, continuation(suspended.levels, False, current=resumed))
        except Suspend:
            self.brk(B.UNSUPPORTED_EXPR, at, scope, whole_stmt=True,
                     detail="context manager generator that yields more than once")
        except BreakSignal as b:
            if b.whole_stmt and not b.frames:
                raise
            if b.frames[-1].scope is scope:
                raise b.in_python(scope) from None
            raise BreakSignal(b.brk, whole_stmt=True) from None

    def _generator_exit(self, fs, gscope, rest):
        for n in (x for st in rest for x in ast.walk(st)):
            if isinstance(n, ast.Name) and hasattr(n, "_fl_value"):  # a loop's rest items
                gscope.vars[n.id] = n._fl_value
        self.in_try += 1  # the exception raised at the `yield` is the generator's to handle
        try:
            self.exec_block(rest, gscope, ("body", fs.node))
        except Return:
            pass
        finally:
            self.in_try -= 1

    def _stmt_Import(self, s, scope):
        # only modules already imported: importing anew would run module code at capture time
        for a in s.names:
            root = a.name if a.asname else a.name.split(".")[0]
            mod = sys.modules.get(a.name if a.asname else root)
            if mod is None:  # (the editor: what the import finds depends on the installation)
                mod = self.domain.unknowable(self, B.UNSUPPORTED_STMT, s, scope, whole_stmt=True,
                                             detail=f"import of {a.name} (not imported yet)")
            scope.vars[a.asname or root] = mod

    def _stmt_ImportFrom(self, s, scope):
        mod = sys.modules.get(s.module or "") if s.level == 0 else None
        if mod is None:
            unknown = self.domain.unknowable(self, B.UNSUPPORTED_STMT, s, scope, whole_stmt=True,
                                             detail=f"import from {s.module}")
            for a in s.names:
                scope.vars[a.asname or a.name] = unknown
            return
        for a in s.names:
            if not hasattr(mod, a.name):
                self.brk(B.UNSUPPORTED_STMT, s, scope, detail=f"from {s.module} import {a.name}",
                         whole_stmt=True)
            scope.vars[a.asname or a.name] = getattr(mod, a.name)

    def _stmt_FunctionDef(self, s, scope):
        if s.decorator_list:
            self.brk(B.UNSUPPORTED_STMT, s, scope, detail="decorated local function", whole_stmt=True)
        scope.vars[s.name] = LocalFunction(s, scope, self._local_defaults(s.args, scope), s.name)

    def _abstract_loop_body(self, s, scope, item=None):
        """Abstract domain: a loop of unknown length (`item`: what a `for` binds), its body
        analysed once; what follows joins the states with and without it."""
        saved = dict(scope.vars)
        if not isinstance(s, ast.While):
            self.assign(s.target, item, scope)
        try:
            self.exec_block(s.body, scope, ("while" if isinstance(s, ast.While) else "for", s))
        except (LoopBreak, LoopContinue):
            pass
        except PathEnd:  # the body may not run at all
            scope.vars = saved
            return
        scope.vars = _join([saved, scope.vars])

    def _handler_for(self, handlers, exc, scope):
        for h in handlers:
            if h.type is None:
                return h
            types_ = self.eval(h.type, scope)
            if isinstance(types_, Unknown) or isinstance(exc, types_):
                return h
        return None

    def enter_context(self, cm, item, scope, stack):
        if isinstance(cm, Unknown) or self.abstract and isinstance(cm, TensorVar):
            return  # (abstract: what an unknown call made, taken for a tensor, may be anything)
        if isinstance(cm, (torch.no_grad, torch.enable_grad)) or type(cm).__name__ == "set_grad_enabled":
            prev = self.grad_enabled
            self.grad_enabled = not isinstance(cm, torch.no_grad) if not hasattr(cm, "mode") else cm.mode
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.callback(lambda: setattr(self, "grad_enabled", prev))
            return
        if isinstance(cm, torch.autocast):
            self.autocast.append((cm.device, cm._enabled, cm.fast_dtype))
            stack.callback(self.autocast.pop)
            return
        self.brk(B.UNSUPPORTED_STMT, item.context_expr, scope,
                 detail=f"context manager {type(cm).__name__}", whole_stmt=True)

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
            if isinstance(items, AbstractSeq):  # abstract: unknown length, an item for each target
                for e in target.elts:
                    starred = isinstance(e, ast.Starred)
                    self.assign(e.value if starred else e, items if starred else items.item(), scope)
                return
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
                if len(items) != len(target.elts) and not isinstance(items, AbstractSeq):
                    raise ValueError(f"cannot unpack {len(items)} values into {len(target.elts)}")
                for e, x in zip(target.elts, items):
                    self.assign(e, x, scope)
        elif isinstance(target, ast.Subscript):
            obj = self.eval(target.value, scope)
            idx = self.eval(target.slice, scope)
            if isinstance(obj, TensorVar):
                new = self.op(functional_setitem, [obj, idx, v], {}, target, scope)
                self.rebind(obj, new, scope, target)
            elif type(obj) in (list, dict):
                idx = self.specialize(idx, target, scope) if isinstance(idx, SymInt) else idx
                if isinstance(obj, list):  # the index must be in range on the next call too
                    self.effects.observe(obj)
                self.effects.call(obj, "__setitem__", [idx, v], {})
            elif isinstance(obj, Unknown):
                pass
            elif self.effects.is_fresh(obj):
                self.call_special(obj, "__setitem__", [idx, v], target, scope)
            else:
                self.brk(B.UNSUPPORTED_STMT, target, scope,
                         detail=f"item assignment on {type(obj).__name__}", whole_stmt=True)
        elif isinstance(target, ast.Attribute):
            obj = self.eval(target.value, scope)
            if isinstance(obj, Unknown):
                return
            self.assign_attribute(obj, target.attr, v, target, scope)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, v, scope)
        else:
            self.brk(B.UNSUPPORTED_STMT, target, scope, whole_stmt=True)

    def container_key(self, e, scope):
        k = self.eval(e, scope)
        return self.specialize(k, e, scope) if isinstance(k, SymInt) else k


MAX_UNROLL = 512
MAX_LOOP_RESUMES = 8  # resumes of one loop's iterations before Python runs the rest (_loop_break)
MAX_RESUME_DEPTH = 32  # resumes in a chain before a loop with a break runs in Python (_loop_break)


# raised by capture itself, not by the user's code: a captured `try` never handles them
NOT_USER_EXCEPTIONS = (Return, LoopBreak, LoopContinue, CannotCapture, BreakSignal, Opaque,
                        MetaEvalError, NoSourceError, PathEnd, Suspend)


def _python_cm_methods(cm):
    """(`__enter__`, `__exit__`) of a context manager whose class defines both in Python with
    source (what the evaluator can interpret), else None."""
    enter = inspect.getattr_static(type(cm), "__enter__", None)
    exit_ = inspect.getattr_static(type(cm), "__exit__", None)
    # torch's own (grad mode, autocast) are enter_context's; a generator's cannot be
    # interpreted (its code after `yield` runs at exit)
    if isinstance(enter, types.FunctionType) and isinstance(exit_, types.FunctionType) \
            and not type(cm).__module__.startswith("torch") \
            and not isinstance(cm, contextlib._GeneratorContextManagerBase):
        return enter, exit_
    return None


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
