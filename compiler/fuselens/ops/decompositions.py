"""Torch-level functions as compositions of primitives.

One function per torch op, registered for every spelling capture may produce: the `torch.*`
function, the `torch.nn.functional.*` function, the `operator.*` function and the unbound
`torch.Tensor.*` method. Anything not registered here becomes an extern `call_torch`.
Decompositions raise `Unsupported` for argument combinations they do not handle; the caller
then uses the extern call too, so no graph fails for want of a decomposition.
"""
from __future__ import annotations

import builtins
import functools
import math
import operator

import torch
import torch.nn.functional as F

from . import builder as P
from . import primitives as prim
from .builder import TVal, emit
from .effects import no_grad_view, unrecorded_write

DECOMPOSITIONS: dict = {}


class Unsupported(Exception):
    """This decomposition does not handle these arguments: call the torch op as an extern."""


def register(*targets):
    def deco(fn):
        for t in targets:
            DECOMPOSITIONS[t] = fn
        return fn
    return deco


def _method(name):
    return getattr(torch.Tensor, name)


def _t(*names, fn=True, method=True, functional=False):
    """The torch.<name>, torch.Tensor.<name> and F.<name> spellings of op names that exist."""
    out = []
    for n in names:
        for owner, use in ((torch, fn), (torch.Tensor, method), (F, functional)):
            if use and hasattr(owner, n):
                out.append(getattr(owner, n))
    return out


def _is_half(dtype):
    return dtype in (torch.float16, torch.bfloat16)


def _upcast(x):
    """Half-precision math runs in fp32 (as ATen's kernels do internally)."""
    return P.cast(x, torch.float32) if isinstance(x, TVal) and _is_half(x.dtype) else x


def _opmath(fn):
    """A decomposition of one ATen kernel written with several primitives: computed in fp32 for
    half-precision tensors and rounded once, as the kernel does (each primitive's result is
    rounded to its dtype, so in half precision the steps would round each time)."""
    @functools.wraps(fn)  # its signature is what decompose() checks arguments against
    def wrapper(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, TVal)]
        if not builtins.any(_is_half(t.dtype) for t in tensors):
            return fn(*args, **kwargs)
        dtype = P.result_type(*tensors)
        return P.cast(fn(*[_upcast(a) for a in args], **kwargs), dtype)
    return wrapper


def _sizes(args):
    """torch.zeros(2, 3) and torch.zeros((2, 3)) both mean shape (2, 3)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


# --- arithmetic -----------------------------------------------------------------------------------
def _both_python(a, b):
    return not isinstance(a, TVal) and not isinstance(b, TVal)


@register(*_t("add"), operator.add, _method("__add__"), _method("__radd__"))
def add(a, b, *, alpha=1):
    if _both_python(a, b):
        return a + b * alpha
    return P.add(a, b if alpha == 1 else P.mul(b, alpha))


@register(*_t("sub", "subtract"), operator.sub, _method("__sub__"))
def sub(a, b, *, alpha=1):
    if _both_python(a, b):
        return a - b * alpha
    return P.sub(a, b if alpha == 1 else P.mul(b, alpha))


@register(_method("__rsub__"), torch.rsub)
def rsub(a, b, alpha=1):
    return sub(b, a, alpha=alpha)


@register(*_t("mul", "multiply"), operator.mul, _method("__mul__"), _method("__rmul__"))
def mul(a, b):
    return a * b if _both_python(a, b) else P.mul(a, b)


@register(*_t("div", "divide", "true_divide"), operator.truediv, _method("__truediv__"))
def div(a, b, *, rounding_mode=None):
    if _both_python(a, b):
        return a / b if rounding_mode is None else (a // b if rounding_mode == "floor" else int(a / b))
    if rounding_mode is None:
        return P.div(a, b) if isinstance(a, TVal) else rdiv(b, a)  # number / tensor is Tensor.__rtruediv__
    dtype = P.result_type(a, b)
    if not dtype.is_floating_point:
        raise Unsupported("integer division")
    if rounding_mode == "floor":
        # eager floors (a - fmod(a, b)) / b, not the rounded quotient: 1. // 0.1 is 9, not 10
        raise Unsupported("floor division (eager's algorithm goes through fmod)")
    q = P.div(a, b)
    return P.where(P.lt(q, 0), P.ceil(q), P.floor(q))


@register(_method("__rtruediv__"))
def rdiv(a, b):
    # torch's own spelling: reciprocal, then a product (each rounded in half precision)
    return P.mul(P.div(1.0, a), b)


@register(operator.floordiv, torch.floor_divide, _method("__floordiv__"))
def floordiv(a, b):
    return div(a, b, rounding_mode="floor")


@register(operator.mod)
def py_mod(a, b):
    if _both_python(a, b):
        return a % b
    raise Unsupported("tensor remainder")


@register(*_t("neg", "negative"), operator.neg, _method("__neg__"))
def neg(x):
    return -x if not isinstance(x, TVal) else P.neg(x)


@register(operator.pos)
def pos(x):
    return x


@register(*_t("abs"), operator.abs, _method("__abs__"))
def abs_(x):
    return builtins.abs(x) if not isinstance(x, TVal) else P.abs(x)


@register(*_t("pow"), operator.pow, _method("__pow__"))
def pow_(a, b):
    if _both_python(a, b):
        return a ** b
    small_power = isinstance(b, (int, float)) and float(b).is_integer() and 1 <= b <= 4
    if not P.result_type(a, b).is_floating_point and not small_power:
        # integer powers (2 ** -1 == 0) are no floating-point pow: torch computes them
        raise Unsupported("integer pow")
    return P.pow(a, b)


@register(_method("__rpow__"))
def rpow(a, b):
    return pow_(b, a)


@register(*_t("square"))
def square(x):
    return P.mul(x, x)


def _unary(p_fn, *names, functional=False):
    register(*_t(*names, functional=functional))(lambda x: p_fn(x))


for _fn, _names in ((P.exp, ("exp",)), (P.exp2, ("exp2",)), (P.log, ("log",)), (P.log1p, ("log1p",)),
                    (P.sqrt, ("sqrt",)), (P.rsqrt, ("rsqrt",)), (P.sin, ("sin",)), (P.cos, ("cos",)),
                    (P.erf, ("erf", "special_erf")), (P.floor, ("floor",)), (P.ceil, ("ceil",))):
    _unary(_fn, *_names)
_unary(P.tanh, "tanh", functional=True)
_unary(P.sigmoid, "sigmoid", functional=True)


@register(*_t("log2"))
@_opmath
def log2(x):
    return P.mul(P.log(x), 1 / math.log(2))


@register(*_t("log10"))
@_opmath
def log10(x):
    return P.mul(P.log(x), 1 / math.log(10))


@register(*_t("expm1"))
@_opmath
def expm1(x):
    return P.sub(P.exp(x), 1)


@register(*_t("tan"))
@_opmath
def tan(x):
    return P.div(P.sin(x), P.cos(x))


@register(*_t("reciprocal"))
def reciprocal(x):
    return P.div(1.0, x)


@register(*_t("sign", "sgn"))
def sign(x):
    if x.dtype == torch.bool:
        return x
    # NaN is neither > 0 nor < 0: its sign is 0, as torch's
    return P.cast(P.where(P.gt(x, 0), 1, P.where(P.lt(x, 0), -1, 0)), x.dtype)


# --- activations ----------------------------------------------------------------------------------
@register(*_t("relu", functional=True))
def relu(x, inplace=False):
    return P.where(P.le(x, 0), 0, x)


@register(F.leaky_relu)
def leaky_relu(x, negative_slope=0.01, inplace=False):
    return P.where(P.gt(x, 0), x, P.mul(x, negative_slope))


@register(F.gelu)
def gelu(x, approximate="none"):
    y = _upcast(x)
    if approximate == "tanh":
        inner = P.mul(math.sqrt(2 / math.pi), P.add(y, P.mul(0.044715, P.mul(y, P.mul(y, y)))))
        out = P.mul(P.mul(0.5, y), P.add(1.0, P.tanh(inner)))
    else:
        out = P.mul(P.mul(0.5, y), P.add(1.0, P.erf(P.mul(y, 1 / math.sqrt(2)))))
    return P.cast(out, x.dtype)


@register(F.silu)
def silu(x, inplace=False):
    y = _upcast(x)
    return P.cast(P.mul(y, P.sigmoid(y)), x.dtype)


@register(F.softplus)
@_opmath
def softplus(x, beta=1.0, threshold=20.0):
    scaled = P.mul(x, beta)
    return P.where(P.gt(scaled, threshold), x, P.div(P.log1p(P.exp(scaled)), beta))


@register(*_t("clamp", "clip"))
def clamp(x, min=None, max=None, inplace=False):
    # eager's clamp_backward masks by min <= x <= max: a NaN x, or a NaN tensor bound, gets none
    return _clamp(x, min, max, nan_gets_gradient=False)


@functools.cache
def _nan_scalar_bound_propagates() -> bool:
    """Whether this torch's clamp with a NaN number as a bound gives NaN (2.13) or ignores it (2.11):
    asked of torch itself."""
    return bool(torch.clamp(torch.zeros(1), max=math.nan).isnan())


def _clamp(x, min, max, nan_gets_gradient):
    out = x if nan_gets_gradient or not x.dtype.is_floating_point else P.where(P.eq(x, x), x, math.nan)
    for bound, past in ((min, P.lt), (max, P.gt)):
        if bound is None:
            continue
        out = P.where(past(out, bound), P.cast(bound, P.result_type(out, bound)), out)
        # a NaN bound gives NaN, as torch's clamp propagates it (a NaN x stays: no comparison holds)
        if isinstance(bound, TVal) and bound.dtype.is_floating_point:
            out = P.where(P.ne(bound, bound), math.nan, out)
        elif isinstance(bound, float) and math.isnan(bound) and _nan_scalar_bound_propagates():
            out = P.where(P.eq(out, out), bound, out)
    return out


# hardtanh's backward masks by NOT (x <= min or x >= max): a NaN x gets the gradient
DECOMPOSITIONS[F.hardtanh] = lambda x, min_val=-1.0, max_val=1.0, inplace=False: \
    _clamp(x, min_val, max_val, nan_gets_gradient=True)
DECOMPOSITIONS[_method("clamp_min")] = lambda x, min: clamp(x, min=min)
DECOMPOSITIONS[_method("clamp_max")] = lambda x, max: clamp(x, max=max)
DECOMPOSITIONS[torch.clamp_min] = DECOMPOSITIONS[_method("clamp_min")]
DECOMPOSITIONS[torch.clamp_max] = DECOMPOSITIONS[_method("clamp_max")]


# --- comparisons, logic, selection ----------------------------------------------------------------
def _compare(p_fn, py_op, *names):
    def fn(a, b):
        return py_op(a, b) if _both_python(a, b) else p_fn(a, b)
    register(*_t(*names), py_op, _method(f"__{py_op.__name__}__"))(fn)


for _p, _op, _names in ((P.eq, operator.eq, ("eq",)), (P.ne, operator.ne, ("ne", "not_equal")),
                        (P.lt, operator.lt, ("lt", "less")), (P.le, operator.le, ("le", "less_equal")),
                        (P.gt, operator.gt, ("gt", "greater")), (P.ge, operator.ge, ("ge", "greater_equal"))):
    _compare(_p, _op, *_names)


def _logical(p_fn, *targets):
    def fn(a, b):
        if _both_python(a, b):
            return targets[-1](a, b)
        for v in (a, b):
            if isinstance(v, TVal) and v.dtype != torch.bool:
                raise Unsupported("bitwise op on integers")
        return p_fn(a, b)
    register(*targets)(fn)


_logical(P.logical_and, *_t("logical_and"), _method("__and__"), operator.and_)
_logical(P.logical_or, *_t("logical_or"), _method("__or__"), operator.or_)
_logical(P.logical_xor, *_t("logical_xor"), _method("__xor__"), operator.xor)


@register(*_t("logical_not"))
def logical_not(x):
    return P.logical_not(x)


@register(operator.invert, _method("__invert__"), *_t("bitwise_not"))
def invert(x):
    if not isinstance(x, TVal):
        return ~x
    if x.dtype != torch.bool:
        raise Unsupported("bitwise not on integers")
    return P.logical_not(x)


@register(*_t("where"))
def where(cond, a=None, b=None):
    if a is None:
        raise Unsupported("where(cond) returns indices")
    return P.where(cond, a, b)


@register(*_t("masked_fill"))
def masked_fill(x, mask, value):
    return P.where(mask, P.cast(value, x.dtype), x)


@register(*_t("maximum"))
def maximum(a, b):
    return P.maximum(a, b)


@register(*_t("minimum"))
def minimum(a, b):
    return P.minimum(a, b)


@register(*_t("hypot"))
def hypot(a, b):
    if not (isinstance(a, TVal) and isinstance(b, TVal)) or not P.result_type(a, b).is_floating_point:
        raise Unsupported  # torch.hypot takes two tensors of a float dtype: the torch call raises its error
    return P.hypot(a, b)


def _ignoring_nan(p_fn):
    """fmax/fmin: a NaN operand gives the other one (maximum/minimum propagate NaN)."""
    def fn(a, b):
        return P.where(P.ne(b, b), a, P.where(P.ne(a, a), b, p_fn(a, b)))
    return fn


register(*_t("fmax"))(_ignoring_nan(P.maximum))
register(*_t("fmin"))(_ignoring_nan(P.minimum))


@register(*_t("isnan"))
def isnan(x):
    return P.ne(x, x)


@register(*_t("isinf"))
def isinf(x):
    return P.eq(P.abs(x), math.inf)


# --- casts ----------------------------------------------------------------------------------------
for _name, _dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                      ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                      ("bool", torch.bool), ("short", torch.int16)):
    DECOMPOSITIONS[_method(_name)] = (lambda d: lambda x, memory_format=None: P.cast(x, d))(_dtype)


@register(_method("to"))
def to(x, *args, **kwargs):
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = torch.device(a)
        elif isinstance(a, TVal):
            dtype = a.dtype
    if device is not None and torch.device(device).type != P.builder().device.type:
        raise Unsupported("device transfer")
    if kwargs.get("copy"):
        x = P.copy(x)
    return P.cast(x, dtype) if dtype is not None else x


@register(_method("type_as"))
def type_as(x, other):
    return P.cast(x, other.dtype)


@register(_method("type"))
def type_(x, dtype=None, non_blocking=False):
    if not isinstance(dtype, torch.dtype):
        raise Unsupported("type() with a string")
    return P.cast(x, dtype)


# --- reductions -----------------------------------------------------------------------------------
def _dims_arg(dim):
    if dim is None or isinstance(dim, int):
        return dim
    return tuple(dim)


@register(*_t("sum"))
def sum_(x, dim=None, keepdim=False, *, dtype=None):
    if dtype is None and not (x.dtype.is_floating_point or x.dtype.is_complex):
        dtype = torch.int64
    y = P.cast(x, dtype) if dtype is not None else x
    out = P.sum(_upcast(y), _dims_arg(dim), keepdim)
    return P.cast(out, y.dtype)


@register(*_t("mean"))
def mean(x, dim=None, keepdim=False, *, dtype=None):
    y = P.cast(x, dtype) if dtype is not None else x
    if not y.dtype.is_floating_point:
        raise Unsupported("mean of integers")
    dims = P.norm_dims(_dims_arg(dim), y.ndim)
    count = math.prod(y.shape[d] for d in dims)
    out = P.div(P.sum(_upcast(y), dims, keepdim), count)
    return P.cast(out, y.dtype)


@register(*_t("prod"))
def prod(x, dim=None, keepdim=False, *, dtype=None):
    y = P.cast(x, dtype if dtype is not None else (x.dtype if x.dtype.is_floating_point else torch.int64))
    return P.cast(P.prod(_upcast(y), dim, keepdim), y.dtype)


@register(*_t("amax"))
def amax(x, dim=(), keepdim=False):
    return P.amax(x, _dims_arg(dim), keepdim)


@register(*_t("amin"))
def amin(x, dim=(), keepdim=False):
    return P.amin(x, _dims_arg(dim), keepdim)


def _max_min(p_reduce, p_binary, p_arg):
    def fn(x, dim=None, keepdim=False):
        if isinstance(dim, TVal):
            return p_binary(x, dim)
        if dim is None:
            return p_reduce(x, None, False)
        # argmax/argmin take no bools: the index of the first True is that of the first 1
        arg_of = P.cast(x, torch.uint8) if x.dtype == torch.bool else x
        index = emit(p_arg, arg_of, dim, keepdim)
        values = p_reduce(x, dim, keepdim)
        if not x.dtype.is_floating_point or x.ndim == 0:
            return values, index
        # the gradient goes to the element at the index, as ATen's (not shared among ties, nor NaN
        # where the extreme is NaN, as amax/amin's)
        d = dim % x.ndim
        at = index if keepdim else P.unsqueeze(index, d)
        positions = P.reshape(P.iota(x.shape[d]), [x.shape[d] if i == d else 1 for i in range(x.ndim)])
        picked = P.sum(P.where(P.eq(positions, at), x, 0.0), d, keepdim)
        return emit(prim.with_value, picked, P.cast(values, picked.dtype)), index
    return fn


register(*_t("max"))(_max_min(P.amax, P.maximum, prim.argmax))
register(*_t("min"))(_max_min(P.amin, P.minimum, prim.argmin))


def _arg_extreme(p):
    def fn(x, dim=None, keepdim=False):
        if dim is None:  # index into the flattened tensor
            return emit(p, P.reshape(x, (-1,)), 0, False)
        return emit(p, x, dim, keepdim)
    return fn


register(*_t("argmax"))(_arg_extreme(prim.argmax))
register(*_t("argmin"))(_arg_extreme(prim.argmin))


@register(*_t("any"))
def any_(x, dim=None, keepdim=False):
    return P.cast(P.amax(P.cast(P.ne(x, 0), torch.int32), _dims_arg(dim), keepdim), torch.bool)


@register(*_t("all"))
def all_(x, dim=None, keepdim=False):
    return P.cast(P.amin(P.cast(P.ne(x, 0), torch.int32), _dims_arg(dim), keepdim), torch.bool)


def _correction(unbiased, correction):
    if correction is not None:
        return correction
    return 1 if unbiased in (None, True) else 0


@register(*_t("var"))
def var(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    y = _upcast(x)
    dims = P.norm_dims(_dims_arg(dim), y.ndim)
    count = math.prod(y.shape[d] for d in dims)
    centered = P.sub(y, P.div(P.sum(y, dims, True), count))
    dof = builtins.max(count - _correction(unbiased, correction), 0)
    out = P.div(P.sum(P.mul(centered, centered), dims, keepdim), dof)
    return P.cast(out, x.dtype)


@register(*_t("std"))
def std(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return P.cast(P.sqrt(_upcast(var(x, dim, unbiased, keepdim, correction=correction))), x.dtype)


@register(*_t("var_mean"))
def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(dim, bool):  # torch.var_mean(x, unbiased): the overload without a dim
        dim, unbiased = None, dim
    return var(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def _stabilizer(m):
    """The row maximum that softmax, log_softmax and logsumexp subtract for range: their values
    do not depend on it, so neither do their gradients (ATen's closed-form backwards have no
    term for it). Without a gradient path, the backward computes no tie count of the maximum
    and no second row sum (GPT-2's loss: two reductions over a 50257-wide row less)."""
    return emit(prim.stop_gradient, m)


@register(*_t("logsumexp"))
def logsumexp(x, dim, keepdim=False):
    # integers and bools: computed in the default float dtype (torch's integer-to-float promotion)
    dtype = x.dtype if x.dtype.is_floating_point else torch.get_default_dtype()
    y = _upcast(P.cast(x, dtype))
    m = P.amax(y, dim, True)
    m = _stabilizer(P.where(P.eq(P.abs(m), math.inf), 0.0, m))
    out = P.add(P.log(P.sum(P.exp(P.sub(y, m)), dim, True)), m)
    return P.cast(out if keepdim else P.squeeze_dims(out, P.norm_dims(dim, y.ndim)), dtype)


@register(*_t("norm"), torch.linalg.vector_norm)
def norm(x, p=2, dim=None, keepdim=False, dtype=None, ord=None):
    if (ord if ord is not None else p) not in (2, 2.0, "fro") or dtype is not None:
        raise Unsupported("norm other than 2")
    y = _upcast(x)
    return P.cast(P.sqrt(P.sum(P.mul(y, y), _dims_arg(dim), keepdim)), x.dtype)


# --- normalizations and losses --------------------------------------------------------------------
@register(*_t("softmax", functional=True), torch.special.softmax)
def softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("softmax without dim")
    y = _upcast(P.cast(x, dtype) if dtype is not None else x)
    e = P.exp(P.sub(y, _stabilizer(P.amax(y, dim, True))))
    return P.cast(P.div(e, P.sum(e, dim, True)), dtype or x.dtype)


@register(*_t("log_softmax", functional=True))
def log_softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("log_softmax without dim")
    y = _upcast(P.cast(x, dtype) if dtype is not None else x)
    shifted = P.sub(y, _stabilizer(P.amax(y, dim, True)))
    return P.cast(P.sub(shifted, P.log(P.sum(P.exp(shifted), dim, True))), dtype or x.dtype)


@register(F.dropout, torch.dropout)
def dropout(x, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return x
    if p == 1:
        return P.mul(x, 0)
    keep = P.ge(random("rand", x.shape, torch.float32), p)
    return P.where(keep, P.mul(x, 1 / (1 - p)), 0)


def _class_pick(logp, target, class_dim, weight, lse=None):
    """(-logp[target] * w[target], w[target]) per sample, via a one-hot mask over the class dim.
    With `lse` = (m, log(sum(exp(x - m)))), `logp` is the logits x and logp[target] is
    (x[target] - m) - log(...), as log_softmax computes it: the pick reads x, not log_softmax's
    result, so it is a reduction beside the maximum (one pass over a row less) and the
    gradient, softmax - one-hot, needs no row sum."""
    classes = logp.shape[class_dim]
    shape = [1] * logp.ndim
    shape[class_dim] = classes
    onehot = P.eq(P.reshape(P.iota(classes, dtype=target.dtype), shape), P.unsqueeze(target, class_dim))
    picked = P.sum(P.where(onehot, logp, 0.0), class_dim)
    if lse is not None:
        m, log_sum = (P.squeeze_dims(t, (class_dim,)) for t in lse)
        picked = P.sub(P.sub(picked, m), log_sum)
    picked = P.neg(picked)
    if weight is None:
        return picked, None
    w = P.sum(P.where(onehot, P.reshape(P.cast(weight, logp.dtype), shape), 0.0), class_dim)
    return P.mul(picked, w), w


@register(F.nll_loss)
def nll_loss(logp, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None:
        raise Unsupported("legacy reduction arguments")
    class_dim = 1 if logp.ndim > 1 else 0
    return _nll(_upcast(logp), target, weight, ignore_index, reduction, class_dim, None, logp.dtype)


def _nll(values, target, weight, ignore_index, reduction, class_dim, lse, dtype):
    loss, w = _class_pick(values, target, class_dim, weight, lse)
    valid = P.ne(target, ignore_index)
    loss = P.where(valid, loss, 0.0)
    if reduction == "none":
        return P.cast(loss, dtype)
    total = P.sum(loss)
    if reduction == "sum":
        return P.cast(total, dtype)
    denom = P.sum(P.where(valid, w, 0.0)) if w is not None else P.sum(P.cast(valid, torch.float32))
    return P.cast(P.div(total, denom), dtype)


@register(F.cross_entropy)
def cross_entropy(x, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                  label_smoothing=0.0):
    if label_smoothing:
        raise Unsupported("label smoothing")
    class_dim = 1 if x.ndim > 1 else 0
    if not target.dtype.is_floating_point:  # class indices: picked from the logits (_class_pick)
        y = _upcast(x)
        m = _stabilizer(P.amax(y, class_dim, True))
        lse = (m, P.log(P.sum(P.exp(P.sub(y, m)), class_dim, True)))
        return P.cast(_nll(y, target, weight, ignore_index, reduction, class_dim, lse, y.dtype), x.dtype)
    if weight is not None:
        raise Unsupported("class weights with probability targets")
    loss = P.neg(P.sum(P.mul(log_softmax(_upcast(x), class_dim), target), class_dim))
    n = math.prod(loss.shape)
    out = loss if reduction == "none" else (P.sum(loss) if reduction == "sum" else P.div(P.sum(loss), n))
    return P.cast(out, x.dtype)


@register(F.mse_loss)
def mse_loss(x, target, size_average=None, reduce=None, reduction="mean", weight=None):
    if weight is not None or size_average is not None or reduce is not None:
        raise Unsupported("mse_loss options")
    d = P.sub(x, target)
    sq = P.mul(d, d)
    return sq if reduction == "none" else (sum_(sq) if reduction == "sum" else mean(sq))


# --- views ----------------------------------------------------------------------------------------
@register(_method("view"), *_t("reshape"))
def reshape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise Unsupported("view as another dtype")
    return P.reshape(x, _sizes(shape))


@register(_method("view_as"), *_t("reshape_as"))
def view_as(x, other):
    return P.reshape(x, other.shape)


@register(*_t("flatten"))
def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return P.reshape(x, (1,))
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return P.reshape(x, x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:])


@register(*_t("unflatten"))
def unflatten(x, dim, sizes):
    dim = dim % x.ndim
    return P.reshape(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:])


@register(*_t("permute"))
def permute(x, *dims):
    return P.permute(x, _sizes(dims))


@register(*_t("transpose", "swapaxes", "swapdims"))
def transpose(x, d0, d1):
    return P.transpose(x, d0, d1)


@register(*_t("t"))
def t(x):
    return P.transpose(x, 0, 1)


@register(*_t("movedim", "moveaxis"))
def movedim(x, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src, dst = [s % x.ndim for s in src], [d % x.ndim for d in dst]
    rest = [d for d in range(x.ndim) if d not in src]
    order = [None] * x.ndim
    for s, d in zip(src, dst):
        order[d] = s
    it = iter(rest)
    return P.permute(x, [o if o is not None else next(it) for o in order])


@register(_method("expand"))
def expand(x, *shape):
    return P.expand(x, _sizes(shape))


@register(_method("expand_as"))
def expand_as(x, other):
    return P.expand(x, other.shape)


@register(*_t("broadcast_to"))
def broadcast_to(x, shape):
    return P.expand(x, shape)


@register(*_t("squeeze"))
def squeeze(x, dim=None):
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(d % builtins.max(x.ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim))
    return P.squeeze_dims(x, dims)


@register(*_t("unsqueeze"))
def unsqueeze(x, dim):
    return P.unsqueeze(x, dim)


@register(*_t("contiguous"))
def contiguous(x, memory_format=torch.contiguous_format):
    return x if x.val.is_contiguous(memory_format=memory_format) else P.copy(x, memory_format)


@register(*_t("clone"))
def clone(x, memory_format=torch.preserve_format):
    return P.copy(x, memory_format)


@register(*_t("detach"), no_grad_view)
def detach(x):
    return emit(prim.stop_gradient, x)


@register(unrecorded_write)
def _unrecorded_write(t, v):
    return emit(prim.with_value, t, P.cast(v, t.dtype))


@register(*_t("narrow"))
def narrow(x, dim, start, length):
    return P.slice(x, dim, start, start + length)


@register(*_t("select"))
def select(x, dim, index):
    return P.select(x, dim, index)


@register(*_t("split"))
def split(x, split_size_or_sections, dim=0):
    size = x.shape[dim % x.ndim]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        bounds = list(range(0, size, step)) or [0]
        sizes = [builtins.min(step, size - b) for b in bounds]
    else:
        sizes = list(split_size_or_sections)
    out, start = [], 0
    for s in sizes:
        out.append(P.slice(x, dim, start, start + s))
        start += s
    return tuple(out)


@register(*_t("chunk"))
def chunk(x, chunks, dim=0):
    size = x.shape[dim % x.ndim]
    return split(x, builtins.max(-(-size // chunks), 1), dim)


@register(*_t("unbind"))
def unbind(x, dim=0):
    return tuple(P.select(x, dim, i) for i in range(x.shape[dim % x.ndim]))


@register(*_t("repeat"))
def repeat(x, *sizes):
    sizes = _sizes(sizes)
    lead = len(sizes) - x.ndim
    base = P.reshape(x, (1,) * lead + x.shape)
    inter = []
    for r, s in zip(sizes, base.shape):
        inter += [r, s]
    expanded = P.expand(P.reshape(base, [v for s in base.shape for v in (1, s)]), inter)
    return P.reshape(expanded, [r * s for r, s in zip(sizes, base.shape)])


def _triangle(x, diagonal, lower):
    rows, cols = x.shape[-2], x.shape[-1]
    r = P.reshape(P.iota(rows), (rows, 1))
    c = P.reshape(P.iota(cols), (1, cols))
    keep = P.le(P.sub(c, r), diagonal) if lower else P.ge(P.sub(c, r), diagonal)
    return P.where(keep, x, P.cast(0, x.dtype))


register(*_t("tril"))(lambda x, diagonal=0: _triangle(x, diagonal, True))
register(*_t("triu"))(lambda x, diagonal=0: _triangle(x, diagonal, False))


@register(operator.getitem)
def getitem(x, index):
    if not isinstance(x, TVal):
        return x[index]
    index = index if isinstance(index, tuple) else (index,)
    if builtins.any(isinstance(i, (TVal, list)) for i in index):
        raise Unsupported("tensor indexing")
    n_real = builtins.sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (builtins.slice(None),) * (x.ndim - n_real) + index[at + 1:]
    out, dim = x, 0
    for i in index:
        if i is None:
            out = P.unsqueeze(out, dim)
            dim += 1
        elif isinstance(i, builtins.slice):
            if i.step is not None and i.step <= 0:
                raise Unsupported("non-positive slice step")
            out = P.slice(out, dim, i.start, i.stop, i.step or 1)
            dim += 1
        else:
            out = P.select(out, dim, int(i))
    return out


@register(builtins.getattr)
def getattr_(x, name):
    if name == "T":
        return P.permute(x, tuple(reversed(range(x.ndim))))
    if name == "mT":
        return P.transpose(x, -2, -1)
    if name == "shape":
        return x.shape
    if name == "device":
        return P.builder().device
    return getattr(x.val, name)


@register(_method("size"))
def size(x, dim=None):
    return x.shape if dim is None else x.shape[dim]


@register(_method("dim"))
def dim_(x):
    return x.ndim


@register(_method("numel"), torch.numel)
def numel(x):
    return x.numel()


@register(torch.ops.aten.sym_size.int)
def sym_size(x, dim):
    return x.shape[dim]


@register(*_t("cat", "concat", "concatenate"))
def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors[:1])
    if len(tensors) == 1:
        return tensors[0]
    dtype = P.result_type(*tensors)
    dim = dim % tensors[0].ndim
    return emit(prim.cat, [P.cast(t, dtype) for t in tensors], dim)


@register(*_t("stack"))
def stack(tensors, dim=0):
    dim = dim % (tensors[0].ndim + 1)
    return cat([P.unsqueeze(t, dim) for t in tensors], dim)


@register(F.pad)
def pad(x, pad, mode="constant", value=None):
    if mode != "constant" or (value not in (None, 0, 0.0)) or builtins.any(p < 0 for p in pad):
        raise Unsupported("pad other than zero padding")
    out = x
    for i in range(len(pad) // 2):
        dim = x.ndim - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before or after:
            shape = list(out.shape)
            shape[dim] += before + after
            out = emit(prim.slice_backward, out, tuple(shape), dim, before, before + out.shape[dim], 1)
    return out


# --- creation -------------------------------------------------------------------------------------
def _creation_dtype(dtype, value=0.0):
    if dtype is not None:
        return dtype
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, int) else torch.get_default_dtype()


def _check_device(device):
    if device is not None and torch.device(device).type != P.builder().device.type:
        raise Unsupported("tensor created on another device")


@register(torch.full)
def full(size, fill_value, *, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
    _check_device(device)
    return P.full(tuple(size), fill_value, _creation_dtype(dtype, fill_value))


def _filled(value):
    def fn(*size, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False, memory_format=None):
        _check_device(device)
        return P.full(_sizes(size), value, dtype or torch.get_default_dtype())
    return fn


register(torch.zeros, torch.empty)(_filled(0))
register(torch.ones)(_filled(1))


def _filled_like(value):
    def fn(x, *rest, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False,
           memory_format=None, fill_value=None):
        v = rest[0] if rest else (fill_value if fill_value is not None else value)
        _check_device(device)
        return P.full(x.shape, v, dtype or x.dtype)
    return fn


register(torch.zeros_like, torch.empty_like)(_filled_like(0))
register(torch.ones_like)(_filled_like(1))
register(torch.full_like)(_filled_like(None))


def _new_filled(value):
    def fn(x, *size, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
        _check_device(device)
        return P.full(_sizes(size), value, dtype or x.dtype)
    return fn


register(_method("new_zeros"), _method("new_empty"))(_new_filled(0))
register(_method("new_ones"))(_new_filled(1))


@register(torch.arange)
def arange(start, end=None, step=1, *, dtype=None, device=None, layout=None, pin_memory=False,
           requires_grad=False):
    _check_device(device)
    if end is None:
        start, end = 0, start
    length = builtins.max(math.ceil((end - start) / step), 0)
    if dtype is None:
        dtype = torch.int64 if builtins.all(isinstance(v, int) for v in (start, end, step)) else \
            torch.get_default_dtype()
    if dtype.is_floating_point:
        return P.add(P.mul(P.cast(P.iota(length), dtype), step), start)
    # an integer dtype: torch truncates start, end and step to integers first; for int64 the
    # length comes from them too (integer division rounding to zero), as its kernel computes it
    start, end, step = int(start), int(end), int(step)
    if dtype == torch.int64:
        n = end - start + step - (step > 0) + (step < 0)
        length = builtins.max(abs(n) // abs(step) * (1 if (n >= 0) == (step > 0) else -1), 0)
    return P.iota(length, start, step, dtype=dtype)


def random(kind, shape, dtype):
    b = P.builder()
    seed = b.seed()
    out = emit(prim.PRIMITIVES[kind], seed, tuple(shape), dtype=torch.float32, device=b.device,
               stream=b.next_stream())
    return P.cast(out, dtype)


def _random_creation(kind):
    def fn(*size, generator=None, dtype=None, device=None, layout=None, pin_memory=False, requires_grad=False):
        if generator is not None:
            raise Unsupported("explicit generator")
        _check_device(device)
        return random(kind, _sizes(size), dtype or torch.get_default_dtype())
    return fn


register(torch.rand)(_random_creation("rand"))
register(torch.randn)(_random_creation("randn"))
register(torch.rand_like)(lambda x, dtype=None, **kw: random("rand", x.shape, dtype or x.dtype))
register(torch.randn_like)(lambda x, dtype=None, **kw: random("randn", x.shape, dtype or x.dtype))


# --- extern: matmul, convolution, embedding -------------------------------------------------------
def _same_dtype(a, b):
    dtype = P.result_type(a, b)
    return P.cast(a, dtype), P.cast(b, dtype)


# GEMMs at least this large (M*N*K) get their unaligned dims padded (`_gemm`)
PAD_GEMM_MIN = 1 << 30


def _gemm_alignment(dtype):
    """Elements per 16 bytes where cuBLAS needs 16-byte aligned leading dims for its fast kernels
    (half precision on a GPU: an odd vocabulary size runs SIMT/`align1` kernels 3-5x slower);
    None: no padding."""
    return 8 if P.builder().device.type == "cuda" and _is_half(dtype) else None


def _gemm(p, a, b, bias=None):
    """`p` (mm or addmm) of a (M, K) and b (K, N), each dim zero-padded to cuBLAS's alignment when
    it is not aligned and the product is large: padded K columns meet only zeros, padded M rows
    and N columns are sliced off, so values are the GEMM's own. The pads are pointwise ops that fuse
    into the kernels producing the operands, and the VJPs through pad and slice keep the
    backward's GEMMs aligned too (the gradient arrives padded)."""
    (m, k), n = a.shape, b.shape[1]
    align = _gemm_alignment(a.dtype)
    pm, pk, pn = ((-m) % align, (-k) % align, (-n) % align) if align else (0, 0, 0)
    if not (pm or pk or pn) or m * n * k < PAD_GEMM_MIN:
        return emit(p, *([] if bias is None else [bias]), a, b)
    a = _zero_pad(a, (m + pm, k + pk))  # (m: the backward's weight gradient sums over it)
    b = _zero_pad(b, (k + pk, n + pn))
    bias = None if bias is None else _zero_pad(bias, (n + pn,))
    return P.slice(P.slice(emit(p, *([] if bias is None else [bias]), a, b), 0, 0, m), 1, 0, n)


def _zero_pad(x, shape):
    """`x` with zeros after its end in each dim to make `shape`; a transposed matrix (a linear's
    weight) padded in its own layout, then transposed: a copy, not a transposing copy."""
    if x.node.target is prim.permute and x.node.args[1] == (1, 0):
        src = x.node.args[0]
        return P.transpose(_zero_pad(TVal(src, src.meta["val"]), shape[::-1]), 0, 1)
    for dim, size in enumerate(shape):
        if size != x.shape[dim]:
            grown = x.shape[:dim] + (size,) + x.shape[dim + 1:]
            x = emit(prim.slice_backward, x, grown, dim, 0, x.shape[dim], 1)
    return x


@register(*_t("mm"))
def mm(a, b):
    return _gemm(prim.mm, *_same_dtype(a, b))


@register(*_t("bmm"))
def bmm(a, b):
    return emit(prim.bmm, *_same_dtype(a, b))


@register(*_t("matmul"), operator.matmul, _method("__matmul__"))
def matmul(a, b):
    a, b = _same_dtype(a, b)
    if a.ndim == 1 and b.ndim == 1:
        return P.reshape(emit(prim.mm, P.reshape(a, (1, -1)), P.reshape(b, (-1, 1))), ())
    if a.ndim == 1:
        return P.squeeze_dims(matmul(P.unsqueeze(a, 0), b), (b.ndim - 2,))
    if b.ndim == 1:
        return P.squeeze_dims(matmul(a, P.unsqueeze(b, 1)), (a.ndim - 1,))
    if b.ndim == 2:
        out = _gemm(prim.mm, P.reshape(a, (-1, a.shape[-1])), b)
        return P.reshape(out, a.shape[:-1] + (b.shape[-1],))
    batch = P.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = P.reshape(P.expand(a, batch + a.shape[-2:]), (-1,) + a.shape[-2:])
    b3 = P.reshape(P.expand(b, batch + b.shape[-2:]), (-1,) + b.shape[-2:])
    return P.reshape(emit(prim.bmm, a3, b3), batch + (a.shape[-2], b.shape[-1]))


def _biased_gemm(bias, a, b):
    """a @ b + bias, a (M, K) and b (K, N). A bias row (N,) of a's and b's half precision goes
    into one extern call as eager's (`F.linear`, `torch.addmm`): cuBLAS adds it in its epilogue
    before the product rounds, at no cost (a separate add costs a pass over the output where no
    kernel fuses with it: the attention's QKV projection, whose reader is SDPA). In fp32 the
    epilogue makes cuBLAS pick slower kernels (H100, BERT-base's 3072 -> 768 projection: 500 us
    with the bias, 418 without), so there the add is pointwise and fuses with what follows (GeLU,
    the residual add before a layer norm)."""
    if tuple(bias.shape) == (b.shape[1],) and a.dtype == b.dtype == bias.dtype and _is_half(a.dtype):
        return _gemm(prim.addmm, a, b, bias)
    return P.add(mm(a, b), bias)


@register(F.linear)
def linear(x, weight, bias=None):
    if bias is None or x.ndim < 2 or weight.ndim != 2 or tuple(bias.shape) != (weight.shape[0],):
        out = matmul(x, P.transpose(weight, 0, 1))  # (a bias may broadcast over x's leading dims)
        return out if bias is None else P.add(out, bias)
    out = _biased_gemm(bias, P.reshape(x, (-1, x.shape[-1])), P.transpose(weight, 0, 1))
    return P.reshape(out, x.shape[:-1] + (weight.shape[0],))


@register(*_t("addmm"))
def addmm(bias, a, b, *, beta=1, alpha=1):
    if alpha == 1 and beta == 1:
        return _biased_gemm(bias, a, b)
    out = mm(a, b)
    if alpha != 1:
        out = P.mul(out, alpha)
    return P.add(out, bias if beta == 1 else P.mul(bias, beta))


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _in_eager_layout(out, x, weight):
    """A convolution's result `out` predicted in eager's layout (prim.conv2d_result_layout):
    predicted wrong, it would be copied into the predicted layout on every call."""
    out.val = out.node.meta["val"] = prim.conv2d_result_layout(out.val, x.val, weight.val)
    return out


@register(F.conv2d, torch.conv2d)
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    if isinstance(padding, str):
        raise Unsupported("string padding")
    x, weight = _same_dtype(x, weight)
    with_bias = bias is not None and _is_half(x.dtype)  # eager adds the bias before it rounds, once
    out = _in_eager_layout(emit(prim.conv2d, x, weight, bias if with_bias else None, _pair(stride), _pair(padding),
                                _pair(dilation), groups), x, weight)
    if with_bias:
        return out
    # an unbatched input (C, H, W) gives an unbatched result: the bias broadcasts over (C, 1, 1)
    return out if bias is None else P.add(out, P.reshape(bias, (-1, 1, 1) if x.ndim == 3 else (1, -1, 1, 1)))


@register(F.embedding)
def embedding(indices, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise Unsupported("embedding options")
    return emit(prim.embedding, indices, weight, -1 if padding_idx is None else padding_idx % weight.shape[0])


@register(torch.embedding)
def aten_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return embedding(indices, weight, None if padding_idx < 0 else padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                     sparse=sparse)


def _register_c_method_spellings():
    """A few methods torch.Tensor overrides in Python (split, norm, ...) also reach graphs as the
    C method of torch._C.TensorBase: the same decomposition serves both."""
    for name in dir(torch.Tensor):
        python_fn, c_fn = getattr(torch.Tensor, name), getattr(torch._C.TensorBase, name, None)
        if c_fn is not None and c_fn is not python_fn and callable(python_fn) and python_fn in DECOMPOSITIONS:
            DECOMPOSITIONS.setdefault(c_fn, DECOMPOSITIONS[python_fn])


_register_c_method_spellings()


# --- functional forms of writes: capture's functionalization emits these ATen overloads -----------
def _over(x, new):
    """`new` (cast and broadcast to x) in place of x's values; x stays in the autograd graph with
    a zero gradient, as after eager's in-place write."""
    new = P.cast(new, x.dtype) if isinstance(new, TVal) else P.full((), new, dtype=x.dtype)
    return P.where(P.full(tuple(x.shape), True, dtype=torch.bool), new, x)


@register(torch.ops.aten.copy.default)
def aten_copy(x, src, non_blocking=False):
    return _over(x, src)


@register(torch.ops.aten.fill.Scalar, torch.ops.aten.fill.Tensor)
def aten_fill(x, value):
    return _over(x, value)


@register(torch.ops.aten.zero.default)
def aten_zero(x):
    return _over(x, 0)


from . import normalization, pooling  # noqa: E402,F401  (register layer_norm, batch_norm, rms_norm; pooling)
