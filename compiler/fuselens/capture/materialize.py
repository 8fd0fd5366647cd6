"""Python expressions for the values a graph break leaves live: what the transformed function,
break helpers and resume functions are given (graph outputs, sources, containers and objects the
captured code made, views made again from their bases)."""
from __future__ import annotations

import ast
import operator
import re

import torch

from ..ops import effects as E
from . import side_effects as S
from .guards import is_literal
from .source import copy_ast, function_with_source
from .values import GeneratorCall, GeneratorItems, LocalFunction, SymInt, SymShape, TensorVar, ValueSources


class CannotResume(Exception):
    """A live value has no Python form (e.g. a local function): the whole function must run
    eagerly."""


class Materializer:
    """Python expressions for values in the transformed function's scope; tensors that are
    not graph inputs become graph outputs, modelled containers (side_effects.py) their real
    objects. Where mutations are replayed, the real objects are found by their sources at
    entry (`refs`): a replayed `xs.pop(0)` must not change what `xs[1]` names."""

    def __init__(self, sources, mutated: dict, effects=None, latest=lambda v: v, value_sources=None):
        self.sources = sources
        # id(object) -> where this call finds it (an argument, `self.config`...): an object
        # guarded by its type alone is named by its source, never frozen into a constant
        self.value_sources = value_sources if value_sources is not None else ValueSources()
        self.outputs: list[TensorVar] = []
        self._out_index: dict[int, int] = {}
        self._mutated = mutated
        self.effects = effects
        self.latest = latest             # a tensor's value after in-place ops on it
        self.refs: dict[str, str] = {}   # source -> name bound at entry
        # the function's own lists, dicts and sets, one name each: Python code (a replayed
        # `log.append(items)`, a resume) gets the very object, as in eager
        self.prelude: list[str] = []
        self._own: dict[int, tuple] = {}
        self._n_own = 0
        self._replays = None

    def source(self, src: str) -> str:
        if self._replays is None:  # materializing starts once capture has ended
            self._replays = self.effects.replays() if self.effects is not None else []
        if src.isidentifier() or not self._replays:
            return src
        name = self.refs.get(src)
        if name is None:
            name = self.refs[src] = f"__fl_r{len(self.refs)}"
        return name

    def entry_lines(self) -> list[str]:
        """Binds the sources of `refs` (the first lines of the transformed function)."""
        if not self.refs:
            return []
        return [f"{', '.join(self.refs.values())} = {', '.join(self.refs)}"]

    def replay_lines(self) -> list[str]:
        """The logged mutations of modelled containers, made on the real objects."""
        return [line for part in self.replay_parts() for line in part]

    def replay_parts(self) -> tuple[list[str], list[str]]:
        """The replayed mutations as (before the graph call, after it): those that come first
        and need nothing the graph or the code after it makes are made before the graph runs,
        as in eager (where the graph raises, eager had made them already)."""
        lines = self._replay()
        made_later = ["__fl_o"] + [p.split(" = ", 1)[0] for p in self.prelude]
        k = 0
        while k < len(lines) and not any(re.search(rf"\b{re.escape(n)}\b", lines[k]) for n in made_later):
            k += 1
        return lines[:k], lines[k:]

    def _replay(self) -> list[str]:
        out = []
        for m in (self.effects.replays() if self.effects is not None else []):
            target = self.expr(m.obj)
            args = [self.expr(a) for a in m.args] + [f"{k}={self.expr(a)}" for k, a in m.kwargs.items()]
            if m.name == "__setattr__":
                out.append(f"{target}.{m.args[0]} = {args[1]}")
            elif m.name == "__setitem__":
                out.append(f"{target}[{args[0]}] = {args[1]}")
            elif m.name == "__delitem__":
                out.append(f"del {target}[{args[0]}]")
            else:
                out.append(f"{target}.{m.name}({', '.join(args)})")
        return out

    @property
    def input_src(self):  # looked up late: inputs are mutated after the Materializer is made
        return {id(v): k for k, v in self._mutated.items()}

    def _output(self, v) -> str:
        """`v` (a TensorVar, a SymInt) returned by the graph."""
        i = self._out_index.get(id(v))
        if i is None:
            i = self._out_index[id(v)] = len(self.outputs)
            self.outputs.append(v)
        return f"__fl_o[{i}]"

    def expr(self, v, exact=False) -> str:
        """`exact`: `v` itself, not its value after later in-place ops (the value a metadata write
        replaced, as the base of the view it made: `y.t_()` is y's old value transposed)."""
        if isinstance(v, TensorVar):
            v = v if exact else self.latest(v)
            if id(v) in self.input_src:  # a mutated input: written back, read it from there
                return self.source(self.input_src[id(v)])
            if v.source is not None:
                return self.source(v.source)
            if v.view_of is not None:
                # a view is made again from its base in Python: aliasing stays as in eager
                return self.view_expr(v.view_of, v)
            return self._output(v)
        if isinstance(v, SymInt):  # (an intermediate's size no expression spells: the graph's)
            return v.expr if v.expr is not None else self._output(v)
        if isinstance(v, slice):
            return f"slice({self.expr(v.start)}, {self.expr(v.stop)}, {self.expr(v.step)})"
        if v is Ellipsis:
            return "..."
        if isinstance(v, LocalFunction):
            return self.local_function(v)
        if isinstance(v, GeneratorCall):
            raise CannotResume("a generator not yet iterated is live across a graph break")
        if isinstance(v, SymShape):
            return "torch.Size([" + ", ".join(self.expr(x) for x in v) + "])"
        src = self.effects.source(v) if self.effects is not None else None
        if src is not None:
            return self.source(src)
        if isinstance(v, GeneratorItems):  # (Python code takes a generator's items by iterating)
            return f"iter(({''.join(self.expr(x) + ', ' for x in v)}))"
        if isinstance(v, tuple) and type(v) is tuple:
            inner = ", ".join(self.expr(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if isinstance(v, tuple) and isinstance(getattr(type(v), "_fields", None), tuple) \
                and type(v).__module__ != "torch.return_types":
            # a named tuple (`typing.NamedTuple`, `collections.namedtuple`): made again with its type
            inner = ", ".join(self.expr(x) for x in v)
            return f"{self.sources.constant(type(v), type(v).__name__)}({inner})"
        if isinstance(v, tuple) and type(v).__module__ == "torch.return_types":
            # a named tuple of torch's (`x.max(dim=1)`): made again with its type
            inner = "".join(self.expr(x) + ", " for x in v)
            return f"torch.return_types.{type(v).__name__}(({inner}))"
        if type(v) is S.LIST_ITERATOR and self.effects is not None and self.effects.is_fresh(v):
            # an iterator capture made (`iter(args)`, builtins._iter): one over the items it has
            # not given yet, made each call (as a constant, capture's own object was consumed by
            # the resume's capture, and later calls got what it had left)
            hit = self._own.get(id(v))
            if hit is not None:
                return hit[1]
            _, args, *position = v.__reduce__()
            rest = list(args[0])[position[0]:] if position else []
            name = self.own_name()
            self._own[id(v)] = (v, name)
            self.prelude.append(f"{name} = iter([{', '.join(self.expr(x) for x in rest)}])")
            return name
        if self.effects is not None and self.effects.is_fresh(v):
            return self.fresh_object(v)
        if type(v) in (list, dict, set):
            hit = self._own.get(id(v))
            if hit is not None:
                return hit[1]
            name = self.own_name()
            self._own[id(v)] = (v, name)
            if type(v) is list:
                text = "[" + ", ".join(self.expr(x) for x in v) + "]"
            elif type(v) is dict:
                text = "{" + ", ".join(f"{self.expr(k)}: {self.expr(x)}" for k, x in v.items()) + "}"
            else:
                text = "{" + ", ".join(self.expr(x) for x in v) + "}" if v else "set()"
            self.prelude.append(f"{name} = {text}")
            return name
        if isinstance(v, torch.Size):
            return f"torch.Size({list(v)!r})" if "torch" in () else self.sources.constant(v, "size")
        if is_literal(v):
            return repr(v)
        src = self.value_sources.get(v)
        if src is not None:
            return self.source(src)
        return self.sources.constant(v, getattr(v, "__name__", type(v).__name__))


    def local_function(self, v: LocalFunction) -> str:
        """A `def` or `lambda` of the captured code that Python code receives (Mamba's combine
        function, passed to `associative_scan` at a break): a real function made once from its
        source, its free variables and defaults as they are now (a snapshot: a closure variable
        rebound after the break is not seen)."""
        hit = self._own.get(id(v))
        if hit is not None:
            return hit[1]
        node = copy_ast(v.node)
        if getattr(node, "decorator_list", None):
            raise CannotResume(f"decorated local function {v.name!r} is live across a graph break")
        args = node.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
        values = {}
        scope = v.env
        while scope is not None:  # the variables of the scopes it closes over, innermost first
            for k, x in scope.vars.items():
                values.setdefault(k, x)
            scope = scope.enclosing
        free = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(values) - set(params))
        # defaults as they were evaluated at the `def`: parameters of the factory too
        defaults = {f"__fl_default_{k}": x for k, x in v.defaults.items()}
        by_param = {k: ast.Name(id=f"__fl_default_{k}", ctx=ast.Load()) for k in v.defaults}
        positional = args.posonlyargs + args.args
        args.defaults = [by_param[a.arg] for a in positional[len(positional) - len(args.defaults):]]
        args.kw_defaults = [by_param.get(a.arg) if d is not None else None
                            for a, d in zip(args.kwonlyargs, args.kw_defaults)]
        name = v.name if isinstance(node, ast.FunctionDef) else "__fl_lambda"
        body = ast.unparse(node) if isinstance(node, ast.FunctionDef) else f"{name} = {ast.unparse(node)}"
        inner = "\n".join("    " + line for line in body.splitlines())
        # (marked: a new object each call, guarded by its code where a resume receives it)
        factory = function_with_source(f"def __fl_make({', '.join(free + sorted(defaults))}):\n{inner}\n"
                                       f"    {name}.__fl_local__ = True\n    return {name}", "__fl_make",
                                       v.env.fs.globals, f"local {v.name}")
        own = self.own_name()
        self._own[id(v)] = (v, own)
        actual = [self.expr(values[k]) for k in free] + [self.expr(defaults[k]) for k in sorted(defaults)]
        self.prelude.append(f"{own} = {self.sources.constant(factory, 'make_' + name)}({', '.join(actual)})")
        return own

    def own_name(self) -> str:
        self._n_own += 1
        return f"__fl_m{self._n_own}"

    def fresh_object(self, v) -> str:
        """An object of a Python class the captured code made: made again from its state, once,
        under one name. It is allocated before its state is written, which may hold the object
        itself (a distribution's transform and its inverse hold each other); a tuple is made
        with its items (side_effects.rebuild), so none of them may hold it."""
        hit = self._own.get(id(v))
        if hit is not None:
            if hit[1] is None:
                raise CannotResume(f"a {type(v).__name__} object that contains itself escapes")
            return hit[1]
        cls = self.sources.constant(type(v), type(v).__name__)
        if isinstance(v, tuple):
            self._own[id(v)] = (v, None)  # being made
            state = self._state_expr(v)
            name = self.own_name()
            self._own[id(v)] = (v, name)
            self.prelude.append(f"{name} = {self.sources.constant(S.rebuild, 'rebuild')}({cls}, {state})")
            return name
        name = self.own_name()
        self._own[id(v)] = (v, name)
        self.prelude.append(f"{name} = {cls}.__new__({cls})")
        state = self._state_expr(v)
        self.prelude.append(f"{self.sources.constant(S.set_state, 'set_state')}({name}, {state})")
        return name

    def _state_expr(self, v) -> str:
        """`(attrs, items)` of `v` (side_effects.state) as an expression of the transformed function."""
        attrs, items = S.state(v)
        a = "None" if attrs is None else "{" + ", ".join(f"{k!r}: {self.expr(x)}" for k, x in attrs.items()) + "}"
        if items is None:
            i = "None"
        elif isinstance(v, dict):
            i = "[" + ", ".join(f"({self.expr(k)}, {self.expr(x)})" for k, x in items) + "]"
        else:
            i = "[" + ", ".join(self.expr(x) for x in items) + "]"
        return f"({a}, {i})"

    def view_expr(self, view_of, view=None) -> str:
        parent, fn, args, kwargs, item = view_of
        # (a metadata write's result views the value it replaced: both are the variable's latest)
        p = self.expr(parent, exact=view is not None and self.latest(parent) is self.latest(view))
        # taken under no_grad of a tensor that requires grad, eager's requires grad (E.no_grad_view)
        no_grad = view is not None and view.node is not None and view.node.meta.get("no_grad_view")
        if no_grad and fn in (torch.Tensor.detach, torch.detach):
            fn, no_grad = E.no_grad_view, False
        if fn is operator.getitem:
            text = f"{p}[{self.expr(args[0])}]"
        else:
            a = [self.expr(x) for x in args] + [f"{k}={self.expr(x)}" for k, x in kwargs.items()]
            if getattr(fn, "__qualname__", "").startswith(("Tensor.", "TensorBase.")):
                text = f"{p}.{fn.__name__}({', '.join(a)})"
            else:
                text = f"{self.sources.constant(fn, fn.__name__)}({', '.join([p] + a)})"
        text = text if item is None else f"{text}[{item}]"
        return f"{self.sources.constant(E.no_grad_view, 'no_grad_view')}({text})" if no_grad else text
