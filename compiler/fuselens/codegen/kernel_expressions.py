"""What every kernel writer's expressions share, whatever the target language (Triton,
codegen/triton_expressions.py; C++, codegen/cpp_expressions.py): the kernel's domain, its lines
(each with the source line it came from), scopes of common subexpressions, its tensor arguments,
and the inlining of the kernel's own pointwise buffers into whatever reads them.
"""
from __future__ import annotations

import contextlib
import linecache
import math
import os

import sympy
import torch

from ..lower.indexing import FloorDiv, ModIndex, expanded
from ..lower.ir import OpsHandler, compute_dtype, use_handler
from ..schedule.fusion import FusedKernel, ReadRecorder, loop_ranges, node_vars


def loc_comment(loc, marker="#"):
    if not loc:
        return ""
    filename, line = loc[0], loc[1]
    text = linecache.getline(filename, line).strip()
    if len(text) > 60:
        text = text[:57] + "..."
    return f"  {marker} {os.path.basename(filename)}:{line}" + (f"  {text}" if text else "")


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


class KernelExpressions(OpsHandler):
    """A kernel's lines and what they name: temporaries (common subexpressions by their text, per
    scope), its tensor arguments, the loads and stores the wrapper asks about, the kernel's own
    pointwise buffers inlined where read. The target's subclass writes the expressions (`cse`,
    `load`, ...); `COMMENT` starts its comments."""
    COMMENT = "#"
    FLOOR_DIV = "//"  # (of non-negative indices)
    AND = " & "  # (of conditions)

    def __init__(self, kernel: FusedKernel, sizevars, dynamic_values):
        self.kernel = kernel
        self.sizevars = sizevars
        self.dynamic_values = dynamic_values  # lower/ir.py DynamicValues
        self.red = kernel.red_dims or ()
        shape = kernel.shape
        self.ranges = loop_ranges(shape, self.red)
        self.x_dims = [d for d, s in enumerate(shape) if s != 1 and d not in self.red]
        self.r_dims = [d for d, s in enumerate(shape) if s != 1 and d in self.red]
        self.xnumel = math.prod(s for d, s in enumerate(shape) if d not in self.red)
        self.rnumel = math.prod(shape[d] for d in self.red) if kernel.is_reduction else 1
        self.group = {n.name: n for n in kernel.nodes}
        self.values: dict = {}  # reduction results and per-row values, by buffer name
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
        self.op_names: set[str] = set()
        self.source_lines: set = set()
        self._reads: dict[str, list] = {}  # buffer name -> the buffers its body loads
        self.indirect_values: dict = {}  # symbol of an index read from a tensor -> its value's name (`indirect`)
        # temporary -> the half-precision dtype whose values it holds exactly (loaded from a tensor of
        # it, rounded to it, or selected, negated, ... from such values): rounding it to that dtype
        # again is the identity, and costs ALU in kernels that are ALU-bound (bf16 pointwise chains)
        self.half_values: dict[str, torch.dtype] = {}

    def static_size(self, value) -> bool:
        """Whether a size of this value is the same at every call of the program's kernels: any
        size of a static graph; in a graph with dynamic sizes, one of an input's static dims
        (and of no dynamic one)."""
        return not self.dynamic_values or int(value) in self.dynamic_values.static

    # --- emission helpers -------------------------------------------------------------------------
    def emit(self, text, loc=None):
        loc = loc if loc is not None else self.loc
        if loc:
            self.source_lines.add((loc[0], loc[1]))
        self.lines.append((self.indent, text + loc_comment(loc, self.COMMENT)))

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

    @staticmethod
    def along_r(index) -> bool:
        return any(s.name[0] == "r" for s in sympy.sympify(index).free_symbols)

    def site(self, index, mask):
        """A load's or store's entry in `load_sites`/`store_sites`: its index with every size by its
        value, its mask, whether it is along r. (One size symbol may stand for the product of
        others: a GEMM's (4096, 4096) result read as (8, 512, 4096) is the element written. Dynamic
        sizes too: what the sites decide, an output written over an input, is the wrapper's, and
        a program is built per input shape.)"""
        return expanded(sympy.sympify(index).xreplace(self.sizevars.values)), mask, self.along_r(index)

    # --- index expressions ---------------------------------------------------------------------
    def expr(self, e) -> str:
        """Print an index expression (loop variables, sizes, `FLOOR_DIV`, `%`, sums, products,
        comparisons); size symbols are `size_text`'s."""
        e = sympy.sympify(e)
        if e.is_Integer:
            return self.integer_text(int(e))
        if e.is_Symbol:
            if e in self.indirect_values:
                return self.indirect_values[e]
            return e.name if e.name[0] in "xr" else self.size_text(e)
        if isinstance(e, FloorDiv):
            return f"({self.expr(e.args[0])} {self.FLOOR_DIV} {self.divisor(e.args[1])})"
        if isinstance(e, ModIndex):
            return f"({self.expr(e.args[0])} % {self.divisor(e.args[1])})"
        if e.is_Add:
            # each term printed once, unsigned, and the terms in the order of that text (sorting by
            # sympy's str of each term cost more than the printing)
            signed = [(t.as_coeff_Mul()[0] < 0, t) for t in e.args]
            terms = sorted((t.is_Integer, self.expr(-t if negative else t), negative) for negative, t in signed)
            out = ("-" if terms[0][2] else "") + terms[0][1]
            for _, text, negative in terms[1:]:
                out += f" - {text}" if negative else f" + {text}"
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

    def size_text(self, e) -> str:
        """A size symbol: a kernel argument (`ks0, ks1, ...`)."""
        if e not in self.size_args:
            self.size_args[e] = f"ks{len(self.size_args)}"
        return self.size_args[e]

    def integer_text(self, n: int) -> str:
        return str(n)

    def divisor(self, d) -> str:
        return self.expr(d)

    def arg_for(self, buf, table, prefix):
        if buf.name not in table:
            table[buf.name] = f"{prefix}{len(table)}"
            self.buffers[buf.name] = buf
        return table[buf.name]

    def vars_for(self, buf):
        return node_vars(buf, self.kernel.shape, self.red, self.sizevars)

    def indirect(self, v):
        if v.literal:  # (a position known when compiling: its range checks fold)
            return sympy.Integer(int(v.value))
        sym = sympy.Symbol(f"indirect{len(self.indirect_values)}", integer=True)
        self.indirect_values[sym] = v.expr
        return sym

    def scatter_parts(self, value):
        """A scatter's (value, index text, its conditions' texts: the index in range) from its body's
        result `value`, for the target's store (lower/ir.py ComputedBuffer)."""
        self.op_names.add("scatter")
        value, index, conds = value
        conds = [self.constant(False, torch.bool).expr if c is sympy.false else self.expr(c)
                 for c in conds if c is not sympy.true]
        return value, index, self.expr(index), conds

    # --- the kernel's own buffers, inlined ---------------------------------------------------------
    def own_value(self, buf):
        """The value of a buffer of the kernel's own (its register, or its body inlined); None for
        a tensor argument, which is loaded."""
        if buf.name not in self.group:
            return None
        return self.values[buf.name] if buf.name in self.values else self.inline(self.group[buf.name])

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

    # --- naming ---------------------------------------------------------------------------------------
    def round(self, v, dtype):
        """A value computed in float32 as the nearest value of half-precision `dtype`: each
        primitive's result is a tensor of its dtype, as eager's op results are (identity for other
        dtypes and for values of `dtype` already). The target spells the rounding (`round_text`)."""
        if compute_dtype(dtype) == dtype or v.literal or self.half_values.get(v.expr) == dtype:
            return v
        out = self.cse(self.round_text(v, dtype), torch.float32)
        self.half_values[out.expr] = dtype
        return out

    def holds(self, v, dtype) -> bool:
        """Whether float value `v` is a value of half-precision `dtype` (rounding it changes nothing)."""
        if v.literal:
            value = v.value
            return not isinstance(value, bool) and (math.isnan(value) or torch.tensor(value, dtype=dtype).item() == value)
        return self.half_values.get(v.expr) == dtype

    def result(self, p, vals, value, out_dtype):
        """`value`, primitive p's result computed in float32, as a value of `out_dtype`: rounded,
        unless p's result is one of its operands' values or their negation (`keeps_values`) and
        each float operand is a value of `out_dtype` already."""
        if compute_dtype(out_dtype) == out_dtype:
            return value
        if p.keeps_values and all(self.holds(v, out_dtype) for v in vals if v.dtype.is_floating_point):
            self.half_values[value.expr] = out_dtype
            return value
        return self.round(value, out_dtype)

    def selected(self, value, other, out):
        """`out`, a selection of `value` or `other`: a value of their half dtype where both are."""
        dtype = self.half_values.get(value.expr)
        if dtype is not None and self.holds(other, dtype):
            self.half_values[out.expr] = dtype
        return out

    def held(self, value, load_dtype):
        """`value` loaded from a tensor of `load_dtype`, marked as its values where that is a half type."""
        if compute_dtype(load_dtype) != load_dtype:
            self.half_values[value.expr] = load_dtype
        return value

    def to_dtype(self, v, dtype):
        if v.literal:
            return self.constant(v.value, dtype)
        if dtype == v.dtype:
            return v
        if dtype == torch.bool:
            return self.cse(f"{v} != 0", torch.bool)
        if compute_dtype(dtype) != dtype:
            # torch converts to half types from float32: ints and doubles are rounded to float32 first
            v = v if v.dtype == torch.float32 else self.cse(self.cast_text(v, torch.float32), torch.float32)
            return self.round(v, dtype)
        return self.cse(self.cast_text(v, dtype), dtype)

    def index_value(self, e, dtype):
        e = sympy.sympify(e)
        if e.is_Integer:
            return self.constant(int(e), dtype)
        if compute_dtype(dtype) == dtype:
            return self.cse(self.cast_text(f"({self.expr(e)})", dtype), dtype)
        return self.round(self.cse(self.cast_text(f"({self.expr(e)})", torch.float32), torch.float32), dtype)

    def masked(self, conds, body, other, dtype):
        """`body()` where all `conds` hold (its loads masked by them), else `other` (`select`)."""
        if any(c is sympy.false for c in conds):  # bounds that hold for no index
            return other if isinstance(other, CV) else self.constant(other, dtype)
        conds = [c for c in conds if c is not sympy.true]  # bounds that hold for every index
        if not conds:
            return body()
        cond = self.cse(self.AND.join(self.expr(c) for c in conds), torch.bool)
        self.mask_stack.append(cond.expr)
        try:
            value = body()
        finally:
            self.mask_stack.pop()
        return self.select(cond, value, other if isinstance(other, CV) else self.constant(other, dtype))

    def kernel_name(self):
        kind = "red" if self.kernel.is_reduction else "poi"
        names = sorted(self.op_names - {"convert", "copy", "stop_gradient"}) or sorted(self.op_names) or ["copy"]
        if len(names) > 6:
            names = names[:6] + ["etc"]
        return f"fl_{kind}_fused_{'_'.join(names)}_{self.index_in_graph}"
