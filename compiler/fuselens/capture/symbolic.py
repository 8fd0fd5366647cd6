"""Symbolic sizes of the graph's intermediates, where some inputs have dynamic dims.

An intermediate's meta tensor holds the sizes of this call's inputs. To tell which of its sizes
follow a dynamic dim, and how, the graph built so far is run again on fake tensors whose dynamic
dims are symbols (torch's ShapeEnv, as Dynamo does), one node at a time and only as far as a size
read needs it: each size is then a sympy expression over the inputs' dynamic dims. A size that
depends on none is a constant; one that does is a `SymInt` whose graph node reads the
intermediate's size (`sym_size`) and whose expression, over the sources of those dims, is what a
guard checks when Python code decides something on it.

The shape rules the fake run went through assumed relations between the symbols (a dim is not 1,
two dims that broadcast are equal, a slice's end lies inside the dim): `guards` gives them, and
capture guards them, so that every expression holds wherever the entry is used. Anything the fake
run cannot do (an op without a symbolic shape rule, an expression no guard can spell) leaves the
size to the caller's fallback, which pins the dynamic dims to this call's sizes."""
from __future__ import annotations

import logging
import os

import sympy
import torch
import torch.fx as fx

from .values import leaves

_FAILED = object()
_log = logging.getLogger("fuselens.capture")


class SymbolicShapes:
    """The fake run of one graph (`builder`) whose inputs have the dynamic dims `dynamic`
    (source -> dims). torch's fake tensors and ShapeEnv are imported when one is made: only a
    capture with dynamic dims does."""

    def __init__(self, builder, dynamic: dict):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        self.g, self.dynamic = builder, dynamic
        # each dim its own symbol (no duck sizing: a symbol is one source), and sizes 0 and 1 are
        # not special (a dynamic dim seen at 1 stays a symbol; the rules' `!= 1` are guarded)
        self.shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
        self.env: dict[fx.Node, object] = {}
        self.names: dict[sympy.Symbol, str] = {}  # symbol -> the source of its dim (`x.shape[1]`)
        self.made_by: list[fx.Node] = []  # the node whose shape rule made each of shape_env.guards
        self.loose = False  # an input with dynamic dims is not contiguous (`strides`)

    # -- the fake run -----------------------------------------------------------------------
    def value(self, node: fx.Node):
        """`node`'s fake value (_FAILED where the fake run could not make it)."""
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self.env:
                stack.pop()
                continue
            todo = [a for a in n.all_input_nodes if a not in self.env]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            before = len(self.shape_env.guards)
            self.env[n] = self._run(n)
            self.made_by.extend([n] * (len(self.shape_env.guards) - before))
        return self.env[node]

    def _run(self, n: fx.Node):
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: self.env[a])
        if any(v is _FAILED for v in leaves(args)):
            return _FAILED
        if n.op == "placeholder":
            with self.mode:
                return self._placeholder(n)
        if n.op == "get_attr":
            return self.g.constants[n.target]
        if n.op != "call_function":
            return _FAILED
        # under the Python dispatcher, as Dynamo's fake runs are: composite ops whose C++ bodies
        # read sizes as ints (torch 2.11's matmul: numel() of a 3-D tensor by a 2-D one, int()
        # of a batched product's sizes, which pins a dynamic length to the size seen) run their
        # Python bodies over SymInts
        from torch._dispatch.python import enable_python_dispatcher
        try:
            with enable_python_dispatcher(), self.mode:
                return n.target(*args[0], **args[1])
        except Exception as exc:  # noqa: BLE001 - no symbolic rule: the caller pins the sizes instead
            _log.debug("no symbolic sizes past %s: %r", n.format_node(), exc)
            return _FAILED

    def _placeholder(self, n: fx.Node):
        from torch._dynamo.source import ConstantSource  # (imported by capture's meta runs already)
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
        src = n.meta["source"]
        # the input itself, on its device: a fake of the meta stand-in would be on `meta`, and not
        # mix with the tensors the graph makes on the input's device
        obj = self.g.input_object(src)
        dims = self.dynamic.get(src, ())
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided:
            return _FAILED
        if not dims:  # (its layout is all the fake run needs: made, not converted, ~5x faster)
            return torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=obj.device)
        self.loose |= not obj.is_contiguous()
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                                                      for d in range(obj.dim())])
        fake = self.mode.from_tensor(obj, symbolic_context=ctx, source=ConstantSource(src))
        for d in dims:
            if d < obj.dim():
                s = fake.shape[d]
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    self.names[s.node.expr] = f"{src}.shape[{d}]"
        return fake

    # -- what capture asks ------------------------------------------------------------------
    def sizes(self, node: fx.Node, hints) -> list | None:
        """Each size of the tensor `node` computes: an int where it depends on no dynamic dim,
        else (sympy expression, its guard text or None); None where the fake run failed or
        disagrees with the meta run's `hints`."""
        fake = self.value(node)
        return self._exprs(fake.shape, hints) if isinstance(fake, torch.Tensor) else None

    def strides(self, node: fx.Node, hints) -> list | None:
        """`sizes`, of the strides. None too where an input with dynamic dims is not contiguous:
        its guard checks that alone, so its strides, and those of what is made from it, are no
        expression of its sizes."""
        fake = self.value(node)
        return self._exprs(fake.stride(), hints) if isinstance(fake, torch.Tensor) and not self.loose else None

    def _exprs(self, values, hints) -> list | None:
        if len(values) != len(hints):
            return None
        out = []
        for s, hint in zip(values, hints):
            expr = self.shape_env.replace(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(s)
            if not expr.free_symbols:
                if int(expr) != hint:
                    return None
                out.append(hint)
                continue
            if _hint(self.shape_env, expr) != hint:
                return None
            out.append((expr, self.text(expr)))
        return out

    def text(self, expr) -> str | None:
        """`expr` as Python over the dims' sources, or None where it holds what no guard spells."""
        if not all(isinstance(a, _SPELLED) or a.func in _FUNCTIONS for a in sympy.preorder_traversal(expr)):
            return None
        if any(s not in self.names for s in expr.free_symbols):
            return None
        return _print(expr, self.names)

    def guards(self) -> list[tuple[str, str]]:
        """(condition, reason) of each relation the fake run's shape rules assumed; a condition no
        guard spells is None (the caller pins the dynamic dims instead)."""
        out = []
        for g, n in zip(self.shape_env.guards, self.made_by):
            expr = self.shape_env.simplify(g.expr)
            if expr == sympy.true:
                continue
            loc = n.meta.get("loc")
            at = f" at {os.path.basename(loc[0])}:{loc[1]}" if loc else ""
            name = getattr(n.target, "__name__", None) or str(n.target)
            out.append((self.text(expr), f"assumed by the shape rule of {name}{at}"))
        # what a rule found a dim equal to (a length specialised to this call's, one input's dim made
        # another's): the ShapeEnv's replacements, which also make the guard that found them
        # simplify to true above
        for sym, value in self.shape_env.replacements.items():
            if sym in self.names and value != sym:
                out.append((self.text(sympy.Eq(sym, value)), f"a shape rule made {self.names[sym]} equal to {value}"))
        return out


_SPELLED = (sympy.Symbol, sympy.Integer, sympy.logic.boolalg.BooleanAtom)


def _functions():
    from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod
    return {sympy.Add: None, sympy.Mul: None, FloorDiv: "//", Mod: "%", PythonMod: "%", Min: "min", Max: "max",
            sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">=",
            sympy.And: "and", sympy.Or: "or", sympy.Not: "not"}


_FUNCTIONS = _functions()


def _hint(shape_env, expr) -> int:
    """`expr`'s value at the sizes the fake run was made with, adding no guard: torch 2.13 names it
    guarding_hint_or_throw (size_hint deprecated), torch 2.11 (the GPU machine's) has size_hint only."""
    hint = getattr(shape_env, "guarding_hint_or_throw", None)
    return hint(expr) if hint is not None else shape_env.size_hint(expr)


def _print(e, names) -> str:
    """Python text of `e` (made of `_FUNCTIONS` only: a Pow, a Rational, a float are refused by
    `text`): each symbol its source, every operation parenthesized (no precedence to get wrong)."""
    if isinstance(e, sympy.Symbol):
        return names[e]
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, sympy.logic.boolalg.BooleanAtom):
        return str(bool(e))
    parts = [_print(a, names) for a in e.args]
    op = _FUNCTIONS[e.func]
    if e.func is sympy.Add:
        return "(" + " + ".join(parts) + ")"
    if e.func is sympy.Mul:
        return "(" + " * ".join(parts) + ")"
    if op in ("min", "max"):
        return f"{op}({', '.join(parts)})"
    if op == "not":
        return f"(not {parts[0]})"
    return "(" + f" {op} ".join(parts) + ")"
