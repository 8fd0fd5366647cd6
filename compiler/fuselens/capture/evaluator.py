"""The symbolic evaluator: walks a function's AST with a frame of values and records tensor
operations into an FX graph.

It runs in two domains. **Concrete**: real example inputs; the first graph break stops the
walk and raises `BreakSignal`, which collects, frame by frame as it unwinds, what
`resume.py` needs to write the transformed function. **Abstract**: nothing is executed,
tensors have unknown shapes; a break is recorded and the walk goes on, so the editor sees
every break of a function in one pass. Both domains raise breaks from the same places."""
from __future__ import annotations

import ast
import dataclasses
import enum
import types

import torch

from . import breaks as B
from .guards import is_literal
from .side_effects import MUTABLE, SideEffects
from .tensor_writes import TensorWrites
from .graph import GraphBuilder
from .source import FunctionSource, NoSourceError, function_source
from .values import UNKNOWN, GeneratorCall, LocalFunction, SymInt, Unknown, ValueSources, contains_tensor
from .frames import AbstractKwargs, BreakSignal, Return, Scope, is_generator
from .statements import Statements
from .expressions import Expressions
from .tensors import Tensors
from .objects import Objects, dataclass_generated_init
from .kinds import kind_of
from .domains import Abstract, Concrete

# values that are the same in another process where their names are (runtime/capture_cache.py)
_NAMED = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, enum.Enum, torch.dtype,
          torch.device)
MAX_INLINE_DEPTH = 40  # real models nest deep: decorators, layers, attention interfaces
_TORCH_DIR = __import__("os").path.dirname(torch.__file__)



def _reads_enclosing(node, enclosing) -> bool:
    """Whether a local function's code reads a variable of an enclosing function's scope (a
    name it loads that is not its own local and that one of those scopes has)."""
    a = node.args
    own = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]}
    body = node.body if isinstance(node.body, list) else [node.body]
    names = [n for b in body for n in ast.walk(b) if isinstance(n, ast.Name)]
    own |= {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    outer = set()
    while enclosing is not None:
        outer |= set(enclosing.vars)
        enclosing = enclosing.enclosing
    return any(isinstance(n.ctx, ast.Load) and n.id not in own and n.id in outer for n in names)

class Evaluator(Statements, Expressions, Tensors, Objects):
    """One capture's interpreter: inlining and binding of calls, breaks and their locations
    here; statements, expressions, calls into torch and Python objects in the mixins."""

    def __init__(self, builder: GraphBuilder, *, abstract=False, sources=None, on_break=None,
                 dynamic: dict | None = None):
        self.g = builder
        # where the concrete and abstract domains differ (domains.py); `abstract` for the walk's
        # own differences (statements.py walks on past a break and down both arms of a branch)
        self.domain = Abstract(on_break) if abstract else Concrete(sources)
        self.abstract = abstract
        self.sources = sources          # capture.Sources (concrete): guards and constants
        self.dynamic = {} if dynamic is None else dynamic  # source expr -> set of dynamic dims (the runtime's)
        self.symbolic = None  # symbolic.SymbolicShapes: made at the first read of an intermediate's size
        # stack of (device_type, enabled, dtype) of autocast where the walk is: the caller's state
        # (guarded) at the bottom, each `with torch.autocast(...)` entered here above it. Capture
        # never enters torch's autocast (the graph casts explicitly), so torch's own answer to
        # `torch.is_autocast_enabled()` here would be the caller's: `autocast_state` answers
        self.autocast: list = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
        self.grad_enabled = torch.is_grad_enabled()
        self.with_expr = None  # the context expression of the `with` being entered (builtins.py)
        self.deriving_views = False  # Tensors.rebind derives the views of a written tensor again
        self.value_sources = ValueSources()   # object -> source expression
        self.tensor_writes = TensorWrites()  # in-place writes: inputs written, values replaced
        self.in_try = 0  # how many captured `try` bodies the evaluation is in (raise is captured there)
        self.effects = SideEffects(sources)  # containers from outside are modelled, mutations replayed
        self.files: set[str] = set()  # of every function run here: what a kept capture was made from
        # what capture took as constants of the process without a guard, for a capture kept across
        # processes (runtime/capture_cache.py): (module name, attribute) -> the value read (checked
        # again there), and the calls run natively on objects of no such check (it keeps none then)
        self.process_reads: dict = {}
        self.process_unchecked: list[str] = []

    # ===================================================================== functions
    def run_natively(self, fn, args, kwargs):
        """Python capture runs rather than inlines (the standard library on plain values): its result
        is a constant of the capture. It is one in another process too where the call reads only
        literals, code, classes, objects the capture made, and modules' attributes (checked again
        there): any other object (a config's state) is noted in `process_unchecked`."""
        reads = list(self.process_reads.values())
        for a in [*args, *kwargs.values()]:
            if not (is_literal(a) or isinstance(a, _NAMED) or self.effects.is_fresh(a) or
                    any(a is v for v in reads) or isinstance(a, types.MethodType) and  # (a method's
                    isinstance(a.__func__, types.FunctionType)):                       # signature)
                self.process_unchecked.append(f"{getattr(fn, '__qualname__', fn)} on a {type(a).__name__}")
        return fn(*args, **kwargs)

    def run(self, fs: FunctionSource, bound: dict) -> object:
        scope = Scope(fs, None, 0, dict(bound))
        return self._run_body(fs, scope)

    def _run_body(self, fs, scope):
        node = fs.node
        self.files.add(fs.filename)
        try:
            if isinstance(node, ast.Lambda):
                return self.eval(node.body, scope)
            self.exec_block(node.body, scope, ("body", node))
        except Return as r:
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
                if every and dataclass_generated_init(fn, every[0]):
                    # the `__init__` @dataclass wrote (no source), called by a wrapper of it
                    return self.dataclass_init(every[0], every[1:len(every) - len(kwargs)], kwargs, fn,
                                               call, caller)
                if self.domain.runs_python and not any(contains_tensor(v) or type(v) in MUTABLE
                                                       or isinstance(v, (Unknown, SymInt)) for v in every):
                    # Python with no source to read (a frozen module's `Mapping.get`) touching
                    # no tensor and no container capture models: Python runs it
                    return self.run_natively(fn, ([self_value] if self_value is not None else []) + list(args),
                                             kwargs)
                if contains_tensor(every):
                    self.brk(B.UNKNOWN_CALL, call, caller, detail=str(e))
                # (the editor cannot see into it, nor tell that a graph would)
                return self.domain.unknowable(self, B.UNKNOWN_CALL, call, caller, detail=str(e))
            enclosing = None
        if self_value is not None:
            args = [self_value] + list(args)
        try:
            bound = self.bind(fs, args, kwargs)
        except TypeError as e:  # (the editor: from values it does not know, or eager's TypeError too)
            return self.domain.unknowable(self, B.UNSUPPORTED_EXPR, call, caller,
                                          detail=f"cannot bind arguments: {e}")
        if isinstance(fn, FunctionSource) or not isinstance(fn, LocalFunction):
            # a local function made again at a break is guarded by its code (guards.guard_value):
            # its cells are read where it was found, each call's own
            at = self.value_sources.get(fn) if getattr(fn, "__fl_local__", False) and fn.__closure__ else None
            for k, v in fs.closure.items():
                if k not in bound:
                    cell_src = None if at is None else \
                        f"{at}.__closure__[{fn.__code__.co_freevars.index(k)}].cell_contents"
                    bound[k] = self.external_constant(v, fs.cells.get(k), k, cell_src)
            for k, v in fs.defaults.items():  # a mutable default lives on with the function
                if bound.get(k) is v and type(v) in MUTABLE:
                    bound[k] = self.external_constant(v, None, k)
        scope = Scope(fs, caller, caller.depth + 1, bound, enclosing)
        scope.call_node = call
        if is_generator(fs.node, fs.source_text):
            return GeneratorCall(fs, scope)  # its body runs when it is iterated
        try:
            return self._run_body(fs, scope)
        except BreakSignal as b:
            b.pending_call = call
            if enclosing is not None and _reads_enclosing(fn.node, enclosing):
                # the code after the break would read the enclosing function's variables, which
                # a generated continuation does not have: the call runs in Python (compiled on
                # its own, with its real closure)
                raise b.in_python(scope) from None
            raise

    def run_generator(self, gen: "GeneratorCall") -> list:
        """What a generator yields, in order: its body run to its end where it is iterated (a
        `for` loop, `list()`, `yield from`). Sound where its consumer only iterates it: its
        effects are the capture's (models, fresh objects), and a consumer that stops early or
        interleaves (`next()`, a context manager's generator) makes it a break instead. A
        break inside makes the statement that iterates it run in Python (a generator cannot be
        resumed)."""
        if gen.items is None:
            gen.fs_scope[1].yields = []
            try:
                self._run_body(*gen.fs_scope)
            except BreakSignal as b:
                raise BreakSignal(b.brk, whole_stmt=True) from None  # (the generator runs eagerly)
            gen.items = gen.fs_scope[1].yields
        return list(gen.items)

    def external_constant(self, v, cell, name, cell_src=None):
        """A callee's closure variable (in `cell`) or default: a container is modelled. A
        closure variable is read from its cell, as the compiled function's own are (capture.py):
        a tensor an input, any other value guarded (its function's identity does not fix what
        its cells hold: `nonlocal` rebinds them; their values had been kept as constants). The
        cell is found at `cell_src` where given (a closure guarded by its code), else it is
        this very cell."""
        if cell is not None:
            v = cell.cell_contents
            src = cell_src or f"{self.domain.constant(cell, 'cell_' + name)}.cell_contents"
            if not isinstance(v, torch.Tensor):
                self.domain.guard_value(src, v)
            return self.wrap_external(v, src)
        if type(v) not in MUTABLE:
            return v
        return self.wrap_external(v, self.domain.constant(v, name))

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
            out[a.kwarg.arg] = UNKNOWN if isinstance(kwargs, AbstractKwargs) else kw
        for name in pos + [p.arg for p in a.kwonlyargs]:
            if name not in out:
                if name in fs.defaults:
                    out[name] = fs.defaults[name]
                elif self.abstract:  # defaults of abstract functions are not evaluated
                    out[name] = UNKNOWN
                else:
                    raise TypeError(f"{fs.name}() missing required argument '{name}'")
        return out

    # ===================================================================== values
    # What a value does when called, read, indexed, tested or iterated is its kind's (kinds.py).
    def call(self, fn, args, kwargs, e, scope):
        return kind_of(fn).call(self, fn, args, kwargs, e, scope)

    def getattr(self, obj, attr, e, scope):
        return kind_of(obj).getattr(self, obj, attr, e, scope)

    def getitem(self, obj, idx, e, scope):
        return kind_of(obj).getitem(self, obj, idx, e, scope)

    def truth(self, v, node, scope, *, kind, whole_stmt=False):
        return kind_of(v).truth(self, v, node, scope, kind, whole_stmt)

    def iterate(self, v, node, scope, whole_stmt=False) -> list:
        self.effects.observe(v)
        return kind_of(v).iterate(self, v, node, scope, whole_stmt)

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

    def brk(self, kind, node, scope, *, detail="", whole_stmt=False, cond=None, compiled_call=None):
        """Stop here with a graph break (concrete) / report it (abstract: raises _Abstract).
        `compiled_call`: a call in the statement Python runs whole that goes to the runtime's
        `compile_callee` (resume.Writer.compiling_calls)."""
        gb = B.make_break(kind, self.loc(node, scope), detail=detail, stack=self.stack(scope),
                          function=scope.fs.qualname)
        sig = BreakSignal(gb, whole_stmt=whole_stmt, cond=cond)
        if compiled_call is not None:
            sig.compile_calls.append(compiled_call)
        raise sig
