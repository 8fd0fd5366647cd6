"""Triton expressions: the ops handler half of a kernel writer (codegen/triton.py's KernelWriter).

Loop bodies call it (lower/ir.py `OpsHandler`) and it appends one line per operation
(`tmp7 = tmp3 * tmp5  # model.py:12 ...`), common subexpressions reused: loads (masked where the
kernel's sizes need it, at `xindex` where the index is the kernel's own row-major position),
constants, each pointwise primitive as its Triton spelling (ops/primitives.py), conversions and
index values. Half-precision values are computed in fp32 (loads upcast) and each primitive's
result is rounded to its half type, as eager's op results are (`round`). Sizes, strides and
offsets are kernel arguments (`ks0, ks1, ...`).
"""
from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
from dataclasses import dataclass

import sympy
import torch

from ..lower.indexing import FloorDiv, ModIndex
from ..lower.ir import OpsHandler, compute_dtype, contiguous_strides, use_handler
from ..ops.primitives import PRIMITIVES
from ..schedule.fusion import FusedKernel, ReadRecorder, keep_shape, loop_ranges, loop_vars, node_vars
from .launcher import ROUND_HELPERS


# kernels of at least this many elements divide their indices by literals (KernelWriter.divisor)
LITERAL_DIVISORS_MIN = 1 << 26


TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
             torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
             torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


# a primitive's spelling that calls one of the kernel-local helpers of ops/primitives.py
_HELPER_CALL = re.compile(r"(fl_\w+)\(")


# names in a kernel line whose values vary over the block: temporaries, loop variables, masks
BLOCK_NAMES = re.compile(r"\b(tmp\d+|[xr]\d+|[xr]index|[xr]mask)\b")


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


class TritonExpressions(OpsHandler):
    """The kernel's lines and what they name: temporaries (CSE'd by their text, per scope), its
    tensor and size arguments, the loads and stores the wrapper asks about. The kernel's loop
    structure (`mode`, `need_xmask`, `need_rmask`) is KernelWriter's, which extends this."""

    def __init__(self, kernel: FusedKernel, sizevars, dynamic_values, reciprocal_divisors):
        self.kernel = kernel
        self.sizevars = sizevars
        self.red = kernel.red_dims or ()
        shape = kernel.shape
        self.ranges = loop_ranges(shape, self.red)
        self.x_dims = [d for d, s in enumerate(shape) if s != 1 and d not in self.red]
        self.r_dims = [d for d, s in enumerate(shape) if s != 1 and d in self.red]
        self.xnumel = math.prod(s for d, s in enumerate(shape) if d not in self.red)
        self.rnumel = math.prod(shape[d] for d in self.red) if kernel.is_reduction else 1
        self.need_xmask = self.need_rmask = False  # (KernelWriter's, by its loop structure)
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
        for name in BLOCK_NAMES.findall(text):
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
        if e.is_Pow and e.exp.is_Integer and e.exp > 0:  # a dynamic size squared (H·W of a square image)
            return "(" + " * ".join([self.expr(e.base)] * int(e.exp)) + ")"
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

    def block_shape(self):
        return "[XBLOCK, RBLOCK]" if self.kernel.is_reduction else "[XBLOCK]"
