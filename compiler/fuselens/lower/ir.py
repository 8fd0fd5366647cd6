"""Loop-level IR: buffers, and the computations that fill them.

A tensor during lowering is a `View` (a strided window onto a buffer: no kernel, no copy) or a
`Lazy` pointwise value (a function from an index to a value, not yet stored anywhere). Lazy
values are inlined into whatever consumes them; they become buffers ("are realized") only when
something needs memory: a graph output, an extern call, or an expression grown too large.

Index expressions are sympy expressions over per-dimension loop variables (`x0`, `r1`, ...) and
size symbols (`SizeVars`), so kernels take sizes as arguments (indexing.py keeps them small).
Loop bodies call the *ops handler* (`ops()`): an `OpsHandler`, declared below and implemented by
`ReadRecorder` (below: lowering and the scheduler see which elements a body loads) and the Triton
kernel writer (codegen/).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol

import sympy
import torch

from .indexing import expanded, view_index


class SizeVars:
    """Sizes, strides and offsets appear in index expressions as symbols `s0, s1, ...`, one per
    distinct value (0 and 1 stay literal: they decide broadcasting). Kernels take the symbols as
    arguments, so the same kernel source serves every shape with the same equalities."""

    def __init__(self):
        self.symbols: dict[int, sympy.Symbol] = {}
        self.values: dict[sympy.Symbol, int] = {}

    def __call__(self, value: int):
        value = int(value)
        if value in (0, 1) or value < 0:
            return sympy.Integer(value)
        if value not in self.symbols:
            sym = sympy.Symbol(f"s{len(self.symbols)}", integer=True, positive=True)
            self.symbols[value] = sym
            self.values[sym] = value
        return self.symbols[value]

    def evaluate(self, expr) -> int:
        return int(sympy.sympify(expr).xreplace(self.values))  # (subs tries each size in turn)


class DynamicValues(frozenset):
    """The values that a graph's dynamic dims have at this call (empty: a static graph), and in
    `static` the sizes of its inputs' other dims, the same at every call of the graph. A program
    is built per input shape and kernels are shared by their source's text: a size kept a kernel
    argument lets a new length reuse the compiled kernel; a static one written as its value gives
    the kernel the static kernel's loops (BERT's hidden size as a loop bound: the dynamic entry's
    C++ kernels were 13% slower than the static entry's)."""

    def __new__(cls, values=(), static=frozenset()):
        self = super().__new__(cls, values)
        self.static = frozenset(static)
        return self


def compute_dtype(dtype):
    """What kernels compute a dtype's values in: half precision in fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


# --- the ops handler ------------------------------------------------------------------------------
class IndexEnv(Protocol):
    """What index simplification (indexing.py) asks of the code evaluating a loop body."""
    sizevars: SizeVars
    ranges: dict  # loop variable -> its extent


class OpsHandler(IndexEnv, Protocol):
    """What a loop body calls, through `ops()`, to compute an element: the one interface between the
    loop IR and what reads it. Each code generator implements it (the Triton kernel writer,
    codegen/triton_expressions.py), and so do the analyses that run bodies (schedule/fusion.py's
    ReadRecorder: which elements a body loads; codegen/triton_reductions.py's _Tree: two bodies
    computing one value). Values are the handler's own (a Triton variable, a tree, nothing): a body
    passes them back in, never looks inside."""

    def at(self, loc) -> ContextManager:
        """Operations inside are on behalf of the source location `loc` (file, line, ...)."""

    def load(self, buf: Buffer, index):
        """The element of `buf` at flat `index` (a sympy expression over loop variables and sizes)."""

    def constant(self, value, dtype: torch.dtype):
        """A Python number as a value of `dtype`."""

    def pointwise(self, p, vals: list, out_dtype: torch.dtype):
        """Pointwise primitive `p` (ops/primitives.py) of `vals`: its spelling for this target."""

    def to_dtype(self, v, dtype: torch.dtype):
        """`v` converted to `dtype` as torch converts."""

    def masked(self, conds: list, body: Callable, other, dtype: torch.dtype):
        """`body()` where all `conds` (sympy relations of the index) hold, its loads masked by them;
        `other` (a value, or a Python number of `dtype`) elsewhere."""

    def index_value(self, e, dtype: torch.dtype):
        """The value of index expression `e` as a `dtype` (iota)."""

    def random(self, kind: str, stream: int, flat):
        """Philox random numbers, `kind` "rand" or "randn", of the graph's seed and `stream`, at
        element `flat`."""

    def indirect(self, v) -> sympy.Symbol:
        """A symbol standing for integer value `v` (an index read from a tensor) in index
        expressions: a scatter's store position (ComputedBuffer)."""


_local = threading.local()  # graphs may be compiled on several threads at once


def ops():
    return _local.handlers[-1]


@contextlib.contextmanager
def use_handler(handler):
    if not hasattr(_local, "handlers"):
        _local.handlers = []
    _local.handlers.append(handler)
    try:
        yield handler
    finally:
        _local.handlers.pop()


# --- loop variables, and the handler that records a body's loads --------------------------------
def loop_vars(shape, red_dims):
    return [sympy.Integer(0) if s == 1 else
            sympy.Symbol(f"{'r' if d in red_dims else 'x'}{d}", integer=True, nonnegative=True)
            for d, s in enumerate(shape)]


def loop_ranges(shape, red_dims):
    """Each loop variable of a domain -> its extent (what index simplification may assume)."""
    return {v: s for v, s in zip(loop_vars(shape, red_dims), shape) if isinstance(v, sympy.Symbol)}


class ReadRecorder(OpsHandler):
    """Ops handler that runs a loop body only to see which buffer elements it loads (its values
    are None)."""

    def __init__(self, sizevars, ranges):
        self.sizevars = sizevars
        self.ranges = ranges
        self.reads = []

    def at(self, loc):
        return contextlib.nullcontext()

    def load(self, buf, index):
        self.reads.append((buf, expanded(index)))

    def masked(self, conds, body, other, dtype):
        body()

    def constant(self, value, dtype):
        pass

    def pointwise(self, p, vals, out_dtype):
        pass

    def to_dtype(self, v, dtype):
        pass

    def index_value(self, e, dtype):
        pass

    def random(self, kind, stream, flat):
        pass

    def indirect(self, v):
        return sympy.Symbol("indirect", integer=True)


# --- buffers --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Buffer:
    name: str
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    def numel(self):
        return math.prod(self.shape)


@dataclass(eq=False)
class InputBuffer(Buffer):
    index: int = 0  # position among the graph's inputs
    held: bool = False  # its memory is held elsewhere too (a backward's primal or incoming gradient)


@dataclass(eq=False)
class ComputedBuffer(Buffer):
    """Filled by a kernel. Pointwise: `body(idx)` gives the element at idx (over `shape`).
    Reduction: `body(idx)` gives the input element at idx over `in_shape`; the dims in `red_dims`
    are reduced with `reduce` ("sum", "prod", "max", "min"); `shape` keeps them as 1s.
    Partial (stage 1 of a column reduction, made by the scheduler): like a reduction, but the
    reduced rows are reduced per chunk of `chunk` rows; `shape` has the number of chunks in place
    of the first reduced dim.
    Scatter (an in-place write into `into`, a graph input, at positions read from a tensor: a KV
    cache's `index_copy_`): pointwise over `in_shape`; `body(idx)` gives (the value, the flat
    index of `into`'s element it is stored at, the conditions under which it is stored: the index
    in range); `shape` and `stride` are `into`'s, whose memory it is: its readers read it after the
    write, and the wrapper names `into` by it."""
    body: object = None
    kind: str = "pointwise"
    in_shape: tuple = ()
    red_dims: tuple = ()
    reduce: str | None = None
    loc: tuple | None = None
    chunk: int | None = None
    into: Buffer | None = None


@dataclass(eq=False)
class ExternCall:
    """A call of a primitive's `impl` from the wrapper (matmul, conv, any torch function)."""
    name: str
    prim: object
    args: tuple
    kwargs: dict
    result: object  # ExternBuffer for a tensor result; None for a tuple (read through `items`)
    items: list = field(default_factory=list)  # ExternBuffers for the tensors of a tuple result
    loc: tuple | None = None


@dataclass(eq=False)
class ExternBuffer(Buffer):
    call: ExternCall | None = None
    item: int | None = None  # index into the call's tuple result


# --- tensor values during lowering ----------------------------------------------------------------
class TensorValue:
    shape: tuple
    dtype: torch.dtype


@dataclass(eq=False)
class View(TensorValue):
    buf: Buffer
    shape: tuple
    stride: tuple
    offset: int

    @property
    def dtype(self):
        return self.buf.dtype

    def index(self, idx, env):
        """The buffer element at `idx`; `env`: the ops handler (sizes and loop ranges)."""
        return view_index(self.offset, self.stride, idx, env)

    def load(self, idx):
        return ops().load(self.buf, self.index(idx, ops()))

    def is_whole(self):
        return self.shape == self.buf.shape and self.stride == self.buf.stride and self.offset == 0


@dataclass(eq=False)
class Lazy(TensorValue):
    shape: tuple
    dtype: torch.dtype
    fn: object
    cost: int = 1  # number of operations inlined into it
    loc: tuple | None = None  # source location of the op that produced it
    realized: View | None = None  # the buffer it was stored in, once something needed memory
    # (base Lazy, dims) when this is a permutation of another lazy value: stored, it is the base
    # stored in its own layout and viewed permuted (a transposed store would not coalesce)
    permute_of: tuple | None = None
    # the Lazy this is a reshape of: stored, it is the base stored (once, for every reshape of it)
    # and viewed, so the store runs over the base's loops, which the base's producers share (a
    # norm's output reshaped for each of three projections: one store, in the norm's kernel)
    reshape_of: "Lazy | None" = None
    # the dense layout it is stored in, outermost dim first (None: row-major): its first full-size
    # operand's, as eager's TensorIterator lays out a pointwise result (a channels-last
    # convolution's activations stay channels-last up to the next convolution)
    order: list | None = None
    reads: frozenset = frozenset()  # (buffer name, elements) a load of it reads (each consumer reads them all)
    # computed from operands smaller than it, broadcast (a one-hot mask of a class iota and the
    # targets): no layout of its own, so a pointwise op reading it takes another operand's
    broadcast_only: bool = False
    heavy: bool = False  # it inlines a heavy primitive (Primitive.heavy)

    def load(self, idx):
        return self.fn(idx)


def buffer_view(buf: Buffer) -> View:
    return View(buf, tuple(buf.shape), tuple(buf.stride), 0)


@dataclass
class LoweredGraph:
    inputs: list  # InputBuffer, or None for the int seed input
    steps: list  # ComputedBuffer | ExternCall in execution order
    outputs: list  # View | python value
    sizevars: SizeVars
    device: torch.device
    has_seed: bool = False

    def describe(self) -> str:
        lines = [f"{b.name}: input {list(b.shape)} {b.dtype}" for b in self.inputs if b is not None]
        for s in self.steps:
            if isinstance(s, ExternCall):
                lines.append(f"{s.name} = extern {s.prim.name}")
            elif s.kind == "reduction":
                lines.append(f"{s.name} = {s.reduce} of {list(s.in_shape)} over dims {list(s.red_dims)} -> "
                             f"{list(s.shape)} {s.dtype}")
            else:
                lines.append(f"{s.name} = pointwise {list(s.shape)} {s.dtype}")
        outs = [(o.buf.name if o.is_whole() else f"view of {o.buf.name}") if isinstance(o, View) else repr(o)
                for o in self.outputs]
        return "\n".join(lines + [f"outputs: {', '.join(outs)}"])
