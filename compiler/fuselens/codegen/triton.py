"""Triton source for one FusedKernel.

The kernel writer is the ops handler that loop bodies run against: each op call appends one
line (`tmp7 = tmp3 * tmp5  # model.py:12 ...`), with common subexpressions reused. Kernel shapes:

  pointwise   1-D blocks of XBLOCK elements.
  persistent  reductions with rows of up to PERSISTENT_RNUMEL_MAX elements: a block holds
              XBLOCK whole rows (RBLOCK >= rnumel), every reduction and epilogue is straight-line.
  looped      longer rows: each reduction loops over the row in RBLOCK chunks (consecutive
              reductions that read none of each other in one loop); values that must be stored
              are computed in a final loop.
  chunked     kernels computing partials (stage 1 of a column reduction, schedule/fusion.py):
              program p walks rows [p*xchunk, (p+1)*xchunk) in blocks of XBLOCK rows and keeps
              one accumulator per partial in registers; after the loop it stores them as row p
              of the partials. chunked_rows: with row reductions, a block holds whole rows
              (RBLOCK >= rnumel, few rows), the rest of the kernel is as persistent, and the
              accumulator is [1, RBLOCK] (the block's column sums added each step);
              chunked_tiles: no row reductions, so the columns are tiled too (program = (chunk,
              column tile)) and the accumulator is the whole [XBLOCK, RBLOCK] tile, added
              elementwise, its rows reduced once after the loop (a reduction across rows each
              step costs a shared-memory round trip per tile).
Half-precision values are computed in fp32 (loads upcast) and each primitive's result is rounded to
its half type, as eager's op results are (`round`). max/min reductions propagate NaN. Sizes, strides and
offsets are kernel arguments (`ks0, ks1, ...`).
"""
from __future__ import annotations

import contextlib
import linecache
from dataclasses import dataclass
import math
import os
import re

import sympy
import torch

from ..lower.indexing import FloorDiv, ModIndex
from ..lower.ir import compute_dtype, contiguous_strides, use_handler
from ..schedule.fusion import (PERSISTENT_RNUMEL_MAX, FusedKernel, ReadRecorder, keep_shape, loop_ranges, loop_vars,
                               moved_row_vars, node_vars, row_shapes, store_index)
from ..ops.primitives import PRIMITIVES, TRITON_HELPERS
from .launcher import MAX_RTILE, ROUND_HELPERS, next_power_of_2

# blocks never exceed this many elements, so a size divisible by it needs no mask
MAX_XBLOCK = 1024
# kernels of at least this many elements divide their indices by literals (KernelWriter.divisor)
LITERAL_DIVISORS_MIN = 1 << 26

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
             torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
             torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}

# max and min propagate NaN as torch's do (tl.max and a bare tl.maximum drop it)
REDUCE_FINAL = {"sum": "tl.sum({0}, 1)", "max": "tl.reduce({0}, 1, _max_combine)",
                "min": "tl.reduce({0}, 1, _min_combine)", "prod": "tl.reduce({0}, 1, _prod_combine)"}
REDUCE_AXIS0 = {"sum": "tl.sum({0}, 0)", "max": "tl.reduce({0}, 0, _max_combine)",
                "min": "tl.reduce({0}, 0, _min_combine)", "prod": "tl.reduce({0}, 0, _prod_combine)"}
REDUCE_COMBINE = {"sum": "{0} + {1}", "max": "tl.maximum({0}, {1}, tl.PropagateNan.ALL)",
                  "min": "tl.minimum({0}, {1}, tl.PropagateNan.ALL)", "prod": "{0} * {1}"}
# combine functions that tl.reduce calls, defined in a kernel's module when it uses them
COMBINE_FNS = {r: f"def _{r}_combine(a, b):\n    return {REDUCE_COMBINE[r].format('a', 'b')}"
               for r in ("max", "min", "prod")}


# a primitive's spelling that calls one of the kernel-local helpers of ops/primitives.py
_HELPER_CALL = re.compile(r"(fl_\w+)\(")

# names in a kernel line whose values vary over the block: temporaries, loop variables, masks
_BLOCK_NAMES = re.compile(r"\b(tmp\d+|[xr]\d+|[xr]index|[xr]mask)\b")


def neutral(reduce, dtype):
    if reduce in ("sum", "prod"):
        v = 0 if reduce == "sum" else 1
        return repr(float(v)) if dtype.is_floating_point else str(v)
    if dtype.is_floating_point:
        return 'float("-inf")' if reduce == "max" else 'float("inf")'
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is None:
        return "0" if reduce == "max" else "1"
    return str(info.min if reduce == "max" else info.max)


@dataclass
class Hoist:
    """Where loads of no computed value go: after a persistent kernel's index setup, where their
    latency overlaps the row reductions before their use, or before a chunked kernel's row loop
    (a column's per-channel values, loaded once rather than once a block of rows)."""
    at: int          # the line they are inserted at
    depth: int       # the scope depth a load is hoisted from (the loop's body)
    axes: set        # the block axes a hoisted load may vary along
    indent: int
    scope: dict      # the scope they are remembered in


class CV:
    """A value in the kernel: a variable name or a literal, with its (compute) dtype."""
    __slots__ = ("expr", "dtype", "value")

    def __init__(self, expr, dtype, value=None):
        self.expr, self.dtype, self.value = expr, dtype, value  # value: the Python value of a literal

    @property
    def literal(self):
        return self.value is not None

    def __str__(self):
        return self.expr


def literal(value, dtype):
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        value = float(value)
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    return str(int(value))


def loc_comment(loc):
    if not loc:
        return ""
    filename, line = loc[0], loc[1]
    text = linecache.getline(filename, line).strip()
    if len(text) > 60:
        text = text[:57] + "..."
    return f"  # {os.path.basename(filename)}:{line}" + (f"  {text}" if text else "")


class KernelWriter:
    def __init__(self, kernel: FusedKernel, name_index: int, sizevars, dynamic_values=frozenset(), pdl=False,
                 reciprocal_divisors=False):
        self.kernel = kernel
        self.pdl = pdl  # launched with programmatic dependent launch (codegen/cuda.py)
        self.sizevars = sizevars
        self.index_in_graph = name_index
        self.red = kernel.red_dims or ()
        shape = kernel.shape
        self.ranges = loop_ranges(shape, self.red)
        self.x_dims = [d for d, s in enumerate(shape) if s != 1 and d not in self.red]
        self.r_dims = [d for d, s in enumerate(shape) if s != 1 and d in self.red]
        self.xnumel = math.prod(s for d, s in enumerate(shape) if d not in self.red)
        self.rnumel = math.prod(shape[d] for d in self.red) if kernel.is_reduction else 1
        self.chunk = kernel.chunk
        self.mode = "pointwise" if not kernel.is_reduction else \
            ("persistent" if self.rnumel <= PERSISTENT_RNUMEL_MAX else "looped")
        if self.chunk:
            self.mode = "chunked_rows" if kernel.has_row_reductions else "chunked_tiles"
        numel_limit = max([self.xnumel * self.rnumel] + [n.numel() for n in kernel.nodes])
        self.int64 = numel_limit >= 2 ** 31  # also set by generate() for inputs spanning that much memory
        dynamic = any(s in dynamic_values for s in shape)
        self.need_xmask = dynamic or self.xnumel % (self.chunk or MAX_XBLOCK) != 0
        self.need_rmask = self.mode == "looped" or dynamic or next_power_of_2(self.rnumel) != self.rnumel
        if self.mode == "chunked_tiles":  # column tiles of up to MAX_RTILE
            self.need_rmask = dynamic or self.rnumel % MAX_RTILE != 0
        self.accs: dict[str, str] = {}  # partial's name -> its accumulator
        self._chunk_loop = None
        self._row_major = None  # (index of the kernel's row, of its element), row-major
        self.dynamic_values = dynamic_values
        self.reciprocal_divisors = reciprocal_divisors  # divide by a number as ATen's CUDA kernels do
        self.group = {n.name: n for n in kernel.nodes}
        self.values: dict[str, CV] = {}  # reduction results and per-row values, by buffer name
        self.lines: list[tuple[int, str]] = []
        self.indent = 1
        self.scopes: list[dict] = [{}]
        self.tmp = 0
        self.loc = None
        self.mask_stack: list[str] = []
        self.in_args: dict[str, str] = {}
        self.out_args: dict[str, str] = {}
        # buffer name -> the (index, mask) of each load from it, of its store: what the wrapper
        # needs to know to write an output over an input (WrapperWriter.in_place_of)
        self.load_sites: dict[str, set] = {}
        self.store_sites: dict[str, set] = {}
        self.size_args: dict = {}  # size symbol -> kernel argument name
        self.buffers: dict[str, object] = {}
        self.uses_seed = False
        self.combines: set[str] = set()  # reductions whose combine function the kernel defines
        self.helpers: set[str] = set()  # the primitives' Triton helpers (TRITON_HELPERS) the kernel calls
        self.op_names: set[str] = set()
        self.source_lines: set = set()
        self.varies: dict[str, frozenset] = {}  # temporary -> which block axes ("x", "r") it varies along
        self.hoist: Hoist | None = None
        self._reads: dict[str, list] = {}  # buffer name -> the buffers its body loads

    # --- emission helpers -------------------------------------------------------------------------
    def emit(self, text, loc=None):
        loc = loc if loc is not None else self.loc
        if loc:
            self.source_lines.add((loc[0], loc[1]))
        self.lines.append((self.indent, text + loc_comment(loc)))

    def cse(self, text, dtype, hoist=False):
        """`hoist`: a load that reads nothing computed may go up to `self.hoist` (Hoist)."""
        for scope in reversed(self.scopes):
            if text in scope:
                return CV(scope[text], dtype)
        axes = self.axes(text)
        name = self.new_tmp(axes)
        h = self.hoist
        if hoist and h is not None and len(self.scopes) == h.depth and "tmp" not in text and axes <= h.axes:
            loc = self.loc
            if loc:
                self.source_lines.add((loc[0], loc[1]))
            self.lines.insert(h.at, (h.indent, f"{name} = {text}" + loc_comment(loc)))
            h.at += 1
            h.scope[text] = name
        else:
            self.emit(f"{name} = {text}")
            self.scopes[-1][text] = name
        return CV(name, dtype)

    def new_tmp(self, axes):
        name = f"tmp{self.tmp}"
        self.tmp += 1
        self.varies[name] = frozenset(axes)
        return name

    def axes(self, text):
        out = set()
        for name in _BLOCK_NAMES.findall(text):
            out |= self.varies.get(name, set()) if name.startswith("tmp") else {name[0]}
        return out

    @contextlib.contextmanager
    def scope(self):
        self.scopes.append({})
        self.indent += 1
        try:
            yield
        finally:
            self.indent -= 1
            self.scopes.pop()

    def at(self, loc):
        @contextlib.contextmanager
        def ctx():
            saved, self.loc = self.loc, loc if loc else self.loc
            try:
                yield
            finally:
                self.loc = saved
        return ctx()

    def expr(self, e) -> str:
        """Print an index expression; size symbols become kernel arguments."""
        e = sympy.sympify(e)
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            if e.name[0] in "xr":
                return e.name
            if e not in self.size_args:
                self.size_args[e] = f"ks{len(self.size_args)}"
            return self.size_args[e]
        if isinstance(e, FloorDiv):
            return f"({self.expr(e.args[0])} // {self.divisor(e.args[1])})"
        if isinstance(e, ModIndex):
            return f"({self.expr(e.args[0])} % {self.divisor(e.args[1])})"
        if e.is_Add:
            terms = sorted(e.args, key=lambda t: (t.is_Integer, str(t)))
            out = self.expr(terms[0])
            for t in terms[1:]:
                c, rest = t.as_coeff_Mul()
                out += f" - {self.expr(-t)}" if c < 0 else f" + {self.expr(t)}"
            return f"({out})"
        if e.is_Mul:
            c, rest = e.as_coeff_Mul()
            if c == -1:
                return f"-{self.expr(rest)}"
            return " * ".join(self.expr(a) for a in e.args)
        if isinstance(e, sympy.Rel):
            op = {sympy.Ge: ">=", sympy.Gt: ">", sympy.Le: "<=", sympy.Lt: "<", sympy.Eq: "=="}[type(e)]
            return f"({self.expr(e.lhs)} {op} {self.expr(e.rhs)})"
        raise NotImplementedError(f"index expression {e}")

    def divisor(self, d) -> str:
        """A divisor of an index: its value in a kernel of at least LITERAL_DIVISORS_MIN elements
        of a graph without dynamic sizes. Division by a constant compiles to a multiply and a shift;
        by a kernel argument, to ~20 integer instructions an element, which left GPT-2's loss
        gradient (206M elements, three divisions each) at 1.1 TB/s. Smaller kernels keep sizes as
        arguments, so kernels that differ only in sizes (a ResNet's stages) share one compile: with
        literal divisors everywhere, ResNet-50's cold first call took 4.7 s instead of 2.8, its
        step as long."""
        d = sympy.sympify(d)
        elements = self.xnumel * (self.rnumel if self.kernel.is_reduction else 1)
        # (in a graph with dynamic sizes, no divisor: one symbol stands for a product of sizes, so
        # which of them derive from a dynamic size is not known here)
        if elements >= LITERAL_DIVISORS_MIN and not self.dynamic_values and \
                all(s.name[0] not in "xr" for s in d.free_symbols):
            return str(self.sizevars.evaluate(d))
        return self.expr(d)

    def index_text(self, index) -> str:
        """An index as Triton code. The common case, the element at the loop position in a row-major
        tensor of the kernel's shape, is `xindex` (or `xindex * rnumel + rindex`): no div/mod needed."""
        shape, red = self.kernel.shape, self.red
        if self._row_major is None:
            def row_major(over_shape):
                strides = contiguous_strides(over_shape)
                return sum((v * self.sizevars(st) for v, st in zip(loop_vars(over_shape, red), strides)),
                           sympy.Integer(0))
            self._row_major = row_major(keep_shape(shape, red)), row_major(shape)
        row, element = self._row_major

        def equal(a, b):  # (different loop variables: not equal; sympy cancels a term and its negation)
            if a == b:
                return True
            if a.free_symbols == b.free_symbols and sympy.expand(a - b) == 0:
                return True
            # sizes by their values: a view's stride s0*s1 (BERT's [4096, 3072] GEMM output read as
            # [32, 128, 3072]) is the row-major stride s2 of the same value, and `xindex` then
            # saves three divisions an element. Not with dynamic sizes, where the values change
            loops = lambda e: {v for v in e.free_symbols if v.name[0] in "xr"}  # noqa: E731
            return not self.dynamic_values and loops(a) == loops(b) and \
                sympy.expand((a - b).subs(self.sizevars.values)) == 0
        if self.x_dims and equal(index, row):
            return "xindex"  # the kernel's own row (or element, in a pointwise kernel)
        reduced_last = all(d in red for d in range(len(shape) - len(red), len(shape)))
        if self.r_dims and reduced_last and equal(index, element):
            return "xindex * rnumel + rindex" if self.x_dims else "rindex"
        return self.expr(index)

    def reads_before_writing(self, inp, out) -> bool:
        """Whether every load of buffer `inp` comes before the store of buffer `out` in the kernel's
        lines: a load emitted for a later output than `out` follows its store."""
        load, store = f"tl.load({self.in_args[inp]} + ", f"tl.store({self.out_args[out]} + "
        loads = [i for i, (_, text) in enumerate(self.lines) if load in text]
        stores = [i for i, (_, text) in enumerate(self.lines) if store in text]
        return bool(loads and stores) and max(loads) < min(stores)

    @staticmethod
    def along_r(index) -> bool:
        return any(s.name[0] == "r" for s in sympy.sympify(index).free_symbols)

    def mask_for(self, index) -> str | None:
        names = {s.name[0] for s in sympy.sympify(index).free_symbols if s.name[0] in "xr"}
        parts = []
        if "x" in names and self.need_xmask:
            parts.append("xmask")
        if "r" in names and self.need_rmask:
            parts.append("rmask")
        parts += self.mask_stack
        return " & ".join(parts) if parts else None

    def arg_for(self, buf, table, prefix):
        if buf.name not in table:
            table[buf.name] = f"{prefix}{len(table)}"
            self.buffers[buf.name] = buf
        return table[buf.name]

    def vars_for(self, buf):
        return node_vars(buf, self.kernel.shape, self.red, self.sizevars)

    # --- the ops handler --------------------------------------------------------------------------
    def load(self, buf, index):
        if buf.name in self.group:
            if buf.name in self.values:
                return self.values[buf.name]
            return self.inline(self.group[buf.name])
        ptr = self.arg_for(buf, self.in_args, "in_ptr")
        # a constant index is a broadcast element, always in bounds: a scalar load takes no mask
        mask = self.mask_for(index) if sympy.sympify(index).free_symbols else None
        index_text = self.index_text(index)
        self.load_sites.setdefault(buf.name, set()).add((index_text, mask, self.along_r(index)))
        text = f"tl.load({ptr} + {index_text}" + (f", {mask}, other=0)" if mask else ")")
        if compute_dtype(buf.dtype) != buf.dtype:
            text += ".to(tl.float32)"
        return self.cse(text, compute_dtype(buf.dtype), hoist=True)

    def inline(self, buf):
        """The value of a pointwise buffer of this kernel at the current loop variables. The
        kernel's buffers it reads are computed first, in kernel order, so that each body finds
        its inputs computed: a long chain of fused buffers is not a chain of nested calls."""
        value = self._inlined(buf)
        if value is None:
            for dep in self._group_deps(buf):
                if self._inlined(dep) is None:
                    self._inline_one(dep)
            value = self._inline_one(buf)
        return value

    def _inline_key(self, buf):
        return f"<inline {buf.name} under {self.mask_stack}>"

    def _inlined(self, buf):
        key = self._inline_key(buf)
        return next((scope[key] for scope in reversed(self.scopes) if key in scope), None)

    def _inline_one(self, buf):
        value = buf.body(self.vars_for(buf))
        self.scopes[-1][self._inline_key(buf)] = value
        return value

    def _group_deps(self, buf):
        """The pointwise buffers of this kernel that `buf` reads, directly or not, in kernel order."""
        found, todo = set(), [buf]
        while todo:
            for src in self._direct_reads(todo.pop()):
                dep = self.group.get(src.name)
                if dep is not None and dep.kind == "pointwise" and src.name not in self.values \
                        and src.name not in found:
                    found.add(src.name)
                    todo.append(dep)
        return [n for n in self.kernel.nodes if n.name in found]

    def _direct_reads(self, buf):
        if buf.name not in self._reads:
            recorder = ReadRecorder(self.sizevars, self.ranges)
            with use_handler(recorder):
                buf.body(self.vars_for(buf))
            self._reads[buf.name] = [b for b, _ in recorder.reads]
        return self._reads[buf.name]

    def constant(self, value, dtype):
        if not isinstance(value, bool) and float(value).is_integer() and int(value) in self.dynamic_values:
            # a size that may change (e.g. the count a mean divides by): a kernel argument, not a
            # literal; an integer argument, converted where the constant is a float
            cd = compute_dtype(dtype)
            size = self.expr(self.sizevars(int(value)))
            return self.cse(f"{size}.to({TL_DTYPES[cd]})", cd) if cd.is_floating_point else CV(size, cd)
        if compute_dtype(dtype) != dtype:  # a half-precision constant is the nearest value of its type
            value = torch.tensor(value, dtype=dtype).item()
        if dtype.is_floating_point and value == 0 and math.copysign(1.0, value) < 0:
            # Triton (<= 3.6) makes a scalar constant equal to 0 its type's zero, dropping the sign
            # of -0.0 (`x + -0.0` gave +0.0 for x = -0.0): its bits, reinterpreted
            bits, ints = (-2 ** 63, "tl.int64") if dtype == torch.float64 else (-2 ** 31, "tl.int32")
            cd = compute_dtype(dtype)
            return self.cse(f"tl.full([1], {bits}, {ints}).to({TL_DTYPES[cd]}, bitcast=True)", cd)
        return CV(literal(value, dtype), compute_dtype(dtype), value=value)

    def pointwise(self, p, vals, out_dtype):
        self.op_names.add(p.name)
        if p.name == "div" and self.reciprocal_divisors and vals[1].literal and out_dtype.is_floating_point:
            # as ATen's CUDA kernel divides by a Python scalar: a product with its reciprocal,
            # computed in opmath from the divisor as a value of the result's dtype
            opmath = compute_dtype(out_dtype)
            divisor = torch.tensor(vals[1].value, dtype=out_dtype).to(opmath)
            p, vals = PRIMITIVES["mul"], [vals[0], self.constant((1 / divisor).item(), opmath)]
        template = p.triton_for(out_dtype)
        helper = _HELPER_CALL.match(template)
        if helper:
            self.helpers.add(helper.group(1))
        if template.startswith("libdevice.") or helper:  # libdevice picks its function by operand types: no bare literals
            vals = [CV(f"tl.full([1], {v}, {TL_DTYPES[v.dtype]})", v.dtype) if v.literal else v for v in vals]
        return self.round(self.cse(template.format(*[v.expr for v in vals]), compute_dtype(out_dtype)), out_dtype)

    def round(self, v, dtype):
        """A value computed in fp32 as the nearest value of half-precision `dtype`: each primitive's
        result is a tensor of its dtype, as eager's op results are (identity for other dtypes)."""
        if compute_dtype(dtype) == dtype or v.literal:
            return v
        helper, _ = ROUND_HELPERS[str(dtype)[6:]]
        self.helpers.add(helper)
        return self.cse(f"{helper}({v})", torch.float32)

    def to_dtype(self, v, dtype):
        if v.literal:
            return self.constant(v.value, dtype)
        if dtype == v.dtype:
            return v
        if dtype == torch.bool:
            return self.cse(f"{v} != 0", torch.bool)
        if compute_dtype(dtype) != dtype:
            # torch converts to half types from float32: ints and doubles are rounded to fp32 first
            v = v if v.dtype == torch.float32 else self.cse(f"{v}.to(tl.float32)", torch.float32)
            return self.round(v, dtype)
        return self.cse(f"{v}.to({TL_DTYPES[dtype]})", dtype)

    def masked(self, conds, body, other, dtype):
        """`body()` where all `conds` hold (its loads masked by them), else `other`."""
        if any(c is sympy.false for c in conds):  # bounds that hold for no index
            return other if isinstance(other, CV) else self.constant(other, dtype)
        conds = [c for c in conds if c is not sympy.true]  # bounds that hold for every index
        if not conds:
            return body()
        cond = self.cse(" & ".join(self.expr(c) for c in conds), torch.bool)
        self.mask_stack.append(cond.expr)
        try:
            value = body()
        finally:
            self.mask_stack.pop()
        other = other if isinstance(other, CV) else self.constant(other, dtype)
        return self.cse(f"tl.where({cond}, {value}, {other})", value.dtype)

    def index_value(self, e, dtype):
        e = sympy.sympify(e)
        if e.is_Integer:
            return self.constant(int(e), dtype)
        if compute_dtype(dtype) == dtype:
            return self.cse(f"({self.expr(e)}).to({TL_DTYPES[dtype]})", dtype)
        return self.round(self.cse(f"({self.expr(e)}).to(tl.float32)", torch.float32), dtype)

    def random(self, kind, stream, flat):
        self.uses_seed = True
        self.op_names.add(kind)
        offset = self.expr(flat)
        if not sympy.sympify(flat).free_symbols:
            offset = f"tl.full([1], {offset}, tl.int32)"
        return self.cse(f"tl.{kind}(seed + {stream}, {offset})", torch.float32)

    # --- kernel structure -------------------------------------------------------------------------
    def block_shape(self):
        return "[XBLOCK, RBLOCK]" if self.kernel.is_reduction else "[XBLOCK]"

    def emit_index_vars(self, dims, index_name, shape):
        inner = 1
        for pos, d in enumerate(reversed(dims)):
            v = sympy.Symbol(index_name)
            size = self.sizevars(shape[d])
            e = FloorDiv(v, self.sizevars(inner)) if inner != 1 else v
            text = self.expr(e) if pos == len(dims) - 1 else f"{self.expr(e)} % {self.divisor(size)}"
            self.emit(f"{'r' if index_name == 'rindex' else 'x'}{d} = {text}")
            inner *= shape[d]

    def store(self, buf, value):
        ptr = self.arg_for(buf, self.out_args, "out_ptr")
        index = store_index(buf, self.kernel.shape, self.red, self.sizevars)
        if not index.free_symbols:  # a single element: let lane 0 of block 0 write it
            index_text, mask = "xindex", "xmask"
        else:
            index_text, mask = self.index_text(index), self.mask_for(index)
        self.store_sites.setdefault(buf.name, set()).add((index_text, mask, self.along_r(index)))
        if value.literal:  # a block of the pointers' shape: [XBLOCK, 1] where they do not vary along r
            along_r = any(s.name[0] == "r" for s in index.free_symbols)
            shape = "[XBLOCK, RBLOCK]" if along_r else "[XBLOCK, 1]" if self.kernel.is_reduction else "[XBLOCK]"
            value = CV(f"tl.full({shape}, {value}, {TL_DTYPES[value.dtype]})", value.dtype)
        self.emit(f"tl.store({ptr} + {index_text}, {value}" + (f", {mask})" if mask else ")"), loc=buf.loc or self.loc)

    def reduction(self, buf, looped):
        value = buf.body(self.vars_for(buf))
        dtype = compute_dtype(buf.dtype)
        shape = self.block_shape()
        with self.at(buf.loc):
            self.op_names.add({"max": "amax", "min": "amin"}.get(buf.reduce, buf.reduce))
            self.combines.add(buf.reduce)
            if value.literal:
                value = CV(f"tl.full({shape}, {value}, {TL_DTYPES[dtype]})", dtype)
            elif self.axes(value.expr) != {"x", "r"}:  # a value constant along an axis of the block
                value = self.broadcast(value, shape, dtype)
            if looped:
                return value
            if self.need_rmask:
                value = self.cse(f"tl.where(rmask, {value}, {neutral(buf.reduce, dtype)})", dtype)
            result = self.cse(REDUCE_FINAL[buf.reduce].format(value) + "[:, None]", dtype)
            self.varies[result.expr] = frozenset("x")
            return self.round(result, buf.dtype)

    def broadcast(self, value, shape, dtype):
        """`value`, constant along an axis of the block, as the whole block. A scalar (a load at a
        constant index and what is computed from it: the sum of a 0-d value) joins it by an
        operation with a neutral splat: tl.broadcast_to takes only equal ranks, and the
        interpreter gives such a load rank 1."""
        if self.axes(value.expr):
            return self.cse(f"tl.broadcast_to({value}, {shape})", dtype)
        op, neutral_value = ("|", "0") if dtype == torch.bool else ("+", "-0.0" if dtype.is_floating_point else "0")
        return self.cse(f"{value} {op} tl.full({shape}, {neutral_value}, {TL_DTYPES[dtype]})", dtype)

    def chunk_setup(self):
        """Before a chunked kernel's row loop: column indices, accumulators; then open the loop."""
        k = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        if self.mode == "chunked_tiles":
            self.emit("rtiles = tl.cdiv(rnumel, RBLOCK)")
            self.emit(f"xpid = {k} // rtiles")
            self.emit(f"rindex = ({k} % rtiles) * RBLOCK + tl.arange(0, RBLOCK)[None, :]")
        else:
            self.emit(f"xpid = {k}")
            self.emit("rindex = tl.arange(0, RBLOCK)[None, :]")
        self.emit("rmask = rindex < rnumel")
        self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                dtype = compute_dtype(buf.dtype)
                acc = self.new_tmp("r")
                rows = "XBLOCK" if self.mode == "chunked_tiles" else "1"
                self.emit(f"{acc} = tl.full([{rows}, RBLOCK], {neutral(buf.reduce, dtype)}, {TL_DTYPES[dtype]})",
                          loc=buf.loc)
                self.accs[buf.name] = acc
        self.hoist = Hoist(len(self.lines), len(self.scopes) + 1, {"r"}, self.indent, self.scopes[-1])
        self.emit("for xoffset in range(xpid * xchunk, xpid * xchunk + xchunk, XBLOCK):")
        self._chunk_loop = self.scope()
        self._chunk_loop.__enter__()
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        self.emit("xmask = xindex < xnumel")
        self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)

    def partial(self, buf):
        """Add this block's rows of a partial to its accumulator."""
        value = buf.body(self.vars_for(buf))
        dtype = compute_dtype(buf.dtype)
        with self.at(buf.loc):
            self.op_names.add({"max": "amax", "min": "amin"}.get(buf.reduce, buf.reduce))
            self.combines.add(buf.reduce)
            if value.literal:
                value = CV(f"tl.full([XBLOCK, RBLOCK], {value}, {TL_DTYPES[dtype]})", dtype)
            elif self.axes(value.expr) != {"x", "r"}:
                value = self.broadcast(value, "[XBLOCK, RBLOCK]", dtype)
            if self.need_xmask:  # rows past the end (last chunk)
                value = self.cse(f"tl.where(xmask, {value}, {neutral(buf.reduce, dtype)})", dtype)
            acc = self.accs[buf.name]
            part = value.expr if self.mode == "chunked_tiles" else REDUCE_AXIS0[buf.reduce].format(value) + "[None, :]"
            self.emit(f"{acc} = {REDUCE_COMBINE[buf.reduce].format(acc, part)}")

    def chunk_finish(self):
        self._chunk_loop.__exit__(None, None, None)
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                ptr = self.arg_for(buf, self.out_args, "out_ptr")
                mask = ", rmask)" if self.need_rmask else ")"
                acc = self.accs[buf.name]
                if self.mode == "chunked_tiles":
                    acc = REDUCE_AXIS0[buf.reduce].format(acc) + "[None, :]"
                self.emit(f"tl.store({ptr} + xpid * rnumel + rindex, {acc}{mask}", loc=buf.loc)

    def row_setup(self, looped):
        k = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        if not self.kernel.is_reduction:
            self.emit(f"xoffset = {k} * XBLOCK")
            self.emit("xindex = xoffset + tl.arange(0, XBLOCK)")
            self.emit("xmask = xindex < xnumel")
            self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)
            return
        self.emit(f"xoffset = {k} * XBLOCK")
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        self.emit("xmask = xindex < xnumel")
        self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)
        if not looped:
            self.emit("rindex = tl.arange(0, RBLOCK)[None, :]")
            self.emit("rmask = rindex < rnumel")
            self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
            self.hoist = Hoist(len(self.lines), 1, {"x", "r"}, self.indent, self.scopes[-1])

    @contextlib.contextmanager
    def row_loop(self):
        self.emit("for roffset in range(0, rnumel, RBLOCK):")
        with self.scope():
            self.emit("rindex = roffset + tl.arange(0, RBLOCK)[None, :]")
            self.emit("rmask = rindex < rnumel")
            self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
            yield

    def is_row_value(self, buf):
        """A per-row value (reduction result, or a pointwise buffer over the kept dims only)."""
        return self.kernel.is_reduction and (buf.kind == "reduction" or (
            buf.shape != self.kernel.shape and (buf.shape in row_shapes(self.kernel.shape, self.red) or
                                                moved_row_vars(buf.shape, self.kernel.shape, self.red) is not None)))

    def body(self):
        looped = self.mode == "looped"
        if self.chunk:
            self.chunk_setup()
        else:
            self.row_setup(looped)
        stores = self.kernel.stores
        epilogue_open = None
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                self.partial(buf)
            elif buf.kind == "reduction":
                epilogue_open = self.close(epilogue_open)
                if looped:
                    if buf.name not in self.values:
                        self.looped_reductions(*self._looped_run(buf))
                else:
                    self.values[buf.name] = self.reduction(buf, looped=False)
                if buf.name in stores:
                    self.store(buf, self.values[buf.name])
            elif self.is_row_value(buf):
                epilogue_open = self.close(epilogue_open)
                with self.at(buf.loc):
                    self.values[buf.name] = buf.body(self.vars_for(buf))
                if buf.name in stores:
                    self.store(buf, self.values[buf.name])
            elif buf.name in stores:
                if looped and epilogue_open is None:
                    epilogue_open = self.row_loop()
                    epilogue_open.__enter__()
                self.store(buf, self.inline(buf))
        self.close(epilogue_open)
        if self.chunk:
            self.chunk_finish()

    def close(self, loop):
        if loop is not None:
            loop.__exit__(None, None, None)
        return None

    def _independent_run(self, buf):
        """`buf` and the reductions right after it in the kernel that read none of them (directly
        or through the kernel's pointwise buffers): one loop over the row computes them all, so a
        row is read once for sum(x) and sum(x * x) (BatchNorm's statistics, its backward's sums)."""
        nodes = self.kernel.nodes
        run = [buf]
        for nxt in nodes[nodes.index(buf) + 1:]:
            if nxt.name in self.values:  # computed in an earlier loop (an online softmax's sum)
                continue
            if nxt.kind != "reduction" or self._reads_any(nxt, {b.name for b in run}):
                break
            run.append(nxt)
        return run

    def _looped_run(self, buf):
        """(the reductions computed in one loop with `buf`, the (max, sum) pairs among them that
        loop computes online): `_independent_run`, and where `buf` is a max whose sum of
        exp(x - max) follows (softmax's denominator, cross-entropy's), that sum too, and the
        reductions after it that read neither. A 50257-word row is then read once, not twice."""
        run = self._independent_run(buf)
        partner = self._online_partner(buf)
        if partner is None:
            return run, ()
        run.append(partner)
        # later reductions join while they read no reduction still to compute (the run's, or one
        # passed over between the max and its sum)
        nodes = self.kernel.nodes
        pending = {n.name for n in nodes if n.kind == "reduction" and n.name not in self.values}
        for nxt in nodes[nodes.index(partner) + 1:]:
            if nxt.kind == "reduction":
                if self._reads_any(nxt, pending):
                    break
                run.append(nxt)
        return run, ((buf, partner),)

    def _online_partner(self, m):
        """The first reduction after max `m` that reads it, if it sums exp(x - m) over m's own x."""
        if m.reduce != "max" or not m.dtype.is_floating_point:
            return None
        nodes = self.kernel.nodes
        s = next((n for n in nodes[nodes.index(m) + 1:] if n.kind == "reduction" and self._reads_any(n, {m.name})),
                 None)
        if s is None or s.reduce != "sum" or (s.in_shape, s.red_dims) != (m.in_shape, m.red_dims):
            return None
        tree = _Tree(self)
        x, summand = tree.of(m), tree.of(s)
        if summand[0] == "exp" and summand[1][0][0] == "sub":
            a, b = summand[1][0][1]
            if a == x and b[0] == "load" and b[1] == m.name:
                return s
        return None

    def _reads_any(self, buf, names):
        todo, seen = [buf], set()
        while todo:
            for src in self._direct_reads(todo.pop()):
                if src.name in names:
                    return True
                dep = self.group.get(src.name)
                if dep is not None and dep.kind == "pointwise" and src.name not in seen:
                    seen.add(src.name)
                    todo.append(dep)
        return False

    def looped_reductions(self, bufs, online=()):
        """Reductions of a looped kernel in one loop over the row: none reads another, except the
        sum of each (max, sum) pair in `online`, which sums exp(x - max) over the max's own x. Each
        lane keeps its running max m and its sum s relative to m, rescaled by exp(m - m') as m
        grows to m' (online softmax); after the loop the lanes' sums are rescaled to the row's max.
        A max of -inf so far stands as 0 in those exponents (exp(-inf - -inf) would be NaN), and a
        row all -inf sums to NaN, as exp(x - max) does there in eager; NaN and +inf propagate."""
        sums = {s.name: m for m, s in online}
        accs = {}
        for buf in bufs:
            dtype = compute_dtype(buf.dtype)
            accs[buf.name] = self.new_tmp("xr")
            self.emit(f"{accs[buf.name]} = tl.full([XBLOCK, RBLOCK], {neutral(buf.reduce, dtype)}, "
                      f"{TL_DTYPES[dtype]})", loc=buf.loc)
        with self.row_loop():
            for buf in bufs:
                acc = accs[buf.name]
                if buf.name in sums:  # updated with its max, below
                    continue
                with self.at(buf.loc):
                    value = self.reduction(buf, looped=True)
                    combined = REDUCE_COMBINE[buf.reduce].format(acc, value)
                    partner = next((s for m, s in online if m is buf), None)
                    if partner is None:
                        self.emit(f"{acc} = tl.where(rmask, {combined}, {acc})")
                        continue
                    self.op_names.add("exp")
                    grown, shift, total = self.new_tmp("xr"), self.new_tmp("xr"), accs[partner.name]
                    self.emit(f"{grown} = tl.where(rmask, {combined}, {acc})")
                    self.emit(f'{shift} = tl.where({grown} == float("-inf"), 0.0, {grown})')
                    self.emit(f"{total} = tl.where(rmask, {total} * tl.exp({acc} - {shift}) + "
                              f"tl.exp({value} - {shift}), {total})")
                    self.emit(f"{acc} = {grown}")
        for buf in bufs:
            acc = accs[buf.name]
            with self.at(buf.loc):
                dtype = compute_dtype(buf.dtype)
                m = sums.get(buf.name)
                if m is None:
                    result = self.cse(REDUCE_FINAL[buf.reduce].format(acc) + "[:, None]", dtype)
                else:
                    row_max = self.values[m.name]
                    shift = self.cse(f'tl.where({row_max} == float("-inf"), 0.0, {row_max})', dtype)
                    total = self.cse(f"tl.sum({acc} * tl.exp({accs[m.name]} - {shift}), 1)[:, None]", dtype)
                    result = self.cse(f'tl.where({row_max} == float("-inf"), float("nan"), {total})', dtype)
                self.varies[result.expr] = frozenset("x")
                self.values[buf.name] = self.round(result, buf.dtype)

    # --- the whole kernel -------------------------------------------------------------------------
    def kernel_name(self):
        kind = "red" if self.kernel.is_reduction else "poi"
        names = sorted(self.op_names - {"convert", "copy", "stop_gradient"}) or sorted(self.op_names) or ["copy"]
        if len(names) > 6:
            names = names[:6] + ["etc"]
        return f"fl_{kind}_fused_{'_'.join(names)}_{self.index_in_graph}"

    def drop_unused_loop_vars(self):
        """Per-dimension variables are emitted up front; those no index ended up using go."""
        definition = re.compile(r"([xr]\d+) = ")
        code = [text.split("  # ", 1)[0] for _, text in self.lines]
        used = set(_BLOCK_NAMES.findall(" ".join(definition.sub("", c, count=1) for c in code)))
        self.lines = [line for line, c in zip(self.lines, code)
                      if not definition.match(c) or definition.match(c).group(1) in used]
        # size arguments only those lines used go too; the rest are renumbered
        code = " ".join(text.split("  # ", 1)[0] for _, text in self.lines)
        kept = [(sym, name) for sym, name in self.size_args.items() if re.search(rf"\b{name}\b", code)]
        renames = {name: f"ks{i}" for i, (_, name) in enumerate(kept)}
        self.size_args = {sym: renames[name] for sym, name in kept}
        if any(old != new for old, new in renames.items()):
            pattern = re.compile(r"\bks\d+\b")
            self.lines = [(indent, pattern.sub(lambda m: renames.get(m.group(0), m.group(0)), text))
                          for indent, text in self.lines]

    def launch_params(self):
        """(parameter, what the wrapper passes) in the kernel's parameter order: tensors (their
        buffer names), the seed, size values, then the sizes xnumel[, rnumel[, xchunk]]."""
        params = [(p, b) for b, p in [*self.in_args.items(), *self.out_args.items()]]
        params += [("seed", "seed")] if self.uses_seed else []
        params += [(p, int(self.sizevars.values[s])) for s, p in self.size_args.items()]
        params += [("xnumel", self.xnumel)] + ([("rnumel", self.rnumel)] if self.kernel.is_reduction else [])
        return params + ([("xchunk", self.chunk)] if self.chunk else [])

    def launch_signature(self):
        """What each launch passes: (tensors' buffer names, scalars: "seed" and size values, sizes)."""
        values = [v for _, v in self.launch_params()]
        n_tensors, n_sizes = len(self.in_args) + len(self.out_args), 1 + self.kernel.is_reduction + bool(self.chunk)
        return values[:n_tensors], values[n_tensors:-n_sizes], tuple(values[-n_sizes:])

    def generate(self):
        with use_handler(self):
            self.body()
        self.drop_unused_loop_vars()
        name = self.kernel_name()
        params = [p for p, _ in self.launch_params()]
        params += ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.kernel.is_reduction else [])
        header = ["import triton", "import triton.language as tl", "from triton.language.extra import libdevice", ""]
        for r in sorted(self.combines & COMBINE_FNS.keys()):
            header += ["", "@triton.jit", *COMBINE_FNS[r].split("\n"), ""]
        sources = {**TRITON_HELPERS, **dict(ROUND_HELPERS.values())}
        for h in sorted(self.helpers):
            header += ["", "@triton.jit", *sources[h].split("\n"), ""]
        # a fresh seed every call: Triton must not compile a variant per seed's divisibility
        jit = '@triton.jit(do_not_specialize=["seed"])' if self.uses_seed else "@triton.jit"
        header += ["", jit, f"def {name}({', '.join(params)}):"]
        if self.pdl:  # this kernel's programs may start while the kernel before it still runs
            header[3:3] = ["from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait"]
            header += ["    gdc_wait()  # until the kernel before this one has finished and its writes are visible",
                       "    gdc_launch_dependents()  # the next kernel may start its programs as ours finish"]
        body = ["    " * indent + text for indent, text in self.lines]
        return name, "\n".join(header + body) + "\n"


class _Tree:
    """Ops handler that evaluates a kernel node's body to a tree of tuples (op, operands, dtype),
    the kernel's pointwise nodes inlined and identities dropped: two bodies computing the same
    value from the same loads give equal trees (KernelWriter._online_partner)."""

    def __init__(self, writer):
        self.writer = writer
        self.sizevars, self.ranges = writer.sizevars, writer.ranges  # (what bodies ask of a handler)

    def of(self, buf):
        with use_handler(self):
            return buf.body(self.writer.vars_for(buf))

    def at(self, loc):
        return contextlib.nullcontext()

    def load(self, buf, index):
        dep = self.writer.group.get(buf.name)
        if dep is not None and dep.kind == "pointwise":
            return dep.body(self.writer.vars_for(dep))
        return ("load", buf.name, sympy.expand(index))

    def constant(self, value, dtype):
        return ("constant", value, dtype)

    def pointwise(self, p, vals, out_dtype):
        if p.name in ("copy", "stop_gradient"):
            return vals[0]
        return (p.name, tuple(vals), out_dtype)

    def to_dtype(self, v, dtype):
        return v if isinstance(v, tuple) and v[-1] == dtype else ("to", (v,), dtype)

    def masked(self, conds, body, other, dtype):
        return ("masked", (tuple(conds), body(), other), dtype)

    def index_value(self, e, dtype):
        return ("index", sympy.expand(e), dtype)

    def random(self, kind, stream, flat):
        return ("random", object(), None)  # equal to no other value


def memory_extent(buf):
    """Elements between a buffer's first and last element (what an offset into it can reach)."""
    return 1 + sum((s - 1) * abs(st) for s, st in zip(buf.shape, buf.stride)) if buf.numel() else 0


def generate_kernel(kernel: FusedKernel, index: int, sizevars, dynamic_values=frozenset(), pdl=False, cuda=False):
    """`pdl`: the kernel waits for the one before it (gdc_wait) and is launched with programmatic
    dependent launch, so its launch overlaps the previous kernel's last programs (Hopper and later).
    `cuda`: its tensors are on a CUDA device, whose ATen kernels' semantics it follows."""
    writer = KernelWriter(kernel, index, sizevars, dynamic_values, pdl, cuda)
    name, source = writer.generate()
    if not writer.int64 and any(memory_extent(b) >= 2 ** 31 for b in writer.buffers.values()):
        writer = KernelWriter(kernel, index, sizevars, dynamic_values, pdl, cuda)
        writer.int64 = True
        name, source = writer.generate()
    return name, source, writer
