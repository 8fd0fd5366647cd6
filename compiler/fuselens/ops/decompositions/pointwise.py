"""Elementwise ops: arithmetic (torch's, Python's operators on tensors and on numbers), unary math,
activations, clamps, comparisons, logic, selection, casts."""
from __future__ import annotations

import builtins
import functools
import math
import operator

import torch
import torch.nn.functional as F

from .. import builder as P
from ..builder import TVal
from ..primitives import PRIMITIVES
from .conventions import both_python, opmath, upcast
from .registry import DECOMPOSITIONS, Unsupported, register, spellings, tensor_method


# --- arithmetic -----------------------------------------------------------------------------------
@register(*spellings("add"), operator.add, tensor_method("__add__"), tensor_method("__radd__"))
def add(a, b, *, alpha=1):
    if both_python(a, b):
        return a + b * alpha
    return P.add(a, b if alpha == 1 else P.mul(b, alpha))


@register(*spellings("sub", "subtract"), operator.sub, tensor_method("__sub__"))
def sub(a, b, *, alpha=1):
    if both_python(a, b):
        return a - b * alpha
    return P.sub(a, b if alpha == 1 else P.mul(b, alpha))


@register(tensor_method("__rsub__"), torch.rsub)
def rsub(a, b, alpha=1):
    return sub(b, a, alpha=alpha)


@register(*spellings("mul", "multiply"), operator.mul, tensor_method("__mul__"), tensor_method("__rmul__"))
def mul(a, b):
    return a * b if both_python(a, b) else P.mul(a, b)


@register(*spellings("div", "divide", "true_divide"), operator.truediv, tensor_method("__truediv__"))
def div(a, b, *, rounding_mode=None):
    if both_python(a, b):
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


@register(tensor_method("__rtruediv__"))
def rdiv(a, b):
    # torch's own spelling: reciprocal, then a product (each rounded in half precision)
    return P.mul(P.div(1.0, a), b)


@register(operator.floordiv, torch.floor_divide, tensor_method("__floordiv__"))
def floordiv(a, b):
    return div(a, b, rounding_mode="floor")


@register(operator.mod)
def py_mod(a, b):
    if both_python(a, b):
        return a % b
    raise Unsupported("tensor remainder")


@register(*spellings("neg", "negative"), operator.neg, tensor_method("__neg__"))
def neg(x):
    return -x if not isinstance(x, TVal) else P.neg(x)


@register(operator.pos)
def pos(x):
    return x


@register(*spellings("abs"), operator.abs, tensor_method("__abs__"))
def abs_(x):
    return builtins.abs(x) if not isinstance(x, TVal) else P.abs(x)


@register(*spellings("pow"), operator.pow, tensor_method("__pow__"))
def pow_(a, b):
    if both_python(a, b):
        return a ** b
    small_power = isinstance(b, (int, float)) and float(b).is_integer() and 1 <= b <= 4
    if not P.result_type(a, b).is_floating_point and not small_power:
        # integer powers (2 ** -1 == 0) are no floating-point pow: torch computes them
        raise Unsupported("integer pow")
    return P.pow(a, b)


@register(tensor_method("__rpow__"))
def rpow(a, b):
    return pow_(b, a)


@register(*spellings("square"))
def square(x):
    return P.mul(x, x)


def _declared(p):
    """The decomposition of the torch ops a primitive declared with `prim.unary`/`prim.binary`
    computes alone: its builder helper, for tensor operands of dtypes the torch op takes (for
    others, the torch call itself, which raises eager's error)."""
    helper = getattr(P, p.name)

    def fn(*args, **kwargs):
        if kwargs or len(args) != p.arity or not builtins.all(isinstance(a, TVal) for a in args) or \
                not _takes(p, tuple(a.dtype for a in args)):
            raise Unsupported(f"{p.name} of these arguments")
        out = helper(*args)
        if p.alone is not None and out.node.target is p:
            out.node.meta["alone"] = True  # the user's op itself (its cpp_alone spelling)
        return out
    fn.__name__ = p.name
    return fn


@functools.cache
def _takes(p, dtypes):
    """Whether the torch op of primitive `p` has a kernel for operands of `dtypes` (hypot has none
    for integers)."""
    try:
        p.impl(*(torch.ones(1, dtype=d) for d in dtypes))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


for _p in PRIMITIVES.values():
    if _p.torch_names:
        register(*spellings(*_p.torch_names, functional=True))(_declared(_p))


@register(*spellings("log2"))
@opmath
def log2(x):
    return P.mul(P.log(x), 1 / math.log(2))


@register(*spellings("log10"))
@opmath
def log10(x):
    return P.mul(P.log(x), 1 / math.log(10))


@register(*spellings("expm1"))
@opmath
def expm1(x):
    return P.sub(P.exp(x), 1)


@register(*spellings("tan"))
@opmath
def tan(x):
    return P.div(P.sin(x), P.cos(x))


@register(*spellings("reciprocal"))
def reciprocal(x):
    return P.div(1.0, x)


@register(*spellings("sign", "sgn"))
def sign(x):
    if x.dtype == torch.bool:
        return x
    # NaN is neither > 0 nor < 0: its sign is 0, as torch's
    return P.cast(P.where(P.gt(x, 0), 1, P.where(P.lt(x, 0), -1, 0)), x.dtype)


@register(*spellings("clamp", "clip"))
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


DECOMPOSITIONS[tensor_method("clamp_min")] = lambda x, min: clamp(x, min=min)
DECOMPOSITIONS[tensor_method("clamp_max")] = lambda x, max: clamp(x, max=max)
DECOMPOSITIONS[torch.clamp_min] = DECOMPOSITIONS[tensor_method("clamp_min")]
DECOMPOSITIONS[torch.clamp_max] = DECOMPOSITIONS[tensor_method("clamp_max")]


# --- comparisons, logic, selection ----------------------------------------------------------------
def _compare(p_fn, py_op, *names):
    def fn(a, b):
        return py_op(a, b) if both_python(a, b) else p_fn(a, b)
    register(*spellings(*names), py_op, tensor_method(f"__{py_op.__name__}__"))(fn)


for _p, _op, _names in ((P.eq, operator.eq, ("eq",)), (P.ne, operator.ne, ("ne", "not_equal")),
                        (P.lt, operator.lt, ("lt", "less")), (P.le, operator.le, ("le", "less_equal")),
                        (P.gt, operator.gt, ("gt", "greater")), (P.ge, operator.ge, ("ge", "greater_equal"))):
    _compare(_p, _op, *_names)


def _logical(p_fn, *targets):
    def fn(a, b):
        if both_python(a, b):
            return targets[-1](a, b)
        for v in (a, b):
            if isinstance(v, TVal) and v.dtype != torch.bool:
                raise Unsupported("bitwise op on integers")
        return p_fn(a, b)
    register(*targets)(fn)


_logical(P.logical_and, *spellings("logical_and"), tensor_method("__and__"), operator.and_)
_logical(P.logical_or, *spellings("logical_or"), tensor_method("__or__"), operator.or_)
_logical(P.logical_xor, *spellings("logical_xor"), tensor_method("__xor__"), operator.xor)


@register(*spellings("logical_not"))
def logical_not(x):
    return P.logical_not(x)


@register(operator.invert, tensor_method("__invert__"), *spellings("bitwise_not"))
def invert(x):
    if not isinstance(x, TVal):
        return ~x
    if x.dtype != torch.bool:
        raise Unsupported("bitwise not on integers")
    return P.logical_not(x)


@register(*spellings("where"))
def where(cond, a=None, b=None):
    if a is None:
        raise Unsupported("where(cond) returns indices")
    return P.where(cond, a, b)


@register(*spellings("masked_fill"))
def masked_fill(x, mask, value):
    return P.where(mask, P.cast(value, x.dtype), x)


def _ignoring_nan(p_fn):
    """fmax/fmin: a NaN operand gives the other one (maximum/minimum propagate NaN)."""
    def fn(a, b):
        return P.where(P.ne(b, b), a, P.where(P.ne(a, a), b, p_fn(a, b)))
    return fn


register(*spellings("fmax"))(_ignoring_nan(P.maximum))
register(*spellings("fmin"))(_ignoring_nan(P.minimum))


@register(*spellings("isnan"))
def isnan(x):
    return P.ne(x, x)


@register(*spellings("isinf"))
def isinf(x):
    return P.eq(P.abs(x), math.inf)


# --- casts ----------------------------------------------------------------------------------------
for _name, _dtype in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                      ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64),
                      ("bool", torch.bool), ("short", torch.int16)):
    DECOMPOSITIONS[tensor_method(_name)] = (lambda d: lambda x, memory_format=None: P.cast(x, d))(_dtype)


@register(tensor_method("to"))
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


@register(torch.ops.aten._to_copy.default)
def to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """ATen's cast (in a composite's ATen ops recorded under autocast: capture/autocast.py)."""
    if layout not in (None, torch.strided) or memory_format not in (None, torch.preserve_format) or \
            (device is not None and torch.device(device).type != P.builder().device.type):
        raise Unsupported("_to_copy to another layout or device")
    return P.cast(x, dtype) if dtype is not None and dtype != x.dtype else P.copy(x)


@register(tensor_method("type_as"))
def type_as(x, other):
    return P.cast(x, other.dtype)


@register(tensor_method("type"))
def type_(x, dtype=None, non_blocking=False):
    if not isinstance(dtype, torch.dtype):
        raise Unsupported("type() with a string")
    return P.cast(x, dtype)
