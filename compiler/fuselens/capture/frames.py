"""The evaluator's frames and the signals that unwind them: a `Scope` per inlined call, the
control-flow exceptions of `return`/`break`/`continue`, and `BreakSignal`, which carries a graph
break out frame by frame (collecting what resume.py needs)."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field


from . import breaks as B
from .source import FunctionSource
from .values import TensorVar


# -- control-flow signals -------------------------------------------------------------------
class Return(Exception):
    def __init__(self, value):
        self.value = value


class PathEnd(Exception):
    """Abstract domain: the path being analysed raises here (a `raise`): it ends, and is no graph
    break (whatever the exception, the code after it does not run on this path)."""


class LoopBreak(Exception):
    pass


class Suspend(Exception):
    """A `@contextlib.contextmanager` generator reached its `yield` (statements.py): what it
    yields, and the block positions of the yield statement, where its exit continues."""

    def __init__(self, value, levels):
        self.value = value
        self.levels = levels


class LoopContinue(Exception):
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
    # in outer frames whose call made an object (`cls(...)` ran `__init__`): that object, the
    # call's result (the inner frame's return value is `__init__`'s None)
    constructed: object = None


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
        self.pending_constructed = None  # (FrameAtBreak.constructed, for the frame to come)
        # whole statement: the calls in it that led to the break, compiled on their own when
        # Python runs the statement (as each frame Python enters is compiled under torch.compile)
        self.compile_calls: list[ast.Call] = []

    def in_python(self, scope, brk=None) -> "BreakSignal":
        """This break as one of the whole statement being run in `scope`: the call of `scope`
        it came through (if any) is compiled there."""
        out = BreakSignal(brk or self.brk, whole_stmt=True)
        out.compile_calls = list(self.compile_calls)
        if self.frames and self.frames[-1].scope is scope and self.frames[-1].call is not None:
            out.compile_calls.append(self.frames[-1].call)
        elif self.pending_call is not None:
            out.compile_calls.append(self.pending_call)
        return out


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
        self.yields: list | None = None  # a generator function's frame: what it yielded so far
        self.suspends = False  # a context manager's generator: its `yield` suspends the frame

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
    # `expr` as written over the sources it reads (`over`, each `guards.arg(i)` in it), or None
    template: str | None = field(default=None, repr=False, compare=False)
    over: tuple = field(default=(), repr=False, compare=False)
    # "tensor": a strided tensor's static metadata; "unshared": guards.unshared's check (both
    # checked natively where runtime/native_guards.py is built); "" any other
    kind: str = field(default="", repr=False, compare=False)


class Opaque(Exception):
    pass


class AbstractSeq(list):
    """Abstract domain: a sequence of unknown length whose items are all like `element`: tensors
    of unknown shape by default (`x.split(n)`), unknown values (unpacking an unknown), the
    layers of a module list. A loop over it analyses its body once."""

    def __init__(self, element=None):
        super().__init__()
        self.element = element  # None: a tensor (a new TensorVar for each item)

    def item(self):
        return TensorVar(None, None, None) if self.element is None else self.element

    def __iter__(self):  # unpacking: as many items as targets (zip stops at the shorter)
        return iter([self.item() for _ in range(8)])


class AbstractKwargs(dict):
    """Abstract domain: keyword arguments with more of them unknown (`f(x, **kwargs)` where
    `kwargs` is unknown): a callee's `**` parameter receives an unknown value."""


def is_generator(node, text: str = "") -> bool:
    """A `def` whose body yields (not counting functions and lambdas defined in it); kept on the
    node (a function's AST is parsed once and walked at each call inlined). `text`, its source
    where known: without the word `yield` in it there is nothing to walk for (a model's ~400
    functions were each walked whole in a fresh process)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if text and "yield" not in text:
        return False
    known = getattr(node, "_fl_is_generator", None)
    if known is not None:
        return known
    todo, found = list(node.body), False
    while todo and not found:
        n = todo.pop()
        found = isinstance(n, (ast.Yield, ast.YieldFrom))
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))
    node._fl_is_generator = found
    return found


def has_loop_jump(body) -> bool:
    """Whether `body` has a `break`/`continue` of the loop it is in (not of a loop inside)."""
    for s in body:
        for n in _walk_no_loops(s):
            if isinstance(n, (ast.Break, ast.Continue)):
                return True
    return False


def _walk_no_loops(node):
    yield node
    for c in ast.iter_child_nodes(node):
        if isinstance(c, (ast.For, ast.While)):
            for o in c.orelse:  # a loop's `else` is outside it
                yield from _walk_no_loops(o)
        elif not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _walk_no_loops(c)
