"""Classes of bugs the OpInfo full matrix (tests/conformance, FUSELENS_OPINFO=full) found in the
whole pipeline, kernels included: compiled results equal eager's and nothing falls back."""
from __future__ import annotations

import warnings

import pytest
import torch

import fuselens
from fuselens import FuselensWarning


def _same_as_eager(fn, *args):
    """fn compiled == eager on copies of args (results and what was written), with no fallback."""
    e_args = [a.clone() for a in args]
    c_args = [a.clone() for a in args]
    want = fn(*e_args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = fuselens.compile(fn)(*c_args)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(c_args, e_args, equal_nan=True)


# out= of a call whose meta run returns other tensors than `out` (a composite below the
# dispatcher): torch returns the out tensors themselves
def _matrix_rank_out(a, out):
    return torch.linalg.matrix_rank(a, out=out)


@pytest.mark.parametrize("fn, args", [
    (_matrix_rank_out, (torch.randn(3, 3), torch.zeros((), dtype=torch.int64))),
    (_matrix_rank_out, (torch.randn(2, 3, 3), torch.zeros(2, dtype=torch.int64))),
], ids=["0-d", "batched"])
def test_out_returns_the_out_tensors(fn, args):
    _same_as_eager(fn, *args)


# floor division of floats is eager's algorithm ((a - fmod(a, b)) / b), not floor of the rounded
# quotient: 1. // 0.1 == 9.
def _floordiv(a, b):
    return a // b, torch.div(a, b, rounding_mode="floor"), torch.floor_divide(a, b) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_floor_division(dtype):
    a = torch.tensor([1.0, -1.0, 5.0, 7.0, -7.5, 3.0], dtype=dtype)
    b = torch.tensor([0.1, 0.1, 0.5, -2.0, 2.5, 0.3], dtype=dtype)
    _same_as_eager(_floordiv, a, b)


# integer and bool inputs of ops that compute in floating point: the default float dtype,
# before any step (logsumexp), and primitives that have no bool kernel (abs) not reached
def _logsumexp(x):
    return torch.logsumexp(x, 0), torch.logsumexp(x, (0, 1), keepdim=True)


def _isinf(x):
    return torch.isinf(x), torch.isfinite(x)


@pytest.mark.parametrize("x", [torch.tensor([[3, 9, 0], [1, 2, 8]]),
                               torch.tensor([[True, False, True], [False, False, True]])],
                         ids=["int64", "bool"])
@pytest.mark.parametrize("fn", [_logsumexp, _isinf])
def test_integer_and_bool_inputs_of_float_math(fn, x):
    _same_as_eager(fn, x)


# a half-precision conv2d with a bias rounds as eager's: once on a CPU (oneDNN adds the bias before
# rounding), twice on a GPU (cuDNN's rounded result, then ATen's add of the bias)
def _conv_bias(x, w, b):
    return torch.nn.functional.conv2d(x, w, b, padding=1, groups=2)


@pytest.mark.parametrize("batched", [True, False])
def test_half_precision_conv_with_bias_rounds_once(batched):
    torch.manual_seed(0)
    x = torch.randn(*((2,) if batched else ()), 4, 6, 6).bfloat16()
    w, b = torch.randn(4, 2, 3, 3).bfloat16(), (torch.randn(4) * 3).bfloat16()
    want = _conv_bias(x, w, b)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = fuselens.compile(_conv_bias)(x, w, b)
        fuselens.compile(_conv_bias)(xs, ws, bs).float().sum().backward()
    assert torch.equal(got, want)
    xe, we, be = (t.clone().requires_grad_() for t in (x, w, b))
    _conv_bias(xe, we, be).float().sum().backward()
    for a, e in ((xs, xe), (ws, we), (bs, be)):
        torch.testing.assert_close(a.grad, e.grad, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_half_precision_conv_bias_where_eager_adds_it(device):
    """The decomposition (on meta tensors: no GPU needed) puts the bias where eager's convolution
    adds it: into the extern call on a CPU, a pointwise add after it on a GPU (cuDNN computes no
    bias; ATen adds it in a kernel of its own), which then fuses with the result's readers."""
    from fuselens.ops import primitives as prim
    from fuselens.ops.trace import to_primitive_graph
    x, w = torch.empty(2, 4, 6, 6, dtype=torch.bfloat16, device="meta"), torch.empty(4, 2, 3, 3, dtype=torch.bfloat16,
                                                                                        device="meta")
    graph = to_primitive_graph(torch.fx.symbolic_trace(_conv_bias), [x, w, torch.empty(4, dtype=torch.bfloat16,
                                                                                        device="meta")], device)
    (conv,) = [n for n in graph.nodes if n.target is prim.conv2d]
    adds = [n for n in graph.nodes if n.target is prim.add]
    assert (conv.args[2] is None, len(adds)) == ((True, 1) if device == "cuda" else (False, 0))


# ops over zero-size tensors whose decomposition reduces over an empty dim (softmax's amax):
# the result is empty (or torch's identity), as eager's
def _over_empty(x):
    return torch.softmax(x, 1), torch.log_softmax(x, 0), torch.logsumexp(x, 0)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0)])
def test_ops_over_zero_size_dims(shape):
    _same_as_eager(_over_empty, torch.randn(shape))


# arange of an integer dtype from float bounds: torch truncates them first (and, for int64,
# takes the length from the truncated values)
def _arange_int(x):
    return (x + torch.arange(-0.9, 2.1, 2.0, dtype=torch.int64).sum(),
            torch.arange(2.1, -2.9, -1.0, dtype=torch.int64), torch.arange(0.0, -8.000001, -4.0, dtype=torch.int64),
            torch.arange(-2.5, 3.7, 1.5, dtype=torch.int32), torch.arange(1.1, 5.1, 2.0, dtype=torch.int16))


def test_integer_arange_of_float_bounds():
    _same_as_eager(_arange_int, torch.zeros(2))


# gradients at NaN inputs are eager's: clamp gives a NaN element none (its mask min <= x <= max
# fails), maximum/minimum give both operands the whole gradient (neither loses to a NaN)
@pytest.mark.parametrize("fn", [
    lambda x, y: x.clamp(-0.5, 0.5), lambda x, y: torch.nn.functional.hardtanh(x),
    lambda x, y: (x * 1).clamp_(min=0.0), lambda x, y: torch.maximum(x, y),
    lambda x, y: torch.minimum(y, x), lambda x, y: torch.clamp(x, min=y),
], ids=["clamp", "hardtanh", "clamp_", "maximum", "minimum", "clamp tensor bound"])
def test_gradients_at_nan_inputs(fn):
    nan = float("nan")
    x0 = torch.tensor([0.2, nan, 3.0, -5.0, nan, 0.5])
    y0 = torch.tensor([0.1, 1.0, nan, -5.0, nan, 0.5])
    f = lambda x, y: fn(x, y) * torch.arange(1.0, 7.0)  # noqa: E731

    def grads(g):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        out = g(x, y)
        out.backward(torch.ones(6))
        return out.detach(), x.grad, y.grad
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = grads(fuselens.compile(f))
    for a, e in zip(got, grads(f)):
        torch.testing.assert_close(a, e, equal_nan=True)


# a result of another layout than its kernel's buffer (a transposed product) is no view: a
# caller may write into it in place with autograd on, as into eager's result
def _transposed_result(x, y):
    return (x - y).T.contiguous().T * torch.where(x > y, y, x * 0.5), x.t() * 3


def test_results_in_another_layout_can_be_written_in_place():
    x0, y0 = torch.randn(4, 5), torch.randn(4, 5)
    outs = {}
    for name, fn in (("eager", _transposed_result), ("compiled", fuselens.compile(_transposed_result))):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        a, b = fn(x, y)
        a.mul_(2)
        b.add_(1)
        (a.sum() + b.sum()).backward()
        outs[name] = (a.detach(), b.detach(), x.grad, y.grad)
    for c, e in zip(outs["compiled"], outs["eager"]):
        torch.testing.assert_close(c, e)


# a write autograd does not record (under no_grad, into a detached alias) leaves the tensor its
# history: its kernels write the values, its backward passes the gradient through every element
# (tests/compiler/test_opinfo_capture.py has the spellings; here the kernels and the VJP)
def _unrecorded_writes(x, y):
    with torch.no_grad():
        y[0] = 2.0
        x.unsqueeze(0).tanh_()
        y.t()[1].mul_(x[0])
    y.detach()[1, 0] = float("inf")
    return y * x, x.exp()


def test_writes_autograd_does_not_record_keep_history():
    def run(fn):
        x0 = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
        y0 = torch.tensor([[1.0, 1e8], [4.0, 5.0]], requires_grad=True)
        a, b = fn(x0 * 1, y0 * 1)
        (a.sum() + b.sum()).backward()
        return a.detach(), b.detach(), x0.grad, y0.grad
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = run(fuselens.compile(_unrecorded_writes))
    torch.testing.assert_close(got, run(_unrecorded_writes), equal_nan=True)


# An output the loss ignores gets no gradient: eager runs none of its VJP, so a NaN or inf
# of the forward there (0 * inf, 0 / 0) does not reach the gradients of the outputs it uses. The
# compiled backward leaves out the terms of missing gradients (autograd/cotangents.py).
_NAN = float("nan")
_INF = float("inf")


def _nan_in_ignored_output(x):
    return torch.sigmoid(x.sum(1, keepdim=True) * x), x * 2


def _exp_overflows(x):
    return x.exp(), x * 2


def _log_of_zero(x):
    h = x * 2
    return h.log(), h.sum(0) + h  # both from h: its gradient is a sum of the two


def _sqrt_of_zero(x):
    return x * 3, x.sqrt()


def _divided_by_zero(x):
    return x / (x - 1), x.tanh()


def _product_with_inf(x):
    w = torch.tensor([[_INF, 1.0], [2.0, -_INF]])
    return x @ w, x.sum(1)


def _three_outputs(x):
    return x.exp(), x.log(), x.sin()


@pytest.mark.parametrize("fn, x, used", [
    (_nan_in_ignored_output, [[_NAN, 1.0], [2.0, 3.0]], [1]),
    (_exp_overflows, [[100.0, 1.0], [2.0, 3.0]], [1]),
    (_log_of_zero, [[0.0, 1.0], [2.0, 3.0]], [1]),
    (_sqrt_of_zero, [[0.0, 1.0], [2.0, 3.0]], [0]),
    (_divided_by_zero, [[1.0, 1.0], [2.0, 3.0]], [1]),
    (_product_with_inf, [[0.0, 1.0], [2.0, 3.0]], [1]),
    (_three_outputs, [[0.0, 100.0], [2.0, 3.0]], [2]),
    (_three_outputs, [[0.0, 100.0], [2.0, 3.0]], [0, 2]),
    (_three_outputs, [[0.0, 100.0], [2.0, 3.0]], [0, 1, 2]),
], ids=["sigmoid NaN", "exp inf", "log 0 shared", "sqrt 0", "div 0", "matmul inf", "3 outputs 1 used",
        "3 outputs 2 used", "3 outputs all used"])
def test_outputs_the_loss_ignores_contribute_nothing(fn, x, used):
    def grad(fn):
        x0 = torch.tensor(x, requires_grad=True)
        outs = fn(x0)
        sum(outs[i].sum() for i in used).backward()
        return x0.grad
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        torch.testing.assert_close(grad(fuselens.compile(fn)), grad(fn), equal_nan=True)


def test_backward_programs_per_set_of_used_outputs():
    """One compiled function, losses over different outputs: each backward is eager's."""
    cf = fuselens.compile(_three_outputs)
    for used in ([1], [0, 2], [0, 1, 2], [2], [1]):
        grads = []
        for fn in (cf, _three_outputs):
            x0 = torch.tensor([[0.0, 100.0], [2.0, -3.0]], requires_grad=True)
            outs = fn(x0)
            sum(outs[i].sum() for i in used).backward()
            grads.append(x0.grad)
        torch.testing.assert_close(*grads, equal_nan=True)


@pytest.mark.parametrize("fn", [_nan_in_ignored_output, _exp_overflows, _log_of_zero, _divided_by_zero,
                                _sqrt_of_zero], ids=lambda f: f.__name__.strip("_"))
def test_outputs_the_loss_ignores_contribute_nothing_traced_graph(fn):
    """The same, for an FX graph handed to the backend (torch.compile's custom backends)."""
    from fl_backend_testing import compile as compile_traced
    x = [[_NAN, 0.0], [1.0, 100.0]]
    grads = []
    for compiled in (True, False):
        x0 = torch.tensor(x, requires_grad=True)
        outs = compile_traced(fn, x0)(x0) if compiled else fn(x0)
        outs[1 if fn is not _sqrt_of_zero else 0].sum().backward()
        grads.append(x0.grad)
    torch.testing.assert_close(*grads, equal_nan=True)


# max/min over a dim give the gradient to the element at their index, as eager's (amax/amin
# share it among ties, and a NaN extreme makes theirs NaN)
def _extremes_over_a_dim(x):
    return x.min(dim=0)[0], x.max(-1, keepdim=True).values * 2, torch.max(x, 1)[0].exp()


@pytest.mark.parametrize("x", [[[1.0, 2.0], [1.0, 0.0]], [[_NAN, 2.0], [1.0, 0.0]], [[3.0, 3.0], [3.0, 3.0]]],
                         ids=["tie", "NaN", "all equal"])
def test_max_min_over_a_dim_differentiate_at_their_index(x):
    grads = []
    for fn in (fuselens.compile(_extremes_over_a_dim), _extremes_over_a_dim):
        x0 = torch.tensor(x, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FuselensWarning)
            outs = fn(x0)
        sum(o.sum() for o in outs).backward()
        grads.append(x0.grad)
    torch.testing.assert_close(*grads, equal_nan=True)


def test_max_over_a_dim_without_gradients_computes_no_index():
    """The index routes max's gradient only: a graph without autograd computes the values alone."""
    def f(x):
        return torch.max(x, 1)[0] * 2
    cf = fuselens.compile(f)
    cf(torch.randn(4, 8))
    wrapper = fuselens.inspect(cf)[0].graphs[0].wrapper
    assert "argmax" not in wrapper and "with_value" not in wrapper, wrapper
