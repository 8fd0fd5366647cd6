"""C++ expressions: the ops handler half of a C++ kernel writer (codegen/cpp.py's CppKernelWriter).

Loop bodies call it (lower/ir.py `OpsHandler`) and it appends one typed statement per operation
(`float tmp7 = tmp3 * tmp5;  // model.py:12 ...`), common subexpressions reused, inside the loops
codegen/cpp.py opens (loop variables `x0`, `r2`, ... are the index expressions' own symbols).
Each value is a scalar of its compute type; the loops around it are vectorised by the C++
compiler (`#pragma omp simd`). Half-precision values are computed in float (loads widen) and
each primitive's result is rounded to its half type, as eager's op results are (`fl_round_*`,
cpp_build.py's preamble). Sizes are literals, except in graphs with dynamic sizes, where they are
kernel arguments (`ks0, ks1, ...`), as in the Triton kernels.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import sympy
import torch

from ..lower.ir import compute_dtype
from ..schedule.fusion import FusedKernel
from .kernel_expressions import CV, KernelExpressions, loc_comment

# storage types of tensors' elements (what a pointer points to) and compute types of values
C_TYPES = {torch.float32: "float", torch.float64: "double", torch.float16: "_Float16", torch.bfloat16: "uint16_t",
           torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t",
           torch.uint8: "uint8_t", torch.bool: "bool"}
HALF_ROUND = {torch.float16: "fl_round_f16", torch.bfloat16: "fl_round_bf16"}


def input_pointee(dtype) -> str:
    """What a kernel's input pointer of `dtype` points to: bool tensors as bytes (loaded as
    `!= 0`), as gcc leaves a loop that loads through a `const bool*` unvectorised."""
    return "uint8_t" if dtype == torch.bool else C_TYPES[dtype]


def c_type(dtype) -> str:
    return C_TYPES[compute_dtype(dtype)]


def literal(value, dtype) -> str:
    """A Python number as a C++ expression of `dtype` (a compute dtype), exactly."""
    if dtype == torch.bool:
        return "true" if value else "false"
    t = C_TYPES[dtype]
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return f"std::numeric_limits<{t}>::quiet_NaN()"
        if math.isinf(value):
            return f"{'' if value > 0 else '-'}std::numeric_limits<{t}>::infinity()"
        return f"{t}({value.hex()})"  # a hexadecimal literal: no decimal rounding
    value = int(value)
    if value == -2 ** 63:
        return "(-9223372036854775807LL - 1)"
    return f"{t}({value}LL)" if dtype == torch.int64 or abs(value) >= 2 ** 31 else f"{t}({value})"


@dataclass
class HoistPoint:
    """Where values computed in a loop but independent of its variable go: before its header (the
    `#pragma` on it), in the enclosing loop's body (a loop of a collapsed nest has none: None)."""
    var: str
    at: int | None
    indent: int
    depth: int  # of the scopes, inside the loop's body


# the names in a C++ line that a value may depend on: loop variables, temporaries, accumulators
VARIABLES = re.compile(r"\b(?:[xr]\d+|tmp\d+|acc\d+(?:_nan|_part)?)\b")
# functions whose float result is NaN only as IEEE arithmetic makes it: the NaN of an operand
# (quiet, same payload) or the default NaN; elsewhere (SLEEF's routines build NaNs from bit masks,
# a half type's NaN widened to float fills low mantissa bits) a NaN may be `wild` (its low 16
# bits set: rounding it to bf16 needs the NaN test)
TAME_CALLS = frozenset({"fl_from_bf16", "fl_round_bf16", "fl_round_bf16_tame", "fl_exp", "fl_erf_aten", "fl_div",
                        "fl_recip_scale",
                        "std::sqrt", "fl_abs", "fl_rsqrt", "fl_sigmoid", "fl_maximum", "fl_minimum", "fl_floor",
                        "fl_ceil", "fl_where", "float", "double", "quiet_NaN", "infinity"})
CALLS = re.compile(r"([A-Za-z_][\w:]*)\s*\(")
TEMPORARY = re.compile(r"\btmp\d+\b")
# math worth keeping in a row cache rather than computing again in a later loop over the row
HEAVY_CALLS = frozenset({"fl_exp", "fl_exp2", "fl_log", "fl_log1p", "fl_sin", "fl_cos", "fl_tanh", "fl_erf",
                         "fl_erf_aten", "fl_pow", "fl_sigmoid", "fl_atan2", "fl_hypot", "fl_vml_exp", "fl_vml_log",
                         "fl_vml_sin", "fl_vml_cos", "fl_vml_tanh", "fl_vml_erf"})
BF16_LOAD = re.compile(r"fl_from_bf16\(\w+\[")
RAW_LOAD = re.compile(r"\w+_ptr\d+\[")


class CppExpressions(KernelExpressions):
    COMMENT = "//"
    FLOOR_DIV = "/"  # (index expressions are non-negative where they are loaded)
    AND = " && "

    def __init__(self, kernel: FusedKernel, sizevars, dynamic_values):
        super().__init__(kernel, sizevars, dynamic_values)
        self.deps: dict[str, frozenset] = {}  # temporary -> the loop variables its value depends on
        self.hoist_points: list = []  # HoistPoint of each open loop
        self.depth: dict[str, int] = {}  # temporary or accumulator -> the scope depth it is declared at
        self.wild: set[str] = set()  # float temporaries that may hold a wild NaN (TAME_CALLS)
        # row cache (codegen/cpp.py's reduction kernels): a heavy value computed in one loop over a
        # row and again in a later one is stored in the first (an array of the row, per thread) and
        # loaded in the others. Values are named by `key` (their text with temporaries by the key of
        # theirs) across loops; the first generation finds those computed in several loops
        # (`heavy_loops`), the second caches `cached` (key -> array).
        self.keys: dict[str, str] = {}  # temporary -> its key
        self.key_ids: dict[str, int] = {}
        self.heavy: set[str] = set()  # temporaries of heavy calls (or their bf16 rounding)
        self.heavy_loops: dict[str, set] = {}  # key of a heavy value -> the row loops computing it
        self.heavy_types: dict[str, str] = {}  # key of a heavy value -> its C type (a row cache array's)
        self.row_loop = None  # (loop variable, number) of the loop over a row the body is in
        self.cached: dict[str, str] = {}  # key -> its row cache array
        self.cache_filled: set[str] = set()
        # the conditions of every masked value (codegen/cpp.py's interior loops: where they all
        # hold, a second copy of the loop body has no masks); `unmasked` while writing that copy
        self.mask_conds: list = []
        self.unmasked = False

    def may_be_wild(self, text, dtype) -> bool:
        """Whether the float value of `text` may be a NaN with low mantissa bits set (TAME_CALLS):
        it loads a float buffer, calls another function, or reads a wild value or an accumulator."""
        if not dtype.is_floating_point or text.startswith("fl_round_bf16("):  # (its NaN is made 0x7fc00000)
            return False
        if len(RAW_LOAD.findall(text)) != len(BF16_LOAD.findall(text)):
            return True
        if any(f not in TAME_CALLS for f in CALLS.findall(text)):
            return True
        return any(n in self.wild or n.startswith("acc") for n in VARIABLES.findall(text))

    def cse(self, text, dtype):
        """`text` as a temporary (one already computed where it is in scope). Computed in the
        innermost loop but independent of its variable (a channel's BatchNorm scale in a loop over
        a row of pixels), it goes before that loop (`HoistPoint`)."""
        for scope in reversed(self.scopes):
            if text in scope:
                return CV(scope[text], dtype)
        name = f"tmp{self.tmp}"
        self.tmp += 1
        if self.may_be_wild(text, dtype):
            self.wild.add(name)
        names = VARIABLES.findall(text)
        deps = frozenset().union(*(self.deps.get(n, {n}) for n in names))
        self.deps[name] = deps
        key = self.key_of(name, text)
        cache = self.row_cache(name, text, key, deps, C_TYPES[dtype])
        if cache is not None:
            if key in self.cache_filled:
                text = f"{cache}[{self.row_loop[0]}]"  # (as wild as the value stored, which `name` is)
                if key.startswith("fl_round_bf16"):
                    self.half_values[name] = torch.bfloat16
            else:
                self.cache_filled.add(key)
                self.emit(f"{C_TYPES[dtype]} {name} = {text};")
                self.emit(f"{cache}[{self.row_loop[0]}] = {name};")
                self.scopes[-1][text] = name
                self.depth[name] = len(self.scopes)
                return CV(name, dtype)
        line = f"{C_TYPES[dtype]} {name} = {text};"
        point = self.hoist_points[-1] if self.hoist_points else None
        if point is not None and point.at is not None and point.var not in deps and \
                len(self.scopes) == point.depth and all(self.depth.get(n, 0) < point.depth for n in names):
            self.lines.insert(point.at, (point.indent, line + loc_comment(self.loc, self.COMMENT)))
            if self.loc:
                self.source_lines.add((self.loc[0], self.loc[1]))
            point.at += 1
            self.scopes[-2][text] = name
            self.depth[name] = point.depth - 1
        else:
            self.emit(line)
            self.scopes[-1][text] = name
            self.depth[name] = len(self.scopes)
        return CV(name, dtype)

    def key_of(self, name, text) -> str:
        """`name`'s key: its text with temporaries replaced by their keys' numbers (short, and the
        same for the same value computed in another loop)."""
        key = TEMPORARY.sub(lambda m: f"k{self.key_ids.get(self.keys.get(m.group(0)), m.group(0))}", text)
        self.key_ids.setdefault(key, len(self.key_ids))
        self.keys[name] = key
        return key

    def row_cache(self, name, text, key, deps, c_type):
        """The row cache array of a value computed in a loop over a row (None if not cached);
        records the heavy ones for `cached`: heavy calls and bf16 roundings (five integer
        operations and the value's own, where a store and a load cost two), with their C type."""
        calls = set(CALLS.findall(text))
        if calls & HEAVY_CALLS or text.startswith("fl_round_bf16"):
            self.heavy.add(name)
        if self.row_loop is None or self.row_loop[0] not in deps or name not in self.heavy:
            return None
        self.heavy_loops.setdefault(key, set()).add(self.row_loop[1])
        self.heavy_types[key] = c_type
        return self.cached.get(key)

    def keys_to_cache(self) -> list:
        """(key, C type) of the heavy values computed in more than one loop over a row: a value
        and not its bf16 rounding, which is cached instead."""
        again = [k for k, loops in self.heavy_loops.items() if len(loops) > 1]
        rounded = {k for k in again if k.startswith("fl_round_bf16")}
        return [(k, self.heavy_types[k]) for k in again if not any(r.endswith(f"(k{self.key_ids[k]})") for r in rounded)]

    def size_text(self, e) -> str:
        """A size: its value, or a kernel argument where it may change between calls (a size of a
        graph with dynamic sizes that no input fixes: lowering/ir.py DynamicValues)."""
        return str(self.sizevars.values[e]) if self.static_size(self.sizevars.values[e]) else super().size_text(e)

    @property
    def static_shape(self) -> bool:
        """Whether every loop's extent is the same at every call of this kernel."""
        return all(self.static_size(n) for n in self.kernel.shape)

    def integer_text(self, n: int) -> str:
        return str(n) if abs(n) < 2 ** 31 else f"{n}LL"

    def reads_before_writing(self, inp, out) -> bool:
        """Whether every load of buffer `inp` comes before the store of buffer `out` in the kernel's lines."""
        load, store = f"{self.in_args[inp]}[", f"{self.out_args[out]}["
        loads = [i for i, (_, text) in enumerate(self.lines) if load in text]
        stores = [i for i, (_, text) in enumerate(self.lines) if store in text]
        return bool(loads and stores) and max(loads) < min(stores)

    def masked(self, conds, body, other, dtype):
        if any(c is sympy.false for c in conds):
            return super().masked(conds, body, other, dtype)
        self.mask_conds += [c for c in conds if c is not sympy.true]
        return body() if self.unmasked else super().masked(conds, body, other, dtype)

    def mask(self):
        return self.AND.join(self.mask_stack) if self.mask_stack else None

    # --- the ops handler --------------------------------------------------------------------------
    def load(self, buf, index):
        own = self.own_value(buf)
        if own is not None:
            return own
        ptr = self.arg_for(buf, self.in_args, "in_ptr")
        mask = self.mask() if sympy.sympify(index).free_symbols else None
        index_text = self.expr(index)
        self.load_sites.setdefault(buf.name, set()).add(self.site(index, mask))
        dtype = compute_dtype(buf.dtype)
        text = f"{ptr}[{index_text}]" if buf.dtype != torch.bool else f"({ptr}[{index_text}] != 0)"
        if dtype != buf.dtype:
            text = f"fl_from_bf16({text})" if buf.dtype == torch.bfloat16 else f"float({text})"
        if mask:  # an element outside the tensor is not read
            text = f"({mask}) ? {text} : {C_TYPES[dtype]}(0)"
        return self.held(self.cse(text, dtype), buf.dtype)

    def constant(self, value, dtype):
        if not isinstance(value, bool) and float(value).is_integer() and int(value) in self.dynamic_values:
            # a size that may change (the count a mean divides by): a kernel argument, not a literal
            cd = compute_dtype(dtype)
            return self.cse(f"{C_TYPES[cd]}({self.expr(self.sizevars(int(value)))})", cd)
        if compute_dtype(dtype) != dtype:  # a half-precision constant is the nearest value of its type
            value = torch.tensor(value, dtype=dtype).item()
        cd = compute_dtype(dtype)
        return CV(literal(value, cd), cd, value=value)

    def pointwise(self, p, vals, out_dtype):
        self.op_names.add(p.name)
        template = p.cpp_for(out_dtype)
        if template is None:
            raise NotImplementedError(f"no C++ spelling for {p.name}")
        cd = compute_dtype(out_dtype)
        if cd.is_floating_point:  # operands of the result's type: `std::exp(int)` would compute in double
            vals = [v if v.dtype == cd or p.name == "where" and i == 0 else self.to_dtype(v, cd)
                    for i, v in enumerate(vals)]
        if p.name == "div" and out_dtype == torch.bfloat16 and self.invariant_bf16_divisor(*vals):
            return self.round(self.bf16_quotient(*vals), out_dtype)
        return self.result(p, vals, self.cse(template.format(*[v.expr for v in vals]), cd), out_dtype)

    def invariant_bf16_divisor(self, a, b) -> bool:
        """Whether a / b divides bf16 values by one that the innermost loop does not change (a
        softmax's or layer norm's row sum or deviation): `bf16_quotient` applies."""
        point = self.hoist_points[-1] if self.hoist_points else None
        return point is not None and self.holds(a, torch.bfloat16) and self.holds(b, torch.bfloat16) and \
            point.var not in self.deps.get(b.expr, ())

    def bf16_quotient(self, a, b):
        """a / b for bf16 values a and b, as a product with b's reciprocal computed once (before the
        loop): rounded to bf16 it equals the rounded quotient for every pair of bf16 values (all
        2^32 checked: tests/backend/test_cpp_kernels.py), a denormal b scaled by 2^64 first (its
        reciprocal would overflow). A vector division costs ~10 cycles, a product one."""
        scale = self.cse(f"fl_recip_scale({b})", torch.float32)
        reciprocal = self.cse(f"fl_div(float(0x1.0p+0), {b} * {scale})", torch.float32)
        return self.cse(f"({a} * {reciprocal}) * {scale}", torch.float32)

    def round_text(self, v, dtype):
        if dtype == torch.bfloat16 and v.expr not in self.wild:
            return f"fl_round_bf16_tame({v})"
        return f"{HALF_ROUND[dtype]}({v})"

    def bf16_bits_text(self, v) -> str:
        """The bits stored of float `v` as a bf16 (a value already rounded: its upper half)."""
        return f"fl_bf16_bits({v})" if self.half_values.get(v.expr) == torch.bfloat16 else f"fl_to_bf16({v})"

    def cast_text(self, v, dtype):
        if isinstance(v, CV) and v.dtype == torch.bool and dtype.is_floating_point:
            # through an int: gcc leaves a loop converting bool to float or double unvectorised
            # ("type conversion to/from bit-precision unsupported"), a sum over its values then
            # adding in one lane
            return f"{C_TYPES[dtype]}(int32_t({v}))"
        if isinstance(v, CV) and v.dtype.is_floating_point and not dtype.is_floating_point and dtype != torch.bool:
            return f"fl_to_int<{C_TYPES[dtype]}>({v})"
        return f"{C_TYPES[dtype]}({v})"

    def select(self, cond, value, other):
        if other.dtype != value.dtype:
            other = self.to_dtype(other, value.dtype)
        text = f"fl_where({cond}, {value}, {other})" if value.dtype == torch.float32 else f"{cond} ? {value} : {other}"
        return self.selected(value, other, self.cse(text, value.dtype))

    def random(self, kind, stream, flat):
        self.uses_seed = True
        self.op_names.add(kind)
        return self.cse(f"fl_{kind}(seed + {stream}, uint32_t({self.expr(flat)}))", torch.float32)
