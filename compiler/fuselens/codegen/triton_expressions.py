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

import math
import re
from dataclasses import dataclass

import sympy
import torch

from ..lower.indexing import expanded
from ..lower.ir import compute_dtype, contiguous_strides
from ..ops.primitives import PRIMITIVES
from ..schedule.fusion import FusedKernel, keep_shape, loop_vars
from .kernel_expressions import CV, KernelExpressions, loc_comment
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


class TritonExpressions(KernelExpressions):
    """KernelExpressions in Triton: size arguments, masks, half-precision rounding, libdevice. The
    kernel's loop structure (`mode`, `need_xmask`, `need_rmask`) is KernelWriter's, which extends this."""

    def __init__(self, kernel: FusedKernel, sizevars, dynamic_values, reciprocal_divisors):
        super().__init__(kernel, sizevars, dynamic_values)
        self.need_xmask = self.need_rmask = False  # (KernelWriter's, by its loop structure)
        self._row_major = None  # (index of the kernel's row, of its element), row-major
        self.reciprocal_divisors = reciprocal_divisors  # divide by a number as ATen's CUDA kernels do
        self.fixed_sizes: frozenset = frozenset()  # size symbols whose values divisors may be (`divisor`)
        self.divided_by: set = set()  # size symbols the kernel divides by as arguments
        self.helpers: set[str] = set()  # the primitives' Triton helpers (TRITON_HELPERS) the kernel calls
        self.varies: dict[str, frozenset] = {}  # temporary -> which block axes ("x", "r") it varies along
        self.hoist: Hoist | None = None

    # --- emission helpers -------------------------------------------------------------------------
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

    def divisor(self, d) -> str:
        """A divisor of an index: its value where its sizes are static (`static_size`) and either
        the kernel has at least LITERAL_DIVISORS_MIN elements or they are `fixed_sizes`: the same
        in every kernel of the program that shares this one's compile (`fixed_divisors` in
        codegen/triton.py). Division by a constant compiles to a multiply and a shift (by a power
        of two, a shift or a mask); by a kernel argument, to ~20 integer instructions an element,
        which left GPT-2's loss gradient (206M elements, three divisions each) at 1.1 TB/s and
        GPT-J's rotary embedding (4M elements, eight divisions) at 6x Inductor's time. Sizes that
        differ between kernels of one source stay arguments, so those kernels (a ResNet's stages)
        share one compile: with literal divisors everywhere, ResNet-50's cold first call took 4.7 s
        instead of 2.8, its step as long."""
        d = sympy.sympify(d)
        elements = self.xnumel * (self.rnumel if self.kernel.is_reduction else 1)
        # (a literal where the divisor's value is the same at every call: a kernel whose divisor
        # derives from a dynamic size is shared by the graph's lengths, sizes as arguments)
        if all(s.name[0] not in "xr" and self.static_size(self.sizevars.values[s]) for s in d.free_symbols) and \
                (elements >= LITERAL_DIVISORS_MIN or d.free_symbols <= self.fixed_sizes):
            return str(self.sizevars.evaluate(d))
        self.divided_by |= {s for s in d.free_symbols if s.name[0] not in "xr"}
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
            if a.free_symbols == b.free_symbols and expanded(a - b) == 0:
                return True
            # sizes by their values: a view's stride s0*s1 (BERT's [4096, 3072] GEMM output read as
            # [32, 128, 3072]) is the row-major stride s2 of the same value, and `xindex` then
            # saves three divisions an element. Dynamic sizes too: a program is built for one
            # input shape, so what holds at its values holds wherever its kernels run, and a
            # length where it does not builds other text (a dynamic BERT's GeLU had divided its
            # flat position by the length twice an element: S*3072 is a size of its own value)
            loops = lambda e: {v for v in e.free_symbols if v.name[0] in "xr"}  # noqa: E731
            sizes = (a - b).free_symbols - loops(a) - loops(b)
            # (xreplace of the sizes it holds: subs of every size of the graph took Swin-T's
            # training compile 27 of its 31 s on an H200; a position read from a tensor is none)
            return loops(a) == loops(b) and all(s in self.sizevars.values for s in sizes) and \
                expanded((a - b).xreplace({s: self.sizevars.values[s] for s in sizes})) == 0
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

    def mask_for(self, index) -> str | None:
        names = {s.name[0] for s in sympy.sympify(index).free_symbols if s.name[0] in "xr"}
        parts = []
        if "x" in names and self.need_xmask:
            parts.append("xmask")
        if "r" in names and self.need_rmask:
            parts.append("rmask")
        parts += self.mask_stack
        return " & ".join(parts) if parts else None

    # --- the ops handler --------------------------------------------------------------------------
    def load(self, buf, index):
        own = self.own_value(buf)
        if own is not None:
            return own
        ptr = self.arg_for(buf, self.in_args, "in_ptr")
        # a constant index is a broadcast element, always in bounds: a scalar load takes no mask
        mask = self.mask_for(index) if sympy.sympify(index).free_symbols else None
        index_text = self.index_text(index)
        self.load_sites.setdefault(buf.name, set()).add(self.site(index, mask))
        text = f"tl.load({ptr} + {index_text}" + (f", {mask}, other=0)" if mask else ")")
        if compute_dtype(buf.dtype) != buf.dtype:
            text += ".to(tl.float32)"
        return self.held(self.cse(text, compute_dtype(buf.dtype), hoist=True), buf.dtype)

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
        if p.name == "div" and compute_dtype(out_dtype) == torch.float32 and self.kernel.is_reduction and \
                not vals[1].literal and self.axes(vals[1].expr) == {"x"} and "r" in self.axes(vals[0].expr):
            return self.result(p, vals, self.row_quotient(*vals), out_dtype)
        template = p.triton_for(out_dtype)
        helper = _HELPER_CALL.match(template)
        if helper:
            self.helpers.add(helper.group(1))
        if template.startswith("libdevice.") or helper:  # libdevice picks its function by operand types: no bare literals
            vals = [CV(f"tl.full([1], {v}, {TL_DTYPES[v.dtype]})", v.dtype) if v.literal else v for v in vals]
        return self.result(p, vals, self.cse(template.format(*[v.expr for v in vals]), compute_dtype(out_dtype)),
                           out_dtype)

    def row_quotient(self, a, b):
        """a / b correctly rounded (eager's IEEE division) for fp32 values a along a row and b, the
        row's own (a softmax's sum): b's reciprocal once a row, then a product and Markstein's
        correction a element, r = a - q b exactly (an FMA) and q + r / b rounded once (an FMA),
        which is the rounded quotient for normal operands (checked on 10^9 pairs, the sign of
        zero included, bench/NOTES.md 89). An IEEE division an element (a reciprocal on the
        special-function unit and a fix-up) took a softmax of 65536 rows of 512 from 72 to 87 us
        on an H100. Where an operand of the block is outside the correction's range (a or b
        subnormal, infinite, NaN, or their quotient near the ends of fp32's range), the block
        divides as IEEE does."""
        y = self.cse(f"tl.div_rn(1.0, {b})", torch.float32)
        q = self.cse(f"{a} * {y}", torch.float32)
        r = self.cse(f"tl.fma({q} * -1.0, {b}, {a})", torch.float32)
        corrected = self.cse(f"tl.where({a} == 0, {q}, tl.fma({r}, {y}, {q}))", torch.float32)
        size = lambda v, lo, hi: f"((tl.abs({v}) >= {2.0 ** lo!r}) & (tl.abs({v}) <= {2.0 ** hi!r}))"  # noqa: E731
        exact = f"(({a} == 0) | {size(a, -100, 100)}) & {size(b, -24, 24)}"
        masks = [m for m, needed in (("xmask", self.need_xmask), ("rmask", self.need_rmask)) if needed]
        if masks:  # (elements past the tensor's ends, computed from padding, need no fallback)
            exact = f"({exact}) | ~({' & '.join(masks)})"
        exact = self.cse(exact, torch.bool)
        out = self.new_tmp(self.axes(corrected.expr))
        self.emit(f"{out} = {corrected}")
        self.emit(f"if tl.min({exact}.to(tl.int32)) == 0:")
        self.indent += 1
        self.emit(f"{out} = tl.where({exact}, {out}, tl.div_rn({a}, {b}))")
        self.indent -= 1
        return CV(out, torch.float32)

    def round_text(self, v, dtype):
        helper, _ = ROUND_HELPERS[str(dtype)[6:]]
        self.helpers.add(helper)
        return f"{helper}({v})"

    def cast_text(self, v, dtype):
        return f"{v}.to({TL_DTYPES[dtype]})"

    def select(self, cond, value, other):
        return self.selected(value, other, self.cse(f"tl.where({cond}, {value}, {other})", value.dtype))

    def random(self, kind, stream, flat):
        self.uses_seed = True
        self.op_names.add(kind)
        offset = self.expr(flat)
        if not sympy.sympify(flat).free_symbols:
            offset = f"tl.full([1], {offset}, tl.int32)"
        return self.cse(f"tl.{kind}(seed + {stream}, {offset})", torch.float32)

    def indirect(self, v):
        # a position the same for the whole block (a decode step's, or a constant) made a block: the
        # store's mask combines the range check with xmask, and Triton's interpreter refuses a mask
        # combining a block's and a scalar's. In a reduction kernel, a column ([XBLOCK, 1]): read
        # along r it broadcasts, and read in an epilogue it keeps the column shape of the reduced
        # values (a whole tile there made the epilogue's store fail: Qwen2's embedded residual)
        if v.literal or not self.varies.get(v.expr):
            shape = "[XBLOCK, 1]" if self.kernel.is_reduction else "[XBLOCK]"
            text = f"tl.full({shape}, {v}, {TL_DTYPES[v.dtype]})" if v.literal else f"tl.broadcast_to({v}, {shape})"
            v = self.cse(text, v.dtype)
            self.varies[v.expr] = frozenset("x")
        return super().indirect(v)

    def block_shape(self):
        return "[XBLOCK, RBLOCK]" if self.kernel.is_reduction else "[XBLOCK]"
