"""Expressions: `eval` dispatches to `_ex_<Kind>`; names, operators, comparisons,
comprehensions, truth and iteration, and symbolic sizes (SymInt arithmetic, guards when a
dynamic size is used as a Python value)."""
from __future__ import annotations

import ast
import builtins
import enum
import functools
import operator
import os
import types

import torch
import torch.nn as nn

from . import breaks as B
from . import calls as C
from . import environ
from .guards import is_literal
from .side_effects import MUTABLE
from .values import NUMPY_SCALARS

# globals whose guards cover what capture reads of them (values, identities, a graph's inputs);
# one of another type is guarded by its type alone: Evaluator.process_reads
_GUARDED = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset, slice, range, type,
            types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType, enum.Enum,
            functools.partial, torch.dtype, torch.device, torch.Tensor, nn.Module, *NUMPY_SCALARS)
from .values import (UNKNOWN, ForeignData, GeneratorItems, LocalFunction, SymInt, SymShape, TensorVar,
                     Unknown, contains_tensor)
from .frames import AbstractKwargs, AbstractSeq, BreakSignal, Opaque, Scope, Suspend
from .objects import user_mapping


class Expressions:
    """Mixin of `Evaluator` (evaluator.py)."""

    # ===================================================================== expressions
    def eval(self, e, scope):
        m = getattr(self, "_ex_" + type(e).__name__, None)
        if m is None:
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"`{type(e).__name__}` expression")
        v = self.tensor_writes.latest(m(e, scope))
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
        if not isinstance(v, _GUARDED) and type(v) not in MUTABLE:  # guarded by its type alone (a
            self.process_reads.setdefault((scope.fs.globals.get("__name__"), name), v)  # registry)
        return self.wrap_external(v, self.domain.global_source(scope.fs.globals, name, v))

    def wrap_external(self, v, src):
        """A value from outside the frame (argument, global, attribute, closure): tensors
        become graph inputs; lists, dicts and sets are modelled (side_effects.py), their items
        wrapped; tuples are wrapped item by item."""
        if isinstance(v, torch.Tensor):
            return self.input(v, src)
        if type(v) in MUTABLE:
            return self.domain.external(self, v, src)
        if type(v) is tuple or isinstance(v, tuple) and (hasattr(v, "_fields") or hasattr(type(v), "n_fields")):
            out = [self.wrap_external(x, None if src is None else f"{src}[{i}]") for i, x in enumerate(v)]
            if all(a is b for a, b in zip(out, v)):
                return v
            # a named tuple or a structseq (torch.return_types.sort) keeps its type: `.values`
            return tuple(out) if type(v) is tuple else type(v)(*out) if hasattr(v, "_fields") else type(v)(out)
        if src is not None and not isinstance(v, (int, float, str, bool, type(None), *NUMPY_SCALARS)):
            self.value_sources.set(v, src)
        return v

    def _ex_Attribute(self, e, scope):
        obj = self.eval(e.value, scope)
        return self.getattr(obj, e.attr, e, scope)

    def _ex_Subscript(self, e, scope):
        obj = self.eval(e.value, scope)
        idx = self.eval(e.slice, scope)
        return self.getitem(obj, idx, e, scope)

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
        if isinstance(v, TensorVar) and not v.assumed:
            self.brk(B.TENSOR_TO_PY, e, scope, detail="formatting a tensor into a string")
        if isinstance(v, (Unknown, TensorVar)):
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
        for i, x in enumerate(e.values):
            v = self.eval(x, scope)
            if i == len(e.values) - 1:
                return v  # Python returns the last operand as is: its truth is not asked
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
            self.domain.torch_receives([a, b])
            return self.op(fn, [a, b], {}, e, scope)
        if isinstance(a, (Unknown, AbstractSeq)) or isinstance(b, (Unknown, AbstractSeq)):
            return ForeignData.merge(a, b) or UNKNOWN
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
            elif isinstance(left, (Unknown, AbstractSeq)) or isinstance(right, (Unknown, AbstractSeq)):
                r = UNKNOWN
            elif isinstance(left, SymInt) or isinstance(right, SymInt):
                r = self.sym_compare(fn, left, right, e, scope)
            elif (isinstance(left, SymShape) or isinstance(right, SymShape)) and op in ("Eq", "NotEq") \
                    and isinstance(left, tuple) and isinstance(right, tuple):
                r = self.sizes_equal(left, right, e, scope) is (op == "Eq")
            elif isinstance(left, SymShape) or isinstance(right, SymShape):
                # SymInts compare by identity: compare the exact sizes (guarded) instead
                spec = lambda v: tuple(self.specialize(d, e, scope) if isinstance(d, SymInt) else d  # noqa: E731
                                       for d in v) if isinstance(v, tuple) else v
                r = fn(spec(left), spec(right))
            elif op in ("In", "NotIn") and isinstance(right, environ.ENVIRONMENTS):
                found = environ.read(self, right, "__contains__", [left], {}, e, scope)
                r = found if isinstance(found, Unknown) else found is (op == "In")
            else:
                # `k in d` reads d's keys alone (`"output_attentions" in kwargs`); on an object
                # of a user class, its own `__contains__` answers (as its `__getitem__` does)
                member = op in ("In", "NotIn")
                keys = list(right) if member and isinstance(right, dict) else right
                self.require_foldable([left] if member and user_mapping(right) else [left, keys], e, scope)
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
            items = self.iterate(self.eval(g.iter, inner), g.iter, inner)
            if isinstance(items, AbstractSeq):  # abstract: unknown length, analysed once
                self.assign(g.target, items.item(), inner)
                make(inner)
                raise Opaque()
            for item in items:
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
        except Opaque:
            return UNKNOWN
        except BreakSignal as b:
            # a comprehension cannot be resumed halfway: a resume would compute the rest of it
            # with the breaking call's one result in every element. Python runs the statement,
            # the calls that led to the break compiled on their own
            raise b.in_python(scope) from None
        return out

    def _ex_ListComp(self, e, scope):
        return self._comprehension(e, scope, lambda s: self.eval(e.elt, s))

    def _ex_GeneratorExp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: self.eval(e.elt, s))
        return r if isinstance(r, Unknown) else GeneratorItems(r)

    def _ex_SetComp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: self.eval(e.elt, s))
        return r if isinstance(r, Unknown) else set(r)

    def _ex_DictComp(self, e, scope):
        r = self._comprehension(e, scope, lambda s: (self.eval(e.key, s), self.eval(e.value, s)))
        return r if isinstance(r, Unknown) else dict(r)

    def _ex_Yield(self, e, scope):
        v = None if e.value is None else self.eval(e.value, scope)
        if scope.suspends:
            _, _, stmts, idx, _ = scope.levels[-1]
            st = stmts[idx]
            if not isinstance(st, (ast.Expr, ast.Assign)) or st.value is not e:  # `f((yield))`
                self.brk(B.UNSUPPORTED_EXPR, e, scope, detail="`yield` inside an expression")
            raise Suspend(v, [list(l) for l in scope.levels])
        if scope.yields is not None:  # (the editor's walk of a generator's body collects nothing)
            scope.yields.append(v)
        return None  # what `send` would pass in: the generator runs to its end, nothing is sent

    def _ex_YieldFrom(self, e, scope):
        items = self.iterate(self.eval(e.value, scope), e, scope)
        if scope.yields is not None:
            scope.yields.extend(items)
        return None

    def _ex_Starred(self, e, scope):
        return self.eval(e.value, scope)

    # ===================================================================== calls
    def _ex_Call(self, e, scope):
        fn = self.eval(e.func, scope)
        args = []
        for a in e.args:
            if isinstance(a, ast.Starred):
                items = self.iterate(self.eval(a.value, scope), a, scope)
                if isinstance(items, AbstractSeq):  # abstract: how many arguments is unknown
                    return UNKNOWN
                args.extend(items)
            else:
                args.append(self.eval(a, scope))
        kwargs = {}
        for k in e.keywords:
            v = self.eval(k.value, scope)
            if k.arg is None:
                if isinstance(v, Unknown):  # abstract: the call is analysed with what is known
                    kwargs = AbstractKwargs(kwargs)
                    continue
                kwargs.update(self.observed(v))
            else:
                kwargs[k.arg] = v
        return self.call(fn, args, kwargs, e, scope)

    # ===================================================================== truth, iteration
    def observed(self, v):
        """`v`, whose contents the capture reads (guarded if it is a model: side_effects.py)."""
        self.effects.observe(v)
        return v

    # ===================================================================== symbolic ints
    def specialize(self, s: SymInt, node, scope):
        """A dynamic size used as a Python value: guard on its exact value (where no expression
        spells it, on the sizes of the inputs' dynamic dims it comes from)."""
        if s.expr is None:
            self.pin_dynamic(f"a size of no expression used as a Python value{_at(node, scope)}")
        else:
            self.domain.guard(f"{s.expr} == {s.hint}", f"{s.expr} (used as a Python value{_at(node, scope)})")
        return s.hint

    def sym_arith(self, fn, args, e, scope):
        hints = [a.hint if isinstance(a, SymInt) else a for a in args]
        if not all(type(h) in (int, bool) for h in hints) or fn is operator.truediv:  # (written as literals)
            return fn(*[self.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args])
        hint = fn(*hints)
        sym = _SYM_TEXT.get(fn)
        exprs = [a.expr if isinstance(a, SymInt) else repr(a) for a in args]
        expr = None if None in exprs else f"({sym.join(exprs)})" if len(args) == 2 else f"({sym}{exprs[0]})"
        return SymInt(hint, expr, lambda: self.g.sym_node(fn, args, hint))

    def sizes_equal(self, a: tuple, b: tuple, e, scope) -> bool:
        """`a == b` of shapes, as Python compares tuples: item by item up to the first that
        differs, each a relation guarded (`x.shape == y.shape`: their dims equal, not their values)."""
        if len(a) != len(b):
            return False
        for x, y in zip(a, b):
            same = self.sym_compare(operator.eq, x, y, e, scope) if isinstance(x, SymInt) or isinstance(y, SymInt) \
                else x == y
            if not same:
                return False
        return True

    def sym_compare(self, fn, a, b, e, scope):
        ha = a.hint if isinstance(a, SymInt) else a
        hb = b.hint if isinstance(b, SymInt) else b
        r = fn(ha, hb)
        text = {operator.eq: "==", operator.ne: "!=", operator.lt: "<", operator.le: "<=",
                operator.gt: ">", operator.ge: ">="}.get(fn)
        if text is None or not all(isinstance(v, SymInt) and v.expr is not None or is_literal(v) for v in (a, b)):
            # (a NumPy integer has no literal: `np.int64(4)` is no name the guard function has)
            return fn(self.specialize(a, e, scope) if isinstance(a, SymInt) else a,
                      self.specialize(b, e, scope) if isinstance(b, SymInt) else b)
        ea = a.expr if isinstance(a, SymInt) else repr(a)
        eb = b.expr if isinstance(b, SymInt) else repr(b)
        self.domain.guard(f"({ea} {text} {eb}) is {r}", f"{ea} {text} {eb}{_at(e, scope, ': decided')}")
        return r


def _at(node, scope, prefix="") -> str:
    """Where the user's code decides on a size (a guard's reason names it): ` at file.py:93`."""
    line = getattr(node, "lineno", None)
    return f"{prefix} at {os.path.basename(scope.fs.filename)}:{line}" if line is not None and scope is not None else ""


_SYM_TEXT = {operator.add: " + ", operator.sub: " - ", operator.mul: " * ",
             operator.floordiv: " // ", operator.mod: " % ", operator.neg: "-", operator.pos: "+"}
