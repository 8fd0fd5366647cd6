"""The two domains capture evaluates in, behind one interface.

**Concrete** (capture.py): the example inputs are real. What the evaluation reads from outside
is found again at a source and guarded (guards.py), tensors become graph inputs with their
metadata, library Python on plain values may run natively, and the first break stops the walk.

**Abstract** (the editor, analyze.py): nothing of the user's runs. Tensors have unknown shapes,
what the editor cannot know is `Unknown`, nothing is guarded, and a break is reported and the
walk goes on (statements.py walks both arms of an unknown branch).

The kinds (kinds.py), builtins (builtins.py) and the walkers ask `ev.domain` where the two
differ, so each rule of capture is written once and holds in both."""
from __future__ import annotations

import types

from . import breaks as B
from .guards import SRC, arg
from .values import UNKNOWN, ForeignData, TensorVar, contains_tensor, leaves


class Concrete:
    abstract = False
    runs_python = True  # library Python on plain values may run natively (its result is a constant)

    def __init__(self, sources):
        self.sources = sources  # guards.Sources

    # -- what is read from outside: found again at its source, and guarded -----------------
    def guard(self, expr: str, why: str, *over: str) -> None:
        self.sources.guard(expr, why, *over)

    def guard_value(self, src: str, v) -> None:
        self.sources.guard_value(src, v)

    def guard_module(self, mod, src: str) -> None:
        self.sources.guard_module(mod, src)

    def source(self, ev, obj) -> str | None:
        return ev.value_sources.get(obj)

    def constant(self, obj, hint: str) -> str:
        return self.sources.constant(obj, hint)

    def example(self, src: str):
        """The value found at `src` for the example inputs."""
        return self.sources.resolve(src)

    def input(self, ev, t, src: str) -> TensorVar:
        """A tensor from outside the graph: a graph input, guarded on its metadata."""
        tv = ev.g.input(t, src)
        if tv.source == src:
            marked = t.__dict__.get("_dynamo_dynamic_indices")
            if marked:  # `torch._dynamo.mark_dynamic(t, d)`: dynamic from the first call on
                ev.dynamic.setdefault(src, set()).update(d % t.dim() for d in marked if t.dim())
            self.sources.guard_tensor(src, t, ev.dynamic.get(src, ()))
        else:  # the same tensor reached by two names: guard the aliasing
            self.sources.guard(f"{SRC} is {arg(1)}", f"{src} is the same tensor as {tv.source}", src, tv.source)
        # read again after an in-place op on it (e.g. `self.buf.add_(1)`): the new value
        return ev.tensor_writes.inputs.get(tv.source, tv)

    def external(self, ev, v, src: str):
        """A list, dict or set from outside: modelled, its mutations replayed (side_effects.py)."""
        return ev.effects.model(v, src, ev.wrap_external)

    def global_source(self, gdict, name, v) -> str:
        return self.sources.global_source(gdict, name, v)

    # -- what capture cannot see into ------------------------------------------------------
    def opaque_call(self, ev, fn, args, kwargs, e, scope):
        ev.brk(B.UNKNOWN_CALL, e, scope, detail=f"call to {_name(fn)}")

    def unknowable(self, ev, kind, node, scope, detail="", whole_stmt=False):
        """What the evaluation cannot know here: a break."""
        ev.brk(kind, node, scope, detail=detail, whole_stmt=whole_stmt)

    def torch_receives(self, values) -> None:
        pass  # (no ForeignData: a call into C code broke where it was made)


class Abstract:
    """Also the abstract walk's own state: the breaks it reports go to `on_break`; `uncertain`
    holds the files of the arms of unknown branches being walked (statements.py); `foreign`:
    a ForeignData was made (NumPy's data may reach torch)."""
    abstract = True
    runs_python = False  # the editor never runs the user's code, nor a library's on its values

    def __init__(self, on_break):
        self.on_break = on_break  # called with each GraphBreak
        self.uncertain: list[str] = []
        self.foreign = False

    # -- nothing is guarded: the editor compiles nothing ------------------------------------
    def guard(self, expr, why, *over):
        pass

    def guard_value(self, src, v):
        pass

    def guard_module(self, mod, src):
        pass

    def source(self, ev, obj):
        return "<editor>"  # wherever it is: nothing is found again, nor guarded

    def constant(self, obj, hint):
        return hint

    def example(self, src):
        return None

    def input(self, ev, t, src):
        return ev.g.abstract_input(src)

    def external(self, ev, v, src):
        # modelled too: the editor's walk must not change the program's lists
        return ev.effects.model(v, None, lambda x, _: x)

    def global_source(self, gdict, name, v):
        return name

    def opaque_call(self, ev, fn, args, kwargs, e, scope):
        if contains_tensor([args, kwargs]):
            ev.brk(B.UNKNOWN_CALL, e, scope, detail=f"call to {_name(fn)}")
        if not _c_callable(fn) or self.uncertain:
            return UNKNOWN  # on values the editor does not know (a library's object): silent
        # capture breaks here (it cannot see into C code): claimed where the result reaches
        # torch (ForeignData), not on NumPy work of its own
        self.foreign = True
        return ForeignData.merge(*leaves([args, kwargs]), extra=[B.make_break(
            B.UNKNOWN_CALL, ev.loc(e, scope), stack=ev.stack(scope), function=scope.fs.qualname,
            detail=f"call to {_name(fn)}")])

    def unknowable(self, ev, kind, node, scope, detail="", whole_stmt=False):
        """What the evaluation cannot know here: unknown (the editor knows less than capture)."""
        return UNKNOWN

    def torch_receives(self, values) -> None:
        """NumPy's data (ForeignData) among `values` reaches torch: the breaks of the calls that
        made it are claimed."""
        if self.foreign:
            for v in leaves(values):
                for b in (v.breaks if isinstance(v, ForeignData) else ()):
                    self.on_break(b)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _c_callable(fn) -> bool:
    """A function or bound method written in C (`np.power`, `np.sin`): reached as an opaque
    call (not a container's or a constant's method), calling it is the concrete domain's
    UNKNOWN_CALL break whatever its arguments are."""
    return callable(fn) and not isinstance(fn, (type, types.FunctionType, types.MethodType))
