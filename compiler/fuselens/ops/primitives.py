"""The primitive op set: each primitive is declared once, with
  - `impl`: a torch function computing it. Run on meta tensors it is the shape/dtype rule; run on
    real tensors it is the reference (and the extern call for primitives without a lowering).
  - `vjp`: the vector-Jacobian product rule, written with the builder's helpers (`P.mul(g, out)`,
    see autograd/joint.py). A pointwise primitive's is given here, in its declaration; the rules
    of reductions, views and externs are in vjp.py.
  - its spelling in kernels: `triton` and `cpp` (format strings over operand expressions, or
    functions of the result's dtype giving one: Triton's, and the C++ kernels' of CPU graphs,
    codegen/cpp_expressions.py) for pointwise primitives, `reduce` (the combine) for reductions.
    Lowering (lower/lowering.py) turns any pointwise primitive into a kernel line with it; the few
    primitives that need more (views, `cat`, max pooling) have a rule in lower/rules.py, and the
    rest are extern calls of `impl`.
A pointwise primitive that computes a torch op on its own is declared with `unary`/`binary`
naming that op: the declaration is then the whole of it, since the builder's helper (`P.<name>`,
with torch's type promotion) and the decomposition of each torch spelling are made from it
(ops/builder.py, ops/decompositions/pointwise.py). Others are declared with `_pointwise` and used
by the builder's hand-written helpers or by decompositions.
"""
from __future__ import annotations

import builtins
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PRIMITIVES: dict[str, "Primitive"] = {}


class Primitive:
    """A primitive op. Callable (runs `impl`) so a primitive FX graph also runs eagerly."""

    def __init__(self, name, impl, kind, *, triton=None, cpp=None, cpp_alone=None, reduce=None, vjp=None,
                 fresh=False, fresh_contiguous=False, opmath_scalars=(), heavy=False, torch_names=(), arity=None,
                 int_to_float=False, keeps_values=False):
        self.name = name
        self.__name__ = f"prim_{name}"
        self.__qualname__ = self.__name__
        self.impl = impl
        # kind: pointwise | reduction | view | source (no tensor inputs) | random | extern | item
        self.kind = kind
        self.triton = triton
        self.cpp = cpp  # its C++ spelling (codegen/cpp_expressions.py): a format string over operands
        # where its node is a whole torch op of the user's (`torch.erf(x)`, not the erf inside
        # F.gelu: lowering reads the node's meta["alone"]), eager ran that op's own kernel, whose
        # routine may differ from its composites' (MKL's vector math: codegen/cpp_vml.py):
        # a function of the result's dtype giving its C++ spelling then, or None (`cpp`'s)
        self.alone = _Alone(self, cpp_alone) if cpp_alone is not None else None
        self.reduce = reduce
        # an extern whose results are always new tensors, never views of an operand (the wrapper
        # may keep constants it reads and reuse the memory of what it read), and contiguous ones
        # (the wrapper skips their layout check)
        self.fresh = fresh or fresh_contiguous
        self.fresh_contiguous = fresh_contiguous
        # the device types on which a Python scalar operand enters at compute precision, not
        # rounded to a half-precision tensor operand's dtype (ATen's mul and div take the original
        # scalar in opmath; its CPU add and sub round it, its CUDA kernels do not)
        self.opmath_scalars = frozenset(opmath_scalars)
        # a pointwise primitive whose Triton lowering is a libdevice routine of tens of instructions
        # (range reduction, a polynomial): lowering stores a value computed with one rather than
        # compute it again for each element a consumer broadcasts it to (RoPE's cos and sin)
        self.heavy = heavy
        # a pointwise primitive whose float result is one of its operands' values or its negation
        # (a selection, |x|, -x, a copy): of operands that are values of a half dtype, it is one
        # too, so kernels skip its rounding (codegen/kernel_expressions.py `result`)
        self.keeps_values = keeps_values
        # the torch ops (torch.X, Tensor.X, F.X) this pointwise primitive computes alone, its number
        # of tensor operands, and whether integer operands compute in the default float dtype
        # (exp, div) rather than in their promoted dtype: what its helper and decompositions need
        self.torch_names = tuple(torch_names)
        self.arity = arity
        self.int_to_float = int_to_float
        self.vjp = vjp
        self.vjp_with_needs = False  # the rule takes `needs` (vjp.rule)
        PRIMITIVES[name] = self

    @property
    def vjp(self):
        return self._vjp

    @vjp.setter
    def vjp(self, rule):
        self._vjp = _in_compute_precision(rule) if rule is not None and self.kind == "pointwise" else rule

    def triton_for(self, dtype) -> str | None:
        """The Triton lowering of a pointwise primitive with a result of `dtype`."""
        return self.triton if self.triton is None or isinstance(self.triton, str) else self.triton(dtype)

    def cpp_for(self, dtype) -> str | None:
        """The C++ lowering of a pointwise primitive with a result of `dtype`."""
        return self.cpp if self.cpp is None or isinstance(self.cpp, str) else self.cpp(dtype)

    def __call__(self, *args, **kwargs):
        return self.impl(*args, **kwargs)

    def __repr__(self):
        return f"prim.{self.name}"


class _Alone:
    """Primitive `p` where its node is a whole torch op of the user's: `p` but for its C++ spelling."""

    def __init__(self, p, cpp_alone):
        self.p, self.cpp_alone = p, cpp_alone

    def __getattr__(self, name):
        return getattr(self.p, name)

    def cpp_for(self, dtype) -> str | None:
        return self.cpp_alone(dtype) or self.p.cpp_for(dtype)


def _in_compute_precision(rule):
    """A pointwise primitive's VJP computed in fp32 for half-precision values: like the ATen
    backward kernel it stands for, it rounds once (the joint graph casts each gradient to its
    argument's dtype), where its steps in half precision would each round."""
    def vjp(g, out, *args, **kwargs):
        def upcast(v):
            if isinstance(v, (list, tuple)):
                return type(v)(upcast(x) for x in v)
            return P.cast(v, torch.float32) if isinstance(v, P.TVal) and v.dtype in (torch.float16, torch.bfloat16) \
                else v
        return rule(upcast(g), upcast(out), *upcast(args), **kwargs)
    return vjp


def _pointwise(name, impl, triton, vjp, **kwargs):
    return Primitive(name, impl, "pointwise", triton=triton, vjp=vjp, **kwargs)


def _vml(name):
    """The C++ spelling of float32 op `name` called alone: eager's MKL routine (codegen/cpp_vml.py)."""
    return lambda dtype: f"fl_vml_{name}({{0}})" if dtype == torch.float32 else None


def unary(name, impl, triton, vjp, *, torch_names=None, int_to_float=True, **kwargs):
    """A pointwise primitive computing the torch op(s) `torch_names` (default: `name`) of one tensor."""
    return _pointwise(name, impl, triton, vjp, torch_names=torch_names or (name,), arity=1,
                      int_to_float=int_to_float, **kwargs)


def binary(name, impl, triton, vjp, *, torch_names=None, int_to_float=False, **kwargs):
    """A pointwise primitive computing the torch op(s) `torch_names` (default: `name`) of two
    tensors, broadcast and promoted to one dtype as torch does."""
    return _pointwise(name, impl, triton, vjp, torch_names=torch_names or (name,), arity=2,
                      int_to_float=int_to_float, **kwargs)


class _Builder:
    """ops/builder.py, the helpers VJP rules are written with, looked up when a rule runs: the
    builder emits these primitives, so it imports this module (which cannot import it first)."""

    def __getattr__(self, name):
        from . import builder
        return getattr(builder, name)


P = _Builder()


def no_grad(g, out, *args, **kwargs):
    """The VJP of a primitive whose result is constant almost everywhere (comparisons, floor) or
    has no gradient path (detach): no gradient for any argument."""
    return (None,) * len(args)


# --- pointwise: numerics on a GPU ---------------------------------------------------------------
# Each pointwise primitive's Triton spelling errs against a float64 reference by no more than
# eager's CUDA kernel (measured: docs/backend.md, Numerics): libdevice's exp and Triton's correctly
# rounded division and square root where Triton's own `tl.exp`, `/` and `tl.sqrt` are fast
# approximations (63, 2.0 and 0.94 ulp in float32 where eager's are 1.9, 0.5 and 0.5).
# Kernel-local Triton functions a primitive's spelling calls: each kernel using one defines it
# (codegen/triton.py), and Triton's interpreter runs it as the primitive's torch function.
TRITON_HELPERS = {
    # eager's sigmoid: 1 / (1 + exp(-x)) with an accurate exp and a correctly rounded division
    "fl_sigmoid": "def fl_sigmoid(x):\n    return tl.div_rn(1.0, 1.0 + libdevice.exp(-x))",
    # float32 erf and pow in float64, rounded once: libdevice's float32 routines err by 1.06 and
    # 2.4 ulp where eager's err by 1.01 and 0.88
    "fl_erf_f64": "def fl_erf_f64(x):\n    return libdevice.erf(x.to(tl.float64)).to(tl.float32)",
    "fl_pow_f64": "def fl_pow_f64(x, y):\n    return libdevice.pow(x.to(tl.float64), y.to(tl.float64)).to(tl.float32)",
    # float32 hypot too: libdevice's errs by 1.16 ulp on an H200 where eager's errs by 0.85
    "fl_hypot_f64": "def fl_hypot_f64(x, y):\n    return libdevice.hypot(x.to(tl.float64), y.to(tl.float64)).to(tl.float32)",
}


def _fp32_compute(fp32, other):
    """A spelling for results computed in float32 (float32 and the half types), another for float64
    (and integers, where a template applies to them)."""
    return lambda dtype: fp32 if dtype in (torch.float32, torch.bfloat16, torch.float16) else other


# --- pointwise: unary -------------------------------------------------------------------------
# a float times -1, not Triton's unary minus: `0 - x` in triton <= 3.6, +0.0 for +0.0 where eager
# gives -0.0 (an unsigned int cannot be multiplied by -1 in Triton: its minus wraps as torch's)
neg = _pointwise("neg", torch.neg, lambda dtype: "{0} * -1.0" if dtype.is_floating_point else "-{0}",
                 lambda g, out, x: (P.neg(g),), cpp="-{0}", keeps_values=True)
abs = _pointwise("abs", torch.abs, "tl.abs({0})",
                 lambda g, out, x: (P.where(P.gt(x, 0), g, P.where(P.lt(x, 0), P.neg(g), 0.0)),), cpp="fl_abs({0})",
                 keeps_values=True)
exp = unary("exp", torch.exp, "libdevice.exp({0})", lambda g, out, x: (P.mul(g, out),), cpp="fl_exp({0})",
            cpp_alone=_vml("exp"))
exp2 = unary("exp2", torch.exp2, "tl.exp2({0})", lambda g, out, x: (P.mul(g, P.mul(out, math.log(2))),), cpp="fl_exp2({0})")
log = unary("log", torch.log, "tl.log({0})", lambda g, out, x: (P.div(g, x),), cpp="fl_log({0})",
            cpp_alone=_vml("log"))
log1p = unary("log1p", torch.log1p, "libdevice.log1p({0})", lambda g, out, x: (P.div(g, P.add(x, 1.0)),),
              heavy=True, cpp="fl_log1p({0})")
sqrt = unary("sqrt", torch.sqrt, _fp32_compute("tl.sqrt_rn({0})", "tl.sqrt({0})"),
             lambda g, out, x: (P.div(P.mul(g, 0.5), out),), cpp="std::sqrt({0})")
rsqrt = unary("rsqrt", torch.rsqrt, "tl.rsqrt({0})",
              lambda g, out, x: (P.mul(P.mul(g, -0.5), P.mul(out, P.mul(out, out))),), cpp="fl_rsqrt({0})")
sin = unary("sin", torch.sin, "tl.sin({0})", lambda g, out, x: (P.mul(g, P.cos(x)),), heavy=True, cpp="fl_sin({0})",
            cpp_alone=_vml("sin"))
cos = unary("cos", torch.cos, "tl.cos({0})", lambda g, out, x: (P.neg(P.mul(g, P.sin(x))),), heavy=True, cpp="fl_cos({0})",
            cpp_alone=_vml("cos"))
tanh = unary("tanh", torch.tanh, "libdevice.tanh({0})", lambda g, out, x: (P.mul(g, P.sub(1.0, P.mul(out, out))),),
             heavy=True, cpp="fl_tanh({0})", cpp_alone=_vml("tanh"))
sigmoid = unary("sigmoid", torch.sigmoid, _fp32_compute("fl_sigmoid({0})", "tl.sigmoid({0})"),
                lambda g, out, x: (P.mul(g, P.mul(out, P.sub(1.0, out))),), cpp="fl_sigmoid({0})")
_erf_triton = lambda dtype: "fl_erf_f64({0})" if dtype == torch.float32 else "libdevice.erf({0})"  # noqa: E731
_erf_vjp = lambda g, out, x: (P.mul(g, P.mul(2 / math.sqrt(math.pi), P.exp(P.neg(P.mul(x, x))))),)  # noqa: E731
erf = unary("erf", torch.erf, _erf_triton, _erf_vjp, heavy=True, torch_names=("erf", "special_erf"),
            cpp=lambda dtype: "fl_erf_aten({0})" if dtype in (torch.bfloat16, torch.float16) else "fl_erf({0})",
            cpp_alone=_vml("erf"))
# GeLU's erf (ops/decompositions: F.gelu). In C++ kernels of float32 compute ATen's vectorised
# erf formula, not the accurate SLEEF erf that torch.erf's eager kernel matches (MKL's): eager's
# GeLU (oneDNN's on a CPU) follows neither, and against float64 errs by 2.4e-7..0.28 relative
# where this formula errs by 6.8e-7..0.05 and SLEEF's by 2.1e-7..0.05; it computes in 0.6 of
# SLEEF's time (bench/NOTES.md 73). On a GPU it is libdevice's erf in the compute dtype, as
# eager's GeLU kernel calls CUDA's erff in opmath: torch.erf's float64 evaluation made GeLU's
# kernels compute-bound (ViT-B/16's GeLU backward with fc1's bias gradient: 124 us a launch on an
# H200, 0.94 TB/s; bench/NOTES.md 78) for an error that GeLU's bf16 result cannot show.
gelu_erf = _pointwise("gelu_erf", torch.erf, "libdevice.erf({0})", _erf_vjp, heavy=True, arity=1, int_to_float=True,
                      cpp=lambda dtype: "fl_erf({0})" if dtype == torch.float64 else "fl_erf_aten({0})")
floor = unary("floor", torch.floor, "tl.floor({0})", no_grad, int_to_float=False, cpp="fl_floor({0})")
ceil = unary("ceil", torch.ceil, "tl.ceil({0})", no_grad, int_to_float=False, cpp="fl_ceil({0})")
logical_not = _pointwise("logical_not", torch.logical_not, "({0} == 0)", no_grad, cpp="!{0}")
# identity; makes a value a fresh contiguous buffer (clone/contiguous)
copy = _pointwise("copy", torch.clone, "{0}", lambda g, out, x, memory_format=None: (g,), cpp="{0}", keeps_values=True)
# identity whose VJP is zero (detach)
stop_gradient = _pointwise("stop_gradient", torch.Tensor.detach, "{0}", no_grad, cpp="{0}", keeps_values=True)
# the value of its second operand, the gradient path of its first: a write autograd does not
# record (effects.unrecorded_write), max/min over a dim (the gradient goes to the index). Never
# lowered: once the VJPs are built (or none is to be), it is its value (trace.values_only)
with_value = _pointwise("with_value", lambda t, v: v.expand_as(t).clone(), None, lambda g, out, t, v: (g, None))
# identity whose VJP is `rule(g, *inputs)` (one gradient per input), not the VJP of how the value
# was computed: a decomposition's closed-form gradient (batch norm's)
with_vjp = _pointwise("with_vjp", lambda x, inputs, rule: x, "{0}",
                      lambda g, out, x, inputs, rule: (None, rule(g, *inputs), None), cpp="{0}", keeps_values=True)


# --- pointwise: binary (operands broadcast; the builder casts them to one dtype first) ----------
def _pow_vjp(g, out, a, b):
    ga = P.mul(g, P.mul(b, P.pow(a, P.sub(b, 1)))) if isinstance(a, P.TVal) else None
    if not isinstance(b, P.TVal):
        gb = None
    elif isinstance(a, P.TVal):
        gb = P.mul(g, P.mul(out, P.where(P.gt(a, 0), P.log(a), 0.0)))
    else:
        gb = P.mul(g, P.mul(out, math.log(a) if a > 0 else 0.0))
    return ga, gb


def _extremum_vjp(loses):
    # as ATen: ties split the gradient evenly, an operand that loses gets none; neither loses
    # to a NaN, so both get the whole gradient there
    def fn(g, out, a, b):
        half = P.mul(g, 0.5)
        ga = P.where(P.eq(a, b), half, P.where(loses(a, b), 0.0, g))
        gb = P.where(P.eq(a, b), half, P.where(loses(b, a), 0.0, g))
        return ga, gb
    return fn


add = _pointwise("add", torch.add, "{0} + {1}", lambda g, out, a, b: (g, g), opmath_scalars=("cuda",), cpp="{0} + {1}")
sub = _pointwise("sub", torch.sub, "{0} - {1}", lambda g, out, a, b: (g, P.neg(g)), opmath_scalars=("cuda",), cpp="{0} - {1}")
mul = _pointwise("mul", torch.mul, "{0} * {1}", lambda g, out, a, b: (P.mul(g, b), P.mul(g, a)),
                 opmath_scalars=("cpu", "cuda"), cpp="{0} * {1}")
# ATen's CUDA kernel divides by a Python scalar as a product with its reciprocal (codegen/triton_expressions.py)
div = _pointwise("div", torch.div, _fp32_compute("tl.div_rn({0}, {1})", "{0} / {1}"),
                 lambda g, out, a, b: (P.div(g, b), P.neg(P.div(P.mul(g, out), b))), opmath_scalars=("cpu", "cuda"), cpp="fl_div({0}, {1})")
pow = _pointwise("pow", torch.pow, lambda dtype: "fl_pow_f64({0}, {1})" if dtype == torch.float32 else "libdevice.pow({0}, {1})",
                 _pow_vjp, heavy=True, cpp="fl_pow({0}, {1})")
maximum = binary("maximum", torch.maximum, "tl.maximum({0}, {1}, tl.PropagateNan.ALL)",
                 _extremum_vjp(lambda a, b: P.lt(a, b)), cpp="fl_maximum({0}, {1})", keeps_values=True)
minimum = binary("minimum", torch.minimum, "tl.minimum({0}, {1}, tl.PropagateNan.ALL)",
                 _extremum_vjp(lambda a, b: P.gt(a, b)), cpp="fl_minimum({0}, {1})", keeps_values=True)
# sqrt(a² + b²) without overflow; ATen's backward: g·a/out, g·b/out
hypot = binary("hypot", torch.hypot,
               lambda dtype: "fl_hypot_f64({0}, {1})" if dtype == torch.float32 else "libdevice.hypot({0}, {1})",
               lambda g, out, a, b: (P.div(P.mul(g, a), out), P.div(P.mul(g, b), out)), cpp="fl_hypot({0}, {1})")
# the angle of the point (b, a); ATen's backward: g·b/(a² + b²), -g·a/(a² + b²)
atan2 = binary("atan2", torch.atan2, "libdevice.atan2({0}, {1})",
               lambda g, out, a, b: (P.div(P.mul(g, b), P.add(P.mul(a, a), P.mul(b, b))),
                                     P.div(P.mul(P.neg(g), a), P.add(P.mul(a, a), P.mul(b, b)))),
               int_to_float=True, cpp="fl_atan2({0}, {1})")
eq = _pointwise("eq", torch.eq, "{0} == {1}", no_grad, cpp="{0} == {1}")
ne = _pointwise("ne", torch.ne, "{0} != {1}", no_grad, cpp="{0} != {1}")
lt = _pointwise("lt", torch.lt, "{0} < {1}", no_grad, cpp="{0} < {1}")
le = _pointwise("le", torch.le, "{0} <= {1}", no_grad, cpp="{0} <= {1}")
gt = _pointwise("gt", torch.gt, "{0} > {1}", no_grad, cpp="{0} > {1}")
ge = _pointwise("ge", torch.ge, "{0} >= {1}", no_grad, cpp="{0} >= {1}")
logical_and = _pointwise("logical_and", torch.logical_and, "({0} != 0) & ({1} != 0)", no_grad, cpp="({0} != 0) & ({1} != 0)")
logical_or = _pointwise("logical_or", torch.logical_or, "({0} != 0) | ({1} != 0)", no_grad, cpp="({0} != 0) | ({1} != 0)")
logical_xor = _pointwise("logical_xor", torch.logical_xor, "({0} != 0) ^ ({1} != 0)", no_grad, cpp="({0} != 0) ^ ({1} != 0)")


def _condition_read_from_result(c, a, b, out):
    """where(x <= k, k, x) and where(x >= k, k, x) (relu, threshold) select k exactly where their
    result is <= k (>= k; NaN neither): the backward reads that from the result, which the next op
    saves anyway (a linear's or convolution's input), not from a mask saved beside it (as eager's
    threshold_backward reads relu's result)."""
    test = c.node.target if c.node.op == "call_function" else None
    if test in (le, ge) and isinstance(a, (int, float)) and isinstance(b, P.TVal) \
            and c.node.args[0] is b.node and c.node.args[1] == a:
        return (P.le if test is le else P.ge)(out, a)
    return c


def _where_vjp(g, out, c, a, b):
    if isinstance(c, P.TVal):
        c = _condition_read_from_result(c, a, b, out)
    return None, P.where(c, g, 0.0), P.where(c, 0.0, g)


where = _pointwise("where", torch.where, "tl.where({0}, {1}, {2})", _where_vjp,
                   cpp=lambda dtype: "fl_where({0}, {1}, {2})" if dtype in (torch.float32, torch.bfloat16, torch.float16)
                   else "{0} ? {1} : {2}", keeps_values=True)  # (a float selection without a branch: cpp_build.py)
# dtype conversion; lowered by codegen (it knows the Triton type names)
convert = _pointwise("convert", lambda x, dtype: x.to(dtype), None,
                     lambda g, out, x, dtype: (P.cast(g, x.dtype) if x.dtype.is_floating_point else None,))


# --- reductions: always keepdim, over a tuple of dims -------------------------------------------
def _keepdim(fn):
    def impl(x, dims):
        if x.ndim == 0:
            return fn(x.reshape(1), 0).reshape(())
        out = x
        for d in sorted(dims, reverse=True):
            out = fn(out, d)
        return out
    return impl


sum = Primitive("sum", _keepdim(lambda x, d: torch.sum(x, d, keepdim=True, dtype=x.dtype)), "reduction",
                reduce="sum")
prod = Primitive("prod", _keepdim(lambda x, d: torch.prod(x, d, keepdim=True, dtype=x.dtype)), "reduction",
                 reduce="prod")
amax = Primitive("amax", _keepdim(lambda x, d: torch.amax(x, d, keepdim=True)), "reduction", reduce="max")
amin = Primitive("amin", _keepdim(lambda x, d: torch.amin(x, d, keepdim=True)), "reduction", reduce="min")

# --- views: no kernel of their own; lowering turns them into index expressions ------------------
reshape = Primitive("reshape", torch.reshape, "view")
permute = Primitive("permute", torch.permute, "view")
expand = Primitive("expand", lambda x, shape: x.expand(shape), "view")
slice = Primitive("slice", lambda x, dim, start, end, step:
                  x[(builtins.slice(None),) * dim + (builtins.slice(start, end, step),)], "view")


# --- index-computed values (lowered as pointwise with masked loads) -----------------------------
def _slice_scatter_zeros(src, shape, dim, start, end, step):
    out = src.new_zeros(shape)
    return out.slice_scatter(src, dim, start, end, step)


def _cat_vjp(g, out, tensors, dim):
    grads, start = [], 0
    for t in tensors:
        grads.append(P.slice(g, dim, start, start + t.shape[dim]))
        start += t.shape[dim]
    return (grads,)


# zeros of `shape` with `src` written into shape[dim][start:end:step]: the VJP of `slice`
slice_backward = Primitive("slice_backward", _slice_scatter_zeros, "pointwise",
                           vjp=lambda g, out, x, shape, dim, start, end, step: (P.slice(g, dim, start, end, step),))
cat = Primitive("cat", lambda tensors, dim: torch.cat(tensors, dim), "pointwise", vjp=_cat_vjp)

# --- sources: no tensor inputs -------------------------------------------------------------------
full = Primitive("full", lambda shape, value, dtype, device: torch.full(shape, value, dtype=dtype, device=device),
                 "source")
iota = Primitive("iota", lambda length, start, step, dtype, device:
                 torch.arange(start, start + length * step, step, dtype=dtype, device=device)[:length], "source")


def _random(fn):
    def impl(seed, shape, dtype, device, stream):
        if str(device) == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        # eager reference: its own generator per (seed, stream); the Triton lowering uses philox
        gen = torch.Generator(device).manual_seed(int(seed) * 1000003 + stream)
        return fn(shape, dtype=dtype, device=device, generator=gen)
    return impl


# uniform [0, 1) and standard normal; `stream` makes each random op in a graph independent
rand = Primitive("rand", _random(torch.rand), "random")
randn = Primitive("randn", _random(torch.randn), "random")

# --- extern calls: run the ATen op from the wrapper ---------------------------------------------
mm = Primitive("mm", torch.mm, "extern", fresh_contiguous=True)
# bias + a @ b: the bias add in cuBLAS's epilogue
addmm = Primitive("addmm", torch.addmm, "extern", fresh_contiguous=True)
bmm = Primitive("bmm", torch.bmm, "extern", fresh_contiguous=True)
conv2d = Primitive("conv2d", torch.nn.functional.conv2d, "extern", fresh=True)


def conv2d_result_layout(out, x, weight):
    """The meta tensor `out` of a convolution of `x` by `weight` in the layout cuDNN and oneDNN
    return: channels-last where the input or the weight is (ATen's
    `cudnn_conv_suggest_memory_format`), except in float64. The meta kernel says contiguous."""
    from torch._prims_common import suggest_memory_format
    cl = torch.channels_last
    if out.ndim == 4 and x.dtype != torch.float64 and cl in (suggest_memory_format(x), suggest_memory_format(weight)):
        return out.contiguous(memory_format=cl)
    return out


def _conv2d_backward(grad, x, weight, stride, padding, dilation, groups, mask):
    """(grad of x, grad of weight), each None where `mask` says it is not needed: one ATen call
    for both (cuDNN's host cost is per call: ~90 us each on an H100 host)."""
    if x.dim() == 3:  # an unbatched (C, H, W) input: ATen's backward takes a batch of one
        gx, gw = _conv2d_backward(grad.unsqueeze(0), x.unsqueeze(0), weight, stride, padding, dilation, groups, mask)
        return (None if gx is None else gx.squeeze(0)), gw
    outs = torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                               [0, 0], groups, [mask[0], mask[1], False])
    return outs[0], outs[1]


conv2d_backward = Primitive("conv2d_backward", _conv2d_backward, "extern", fresh=True)
# padding_idx -1: none
embedding = Primitive("embedding", lambda indices, weight, padding_idx: torch.embedding(weight, indices, padding_idx),
                      "extern", fresh=True)


def _embedding_backward(grad, indices, num_weights, padding_idx):
    """The gradient of an embedding's table. On CUDA in fp32, unless deterministic algorithms are
    asked for: the rows of `grad` added into zeros with atomic adds (`index_add_`), as Inductor
    does; ATen's kernel sorts the indices first (GPT-2's 4096 tokens into 50257 rows on an H200:
    193 us, against 64 for this, bench/NOTES.md). The sums' order then varies from run to run."""
    if grad.is_cuda and grad.dtype == torch.float32 and not torch.are_deterministic_algorithms_enabled():
        out = grad.new_zeros(num_weights, grad.shape[-1])
        out.index_add_(0, indices.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        if padding_idx >= 0:
            out[padding_idx] = 0
        return out
    return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, False)


embedding_backward = Primitive("embedding_backward", _embedding_backward, "extern", fresh=True)
# torch.gather's: x's elements at `index` along `dim`, each other dim at the element's own position
# (no flat offsets to divide back into dims where the gather is loads in its consumer's kernel)
gather = Primitive("gather", lambda x, dim, index: torch.gather(x, dim, index), "extern", fresh=True)


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                            scale=scale)


# F.scaled_dot_product_attention without dropout (flash attention where the GPU has it), with no
# mask, a boolean one, or the bias made of a boolean one (attention._bias_of): made by its decomposition and by the rewrite of attention written with
# matmuls and softmax (attention.py)
sdpa = Primitive("sdpa", _sdpa, "extern", fresh=True)
_aten = torch.ops.aten
# CUDA's fused attentions by torch.nn.attention.SDPBackend id: forward and backward. Their meta
# functions give the layouts the kernels return: flash's and cuDNN's results follow q's stride
# order, efficient attention's are (B, S, H, D) transposed to (B, H, S, D) whatever q's; each
# gradient follows its input as the kernels return it.
_FUSED_ATTENTION = {
    1: (_aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_backward.default),
    2: (_aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_efficient_attention_backward.default),
    3: (_aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_cudnn_attention_backward.default),
}
# CPU's one fused kernel (SDPBackend 1 there), which returns q's layout too
_CPU_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu.default
# a trained attention on a CPU (sdpa_saving's backend "cpu"): the flash kernel's forward, whose
# logsumexp its backward reads, as torch's autograd calls them
_FUSED_ATTENTION["cpu"] = (_CPU_FLASH, _aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


_ARGUMENT_NAMES: dict = {}


def _by_name(op, values):
    """`op` called with the arguments of its schema found in `values` (by name: their order and
    defaults differ between torch versions)."""
    names = _ARGUMENT_NAMES.get(op)
    if names is None:
        names = _ARGUMENT_NAMES[op] = [a.name for a in op._schema.arguments]
    return op(**{n: values[n] for n in names if n in values})


def sdpa_choice(q, k, v, attn_mask, is_causal, scale, device, grad=False, mask_grad=False):
    """The SDPBackend id torch's chooser gives F.scaled_dot_product_attention on `device` for
    tensors laid out like the meta tensors q, k, v (and mask), asked of empty tensors of that
    device: 0 math, 1 flash, 2 efficient, 3 cuDNN. `grad`: q, k and v require grad (a trained
    attention), `mask_grad`: the mask too (torch's checks differ). None where it cannot be asked:
    a symbolic size, no such device here."""
    device = torch.device(device)
    tensors = [t for t in (q, k, v, attn_mask) if t is not None]
    if device.type not in ("cuda", "cpu") or device.type == "cuda" and not torch.cuda.is_available() or \
            not all(isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride())):
        return None
    real = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(
        grad and (i < 3 or mask_grad)) for i, t in enumerate(tensors)]
    return int(torch._fused_sdp_choice(*real[:3], real[3] if attn_mask is not None else None,
                                       is_causal=is_causal, scale=scale))


def sdpa_backend(q, k, v, attn_mask, is_causal, scale, device, grad=False, mask_grad=False):
    """The fused kernel F.scaled_dot_product_attention runs on `device` for tensors laid out like
    the meta tensors q, k, v (and mask) (`sdpa_choice`; "cpu"'s one is 1). None where no fused
    kernel runs (math), where a size is symbolic, or where CUDA's flash pads a head dim that is no
    multiple of 8 and returns a slice of the padded result."""
    device = torch.device(device)
    fused = _FUSED_ATTENTION if device.type == "cuda" else (1,) if device.type == "cpu" else ()
    backend = sdpa_choice(q, k, v, attn_mask, is_causal, scale, device, grad, mask_grad) if fused else None
    if backend is None or device.type == "cuda" and q.shape[-1] % 8:
        return None
    return backend if backend in fused else None


def sdpa_meta(q, k, v, attn_mask=None, is_causal=False, scale=None, *, device):
    """sdpa's result as the kernel `device` runs returns it (layout included: a layout predicted
    wrong costs the wrapper a copy). The mask changes no layout: the fused kernels' meta
    functions are run without it."""
    backend = sdpa_backend(q, k, v, attn_mask, is_causal, scale, device)
    if backend is None:
        return sdpa.impl(q, k, v, attn_mask, is_causal, scale)
    op = _CPU_FLASH if torch.device(device).type == "cpu" else _FUSED_ATTENTION[backend][0]
    return _by_name(op, _fused_arguments(q, k, v, None, is_causal, scale))[0]


def _fused_arguments(q, k, v, bias, is_causal, scale):
    """The fused forwards' arguments by schema name (each takes those it names: the bias is
    CUDA's kernels' `attn_bias`, the CPU flash kernel's `attn_mask`)."""
    return dict(query=q, key=k, value=v, attn_bias=bias, attn_mask=bias, compute_log_sumexp=True, dropout_p=0.0,
                is_causal=is_causal, scale=scale)


def _attention_bias(mask, q, k, backend):
    """The additive bias F.scaled_dot_product_attention gives the fused kernel `backend` for a
    boolean mask (or for the bias the graph made of one). Efficient attention (ATen's convert_boolean_attn_mask, then preprocess_mask):
    -inf where masked, rows padded to 8 elements where they are not aligned so, expanded to
    (B, H, L, S). cuDNN (convert_boolean_attn_mask_cudnn): the fill torch's version uses
    (_cudnn_mask_fill), as it is. The CPU's flash kernel: -inf where masked, as it is."""
    if mask.dtype != torch.bool:  # the bias the graph made of it (attention._bias_of)
        bias = mask
    else:
        bias = _fill_masked(mask, q, _cudnn_mask_fill(q.device) if backend == 3 else -math.inf)
    if backend in (3, "cpu"):
        return bias
    if bias.stride(-1) != 1 or any(s % 8 for s in bias.stride()[:-1]):
        last = bias.shape[-1]
        bias = torch.nn.functional.pad(bias, (0, 8 - last % 8))[..., :last]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _fill_masked(mask, like, fill):
    """0 where `mask` is True, `fill` elsewhere, in `like`'s dtype and device (no tensor made
    from a Python number on the GPU: a host-to-device copy waits for the GPU)."""
    return like.new_zeros(mask.shape).masked_fill_(mask.logical_not(), fill)


_CUDNN_FILLS = {}


def _cudnn_mask_fill(device) -> float:
    """What torch's cuDNN attention puts where a boolean mask hides a key: -inf, or a finite
    -65504 (torch 2.10's workaround of a cuDNN -inf issue). Asked of torch once per device: the
    bias F.scaled_dot_product_attention hands cuDNN's kernel for a boolean mask, taken from the
    call and the kernel never run (building a cuDNN graph costs ~1 s on an H100; the model's own
    first call builds those of its shapes)."""
    if device.type == "meta":
        return -math.inf
    fill = _CUDNN_FILLS.get(device)
    if fill is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # (float16: -65504 is one, which a bfloat16 bias rounds to -65536 as torch's own bias does)
        q = torch.zeros(1, 1, 2, 64, device=device, dtype=torch.float16)
        mask = torch.tensor([[True, True], [False, False]], device=device)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), _BiasOf(_FUSED_ATTENTION[3][0]) as grab:
            try:
                torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            except _Taken:
                pass
        bias = grab.bias
        if not (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.numel() and
                bool((bias[..., 0, :] == 0).all()) and bool((bias[..., 1, :] == bias[..., 1, 0]).all())):
            raise RuntimeError(f"torch's cuDNN attention was handed no additive bias for a boolean mask ({bias!r})")
        fill = _CUDNN_FILLS[device] = float(bias[..., 1, 0].flatten()[0])
    return fill


class _Taken(Exception):
    pass


class _BiasOf(TorchDispatchMode):
    """Takes the attention bias `op` is called with, and stops the call there."""

    def __init__(self, op):
        super().__init__()
        self.op, self.bias = op, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.op:
            names = [a.name for a in func._schema.arguments]
            self.bias = kwargs.get("attn_bias", args[names.index("attn_bias")] if len(args) > names.index("attn_bias")
                                   else None)
            raise _Taken
        return func(*args, **kwargs)


def _sdpa_saving(q, k, v, attn_mask=None, is_causal=False, scale=None, *, backend):
    """sdpa by CUDA's fused kernel `backend` (1 flash, 2 efficient, 3 cuDNN), with
    what its backward reads: (out, logsumexp, philox seed, philox offset). A trained attention
    saves them: its backward then runs no second forward."""
    forward, _ = _FUSED_ATTENTION[backend]
    bias = None if attn_mask is None else _attention_bias(attn_mask, q, k, backend)
    r = _by_name(forward, _fused_arguments(q, k, v, bias, is_causal, scale))
    if backend == "cpu":  # (no random state: empty stand-ins of the seed and offset)
        return r[0], r[1], q.new_empty(0), q.new_empty(0)
    # by position: flash's philox seed and offset are named rng_state and unused in newer schemas
    return (r[0], r[1], r[2], r[3]) if backend == 2 else (r[0], r[1], r[6], r[7])


def _sdpa_saving_backward(g, q, k, v, saved, attn_mask=None, is_causal=False, scale=None, *, backend,
                          mask_grad=False):
    """(dq, dk, dv) from ATen's backward of the fused attention `backend`, given its forward's
    results `saved` (_sdpa_saving): no autograd engine, no math-path attention. With `mask_grad`
    (efficient attention only) also the gradient of the bias as the kernel took it, [B, H, L, S]."""
    _, backward = _FUSED_ATTENTION[backend]
    bias = None if attn_mask is None else _attention_bias(attn_mask, q, k, backend)
    values = _fused_arguments(q, k, v, bias, is_causal, scale)
    out, lse, seed, offset = saved
    values.update(out=out, logsumexp=lse, cum_seq_q=None, cum_seq_k=None, max_q=q.shape[-2], max_k=k.shape[-2],
                  philox_seed=seed, philox_offset=offset)
    if g.stride(-1) != 1:  # the kernels read rows of the gradient
        g = g.contiguous()
    values.update(grad_out=g, grad_out_=g, grad_input_mask=[True, True, True, mask_grad])
    return tuple(_by_name(backward, values)[:4 if mask_grad else 3])


def _fused_attention_backward(backend, g, q, k, v, attn_mask, is_causal, scale):
    """(dq, dk, dv) of the fused attention `backend` after its forward (which gives the
    logsumexp that backward needs)."""
    saved = _sdpa_saving(q, k, v, attn_mask, is_causal, scale, backend=backend)
    return _sdpa_saving_backward(g, q, k, v, saved, attn_mask, is_causal, scale, backend=backend)


def saving_backend(q, k, v, attn_mask, is_causal, scale, device, mask_grad=False):
    """The fused kernel sdpa_saving runs for a trained attention on `device` (meta tensors q, k,
    v, mask; `mask_grad`: the mask requires grad): torch's choice ("cpu": the CPU's flash
    kernel), or None (math; a CPU mask with a gradient, which the flash kernel gives none of)."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu") or device.type == "cpu" and mask_grad:
        return None
    backend = sdpa_backend(q, k, v, attn_mask, is_causal, scale, device, grad=True, mask_grad=mask_grad)
    return "cpu" if device.type == "cpu" and backend == 1 else backend


def _fused_backward_for(q, k, v, attn_mask, is_causal, scale):
    """The fused backend whose backward sdpa_backward calls (torch's choice for the forward),
    or None: math, or a head dim that F.scaled_dot_product_attention pads for flash."""
    if q.shape[-1] % 8:
        return None
    backend = int(torch._fused_sdp_choice(q, k, v, attn_mask, is_causal=is_causal, scale=scale))
    return backend if backend in _FUSED_ATTENTION else None


def _sdpa_backward(g, q, k, v, attn_mask=None, is_causal=False, scale=None):
    backend = _fused_backward_for(q, k, v, attn_mask, is_causal, scale) if q.is_cuda else None
    if backend is None:
        return _call_torch_vjp(_sdpa, (q, k, v), dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale), [g])
    return _fused_attention_backward(backend, g, q, k, v, attn_mask, is_causal, scale)


def sdpa_backward_meta(g, q, k, v, attn_mask=None, is_causal=False, scale=None, *, device):
    """sdpa_backward's (dq, dk, dv) as the kernels `device` runs return them. The math path's
    gradients come in their inputs' layouts (its meta would predict a transposed dk)."""
    backend = sdpa_backend(q, k, v, attn_mask, is_causal, scale, device) if torch.device(device).type == "cuda" else None
    if backend is None:
        return tuple(torch.empty_like(t) for t in (q, k, v))
    return _fused_attention_backward(backend, g, q, k, v, None, is_causal, scale)


# (dq, dk, dv) of sdpa: ATen's backward of the fused kernel the forward ran on a GPU, torch's
# autograd of F.scaled_dot_product_attention elsewhere
sdpa_backward = Primitive("sdpa_backward", _sdpa_backward, "extern", fresh=True)
# a trained attention on a GPU (attention.save_attention_statistics): the fused forward with its
# logsumexp, and the backward that reads it
sdpa_saving = Primitive("sdpa_saving", _sdpa_saving, "extern", fresh=True)
sdpa_saving_backward = Primitive("sdpa_saving_backward", _sdpa_saving_backward, "extern", fresh=True)


def _window_starts(out_shape, stride, padding, device):
    """Each output position's window's first input row, (OH, 1), and column, (1, OW)."""
    oh, ow = out_shape[-2:]
    return (torch.arange(oh, device=device)[:, None] * stride[0] - padding[0],
            torch.arange(ow, device=device)[None, :] * stride[1] - padding[1])


def offset_dtype(kernel_size):
    return torch.int8 if kernel_size[0] * kernel_size[1] <= 127 else torch.int32


def _max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode):
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)
    if x.device.type == "meta":
        return out, torch.empty_like(indices, dtype=offset_dtype(kernel_size))
    rows, cols = _window_starts(out.shape, stride, padding, x.device)
    w = x.shape[-1]
    kh, kw = (indices // w - rows) // dilation[0], (indices % w - cols) // dilation[1]
    return out, (kh * kernel_size[1] + kw).to(offset_dtype(kernel_size))


def _max_pool2d_backward(g, offsets, x_shape, x_order, kernel_size, stride, padding, dilation, ceil_mode):
    """`x_shape`, `x_order` (dims outermost first): the pooled input's shape and layout, all the
    backward needs of it (ATen's kernel reads its `self` for them alone)."""
    x = torch.empty_permuted(x_shape, x_order, dtype=g.dtype, device=g.device)
    if x.device.type != "meta":
        rows, cols = _window_starts(g.shape, stride, padding, x.device)
        offsets = offsets.long()
        ih = rows + offsets // kernel_size[1] * dilation[0]
        iw = cols + offsets % kernel_size[1] * dilation[1]
        offsets = ih * x.shape[-1] + iw
    return torch.ops.aten.max_pool2d_with_indices_backward(g, x, kernel_size, stride, padding, dilation, ceil_mode,
                                                           offsets.long())


# (out, offsets) of 2-d max pooling, and its backward: each output's maximum's position in its window
# (kh * kernel width + kw), 1 byte where ATen's index is 8, is what the backward reads. Both are
# lowered to kernels (lower/lowering.py), fused with their neighbours; `impl` (ATen's kernels, the
# positions converted) is the reference
max_pool2d = Primitive("max_pool2d", _max_pool2d, "extern", fresh=True)
max_pool2d_backward = Primitive("max_pool2d_backward", _max_pool2d_backward, "extern", fresh=True)
argmax = Primitive("argmax", lambda x, dim, keepdim: torch.argmax(x, dim, keepdim), "extern", fresh=True)
argmin = Primitive("argmin", lambda x, dim, keepdim: torch.argmin(x, dim, keepdim), "extern", fresh=True)


def _call_torch(fn, args, kwargs):
    return fn(*args, **kwargs)


# autograd nodes whose backward raises (`derivative for aten::floor_divide is not implemented`)
RAISING_NODES = ("torch::autograd::NotImplemented", "torch::autograd::Error")


def _call_torch_vjp(fn, args, kwargs, grads, needs=None, kw_needs=()):
    """Backward of an arbitrary torch call: recompute it under autograd and ask for the gradients
    of the arguments that need one (`needs`, positional, a tuple for a listed argument; None:
    every differentiable one) and of the tensors passed by keyword in `kw_needs` (SDPA's
    `attn_mask`): one result per item of the positional arguments (`flat_items`), then one per
    name of `kw_needs`."""
    wrt = []  # the leaves asked about, in order (an argument's listed tensors one by one: einsum's operands)

    def leaf(a, need):
        if isinstance(a, (list, tuple)):
            return type(a)(leaf(x, n) for x, n in zip(a, need if isinstance(need, tuple) else (need,) * len(a)))
        if _differentiable(a) and need:
            wrt.append(a.detach().requires_grad_(True))
            return wrt[-1]
        return a
    leaves = [leaf(a, need) for a, need in zip(args, needs or (True,) * len(args))]
    kw_leaves = {k: v.detach().requires_grad_(True) if k in kw_needs else v for k, v in kwargs.items()}
    with torch.enable_grad():
        out = fn(*leaves, **kw_leaves)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    # a result whose derivative torch does not implement (floor_divide): the compiled backward
    # raises eager's error before it would need this gradient (backend/training.py)
    # (a result that is an argument itself, returned as is, has no grad_fn: its gradient is g)
    pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad
             and (o.grad_fn is None or o.grad_fn.name() not in RAISING_NODES)]
    if not pairs:
        return (None,) * (len(args) + len(kw_needs))
    got = iter(torch.autograd.grad([o for o, _ in pairs], wrt + [kw_leaves[k] for k in kw_needs],
                                   [g for _, g in pairs], allow_unused=True))
    asked = {id(t) for t in wrt}
    # flat: one per leaf of the positional arguments, listed ones item by item (vjp.py nests them)
    return tuple(next(got) if id(a) in asked else None for a in flat_items(leaves)) + \
        tuple(next(got) for _ in kw_needs)


def flat_items(args):
    """The items of `args`, those of its lists and tuples one by one, in order."""
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from flat_items(a)
        else:
            yield a


def _differentiable(a):
    return isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())


# any torch function with no decomposition: `fn(*args, **kwargs)`, tensors among args (flat list)
call_torch = Primitive("call_torch", _call_torch, "extern")
# its VJP: gradients w.r.t. every tensor in args (a tuple, None where none)
call_torch_vjp = Primitive("call_torch_vjp", _call_torch_vjp, "extern")
# element `index` of an extern's tuple result
item = Primitive("item", lambda tup, index: tup[index], "item")


def _scatter_(x, target, dim, index, src):
    if index is None:
        target.copy_(src)
    else:
        target.index_copy_(dim, index.long().reshape(-1), src)  # (index_copy_ takes int64 of one dim)
    return x


# an in-place write into graph input x that runtime/reinplace.py made in place (a KV cache's
# `index_copy_`, `cache[:, :, pos] = v`): src written into `target`, a view of x, at positions
# `index` along `dim` (index None: all of target), returning x. Lowered to a kernel storing src's
# elements into x's memory (lower/rules.py `_scatter_`), with src's producer fused into it
scatter_ = Primitive("scatter_", _scatter_, "extern")
