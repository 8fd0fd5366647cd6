"""Activations: torch.nn.functional's and their ATen forms (in-place calls reach graphs as the
functional ATen op: `hardswish_` as `aten.hardswish`, decomposed with F.hardswish's rule).

Each computes what ATen's kernel computes (half precision in fp32, rounded once; the device's own
arithmetic where CPU and CUDA kernels differ). Where the gradient derived from the primitives
would differ from ATen's backward kernel at a boundary (hardsigmoid's is 0 at x = +-3, log
sigmoid's is 1/2 at 0), the gradient is ATen's formula (`_Derivative`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import builder as P
from .. import primitives as prim
from ..builder import emit
from .conventions import opmath, upcast
from .pointwise import _clamp
from .reductions import softmax
from .registry import Unsupported, register, spellings


class _Derivative:
    """The gradient of y = f(x) as ATen's backward kernel computes it: g * rule(x), in fp32."""

    def __init__(self, name, rule):
        self.name, self.rule = name, rule

    def __call__(self, g, xf):
        return [P.mul(g, self.rule(xf))]

    def __repr__(self):
        return f"{self.name}_backward"


def _with_derivative(y, xf, name, rule):
    return emit(prim.with_vjp, y, [xf], _Derivative(name, rule))


def _on_cuda() -> bool:
    return P.builder().device.type == "cuda"


def _sixth(v):
    """v / 6 as the device's kernels write it: CUDA's multiply by the float nearest 1/6."""
    return P.mul(v, 1 / 6) if _on_cuda() else P.div(v, 6.0)


def _aten_nn(*names):
    """torch._C._nn's functions of these names (what F's Python calls: compiling F.hardswish
    itself reaches its body's `torch._C._nn.hardswish`)."""
    return [getattr(torch._C._nn, n) for n in names if hasattr(torch._C._nn, n)]


def _float32(v) -> float:
    """v rounded to float32, as ATen's float kernels take their scalar arguments."""
    return float(torch.tensor(v, dtype=torch.float32))


def _float_only(x):
    if not x.dtype.is_floating_point:
        raise Unsupported("an activation of a non-float tensor")  # (eager's error, from the call)


@register(*spellings("relu", functional=True))
def relu(x, inplace=False):
    return P.where(P.le(x, 0), 0, x)


@register(F.leaky_relu)
def leaky_relu(x, negative_slope=0.01, inplace=False):
    return P.where(P.gt(x, 0), x, P.mul(x, negative_slope))


@register(F.gelu)
def gelu(x, approximate="none"):
    y = upcast(x)
    if approximate == "tanh":
        inner = P.mul(math.sqrt(2 / math.pi), P.add(y, P.mul(0.044715, P.mul(y, P.mul(y, y)))))
        out = P.mul(P.mul(0.5, y), P.add(1.0, P.tanh(inner)))
    else:
        out = P.mul(P.mul(0.5, y), P.add(1.0, P.gelu_erf(P.mul(y, 1 / math.sqrt(2)))))
    return P.cast(out, x.dtype)


@register(F.silu)
def silu(x, inplace=False):
    y = upcast(x)
    return P.cast(P.mul(y, P.sigmoid(y)), x.dtype)


@register(F.mish, *_aten_nn("mish"))
def mish(x, inplace=False):
    _float_only(x)
    y = upcast(x)
    return P.cast(P.mul(y, P.tanh(P.log1p(P.exp(y)))), x.dtype)


@register(F.softplus)
@opmath
def softplus(x, beta=1.0, threshold=20.0):
    scaled = P.mul(x, beta)
    return P.where(P.gt(scaled, threshold), x, P.div(P.log1p(P.exp(scaled)), beta))


@register(F.hardtanh)
def hardtanh(x, min_val=-1.0, max_val=1.0, inplace=False):
    """x clamped; ATen's gradient: 0 where x <= min or x >= max (at the bounds too), else 1 (NaN)."""
    out = _clamp(x, min_val, max_val, nan_gets_gradient=True)
    if not x.dtype.is_floating_point:
        return out
    rule = lambda v: P.where(P.logical_or(P.le(v, min_val), P.ge(v, max_val)), 0.0, 1.0)  # noqa: E731
    return _with_derivative(out, x, f"hardtanh[{min_val}, {max_val}]", rule)


@register(F.relu6, *_aten_nn("relu6"))
def relu6(x, inplace=False):
    return hardtanh(x, 0.0, 6.0)


@register(F.hardswish, *_aten_nn("hardswish"))
def hardswish(x, inplace=False):
    """x * min(max(x + 3, 0), 6) / 6; ATen's gradient: 0 up to -3, x / 3 + 1/2 below 3, then 1."""
    _float_only(x)
    y = upcast(x)
    out = _sixth(P.mul(y, _clamp(P.add(y, 3.0), 0.0, 6.0, nan_gets_gradient=True)))
    rule = lambda v: P.where(P.le(v, -3.0), 0.0, P.where(P.lt(v, 3.0), P.add(P.div(v, 3.0), 0.5), 1.0))  # noqa: E731
    return P.cast(_with_derivative(out, y, "hardswish", rule), x.dtype)


@register(F.hardsigmoid, *_aten_nn("hardsigmoid"))
def hardsigmoid(x, inplace=False):
    """min(max(x + 3, 0), 6) / 6; ATen's gradient: 1/6 strictly between -3 and 3, else 0."""
    _float_only(x)
    y = upcast(x)
    out = _sixth(_clamp(P.add(y, 3.0), 0.0, 6.0, nan_gets_gradient=True))
    rule = lambda v: P.where(P.logical_and(P.gt(v, -3.0), P.lt(v, 3.0)), 1 / 6, 0.0)  # noqa: E731
    return P.cast(_with_derivative(out, y, "hardsigmoid", rule), x.dtype)


@register(F.elu, *_aten_nn("elu"))
def elu(x, alpha=1.0, inplace=False, scale=1.0, input_scale=1.0):
    """x * scale above 0, else (exp(x * input_scale) - 1) * alpha * scale (ATen's elu; `scale` and
    `input_scale` are its ATen arguments, which selu and celu set). ATen's gradient: scale above 0,
    else input_scale * alpha * scale * exp(x * input_scale) (the derived one is NaN at -inf)."""
    _float_only(x)
    y = upcast(x)
    negcoef = _float32(_float32(alpha) * _float32(scale))
    out = P.where(P.gt(y, 0), P.mul(y, scale), P.mul(P.sub(P.exp(P.mul(y, input_scale)), 1.0), negcoef))
    rule = lambda v: P.where(P.le(v, 0), P.mul(P.exp(P.mul(v, input_scale)), input_scale * negcoef), scale)  # noqa: E731
    return P.cast(_with_derivative(out, y, f"elu[{alpha}, {scale}, {input_scale}]", rule), x.dtype)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@register(F.selu, torch.selu)
def selu(x, inplace=False):
    return elu(x, _SELU_ALPHA, scale=_SELU_SCALE)


@register(F.celu, torch.celu)
def celu(x, alpha=1.0, inplace=False):
    return elu(x, alpha, input_scale=1.0 / alpha)


@register(F.logsigmoid, *_aten_nn("log_sigmoid"))
def logsigmoid(x):
    """min(x, 0) - log1p(exp(-|x|)); ATen's gradient: (x < 0) - sign * z / (1 + z), z = exp(-|x|),
    sign 1 below 0, else -1 (1/2 at 0)."""
    _float_only(x)
    y = upcast(x)
    z = P.exp(P.neg(P.abs(y)))
    out = P.sub(P.where(P.lt(y, 0.0), y, 0.0), P.log1p(z))

    def rule(v):
        zv, below = P.exp(P.neg(P.abs(v))), P.lt(v, 0.0)
        return P.sub(P.where(below, 1.0, 0.0), P.mul(P.where(below, 1.0, -1.0), P.div(zv, P.add(zv, 1.0))))
    return P.cast(_with_derivative(out, y, "log_sigmoid", rule), x.dtype)


@register(*spellings("hardshrink", functional=True))
def hardshrink(x, lambd=0.5):
    _float_only(x)
    return P.where(P.logical_and(P.ge(x, -lambd), P.le(x, lambd)), 0.0, x)


@register(F.softshrink, *_aten_nn("softshrink"))
@opmath
def softshrink(x, lambd=0.5):
    _float_only(x)
    shrunk = P.where(P.gt(x, lambd), P.sub(x, lambd), P.where(P.lt(x, -lambd), P.add(x, lambd), 0.0))
    return P.where(P.ne(x, x), x, shrunk)


@register(*spellings("threshold", functional=True), F._threshold, *_aten_nn("threshold"))
def threshold(x, threshold, value, inplace=False):
    return P.where(P.le(x, threshold), value, x)


# torch.nn.functional's own Python compositions, as their code computes them
@register(F.softsign)
def softsign(x):
    return P.div(x, P.add(P.abs(x), 1))


@register(F.tanhshrink)
def tanhshrink(x):
    return P.sub(x, P.tanh(x))


@register(F.softmin)
def softmin(x, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        raise Unsupported("softmin without dim")  # (F's implicit-dim rule and its warning: the call's)
    return softmax(P.neg(P.cast(x, dtype) if dtype is not None else x), dim)


@register(F.glu, *_aten_nn("glu"))
@opmath
def glu(x, dim=-1):
    n = x.shape[dim]
    if n % 2:
        raise Unsupported("glu of an odd dim")  # (eager's error, from the call)
    a, b = P.slice(x, dim, 0, n // 2), P.slice(x, dim, n // 2, n)
    return P.mul(a, P.sigmoid(b))


@register(*spellings("prelu", functional=True))
def prelu(x, weight):
    if weight.numel() == 1:
        weight = P.reshape(weight, ())  # one slope: the result has x's shape (a 0-d x, a [1] weight)
    else:
        if x.ndim < 2 or weight.ndim != 1 or weight.numel() != x.shape[1]:
            raise Unsupported("prelu's weight of this shape")
        weight = P.reshape(weight, (x.shape[1],) + (1,) * (x.ndim - 2))
    return P.where(P.gt(x, 0), x, P.mul(weight, x))

