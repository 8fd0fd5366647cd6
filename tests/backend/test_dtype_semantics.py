"""Compiled results equal eager's bit for bit where eager's are defined by dtypes: conversions,
half-precision rounding of each op's result, result dtypes (torch's type promotion and the ops'
own rules), and NaN propagation in the max/min family."""
import operator
import re

import pytest
import torch
import torch.nn.functional as F

from fl_backend_testing import CPP, DEVICE, check, run, ulp_error

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def assert_same(got, expected):
    """Same dtype, shape and values (NaN where eager has NaN)."""
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


def compiled_equals_eager(fn, *inputs):
    _, got = run(fn, *inputs)
    assert_same(tuple(got), fn(*inputs))


def nans_where_eager_has_them(fn, x):
    """For values computed with exp (whose last fp32 bit may differ): NaN exactly where eager has NaN."""
    _, (got,) = run(fn, x)
    expected = fn(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.isnan(), expected.isnan())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def values(dtype, n=96, nan=False, seed=0):
    """Values of `dtype` that conversions can get wrong: fractions between representable half
    values (rounding), integers past bf16's 8 bits and fp32's 24, negatives, and NaN."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).to(DEVICE)
    if not dtype.is_floating_point:
        big = torch.tensor([257, 1023, -4097, 2 ** 24 + 1, -(2 ** 24) - 3, 2 ** 30 + 2 ** 22 + 1, 0, 1, -1])
        small = torch.randint(-3000, 3000, (n - len(big),), generator=g)
        return torch.cat([big, small]).to(dtype).to(DEVICE)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 300
    if nan:
        x[::7] = float("nan")
    return x.to(dtype).to(DEVICE)


CAST_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]


@pytest.mark.parametrize("src", CAST_DTYPES, ids=str)
@pytest.mark.parametrize("dst", CAST_DTYPES, ids=str)
def test_cast(src, dst):
    """A cast gives torch's value: rounded to nearest even into half types, ints and bools
    converted (not reinterpreted), floats to ints truncated, anything to bool as != 0."""
    to_int = src.is_floating_point and not (dst.is_floating_point or dst == torch.bool)
    x = values(src, nan=src.is_floating_point and not to_int)  # NaN to an int is undefined in eager
    compiled_equals_eager(lambda x: x.to(dst), x)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.int64, torch.bool], ids=str)
def test_cast_to_half_and_back_rounds(half, src):
    """The round trip through a half type inside one kernel is the rounded value (no cast elided)."""
    x = values(src)
    compiled_equals_eager(lambda x: x.to(half).to(src), x)
    compiled_equals_eager(lambda x: torch.where(x.to(half) > 0, x.to(half), x * 2), x)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_iota_to_half(half):
    """arange's int64 values converted to a half type (values past 256 are not all bf16s)."""
    x = torch.randn(300, device=DEVICE)
    compiled_equals_eager(lambda x: torch.arange(x.shape[0], device=x.device).to(half) + x.to(half), x)


HALF_PROGRAMS = {
    "chain": lambda a, b: (a * b + a) * b - a,
    "scalars": lambda a, b: (a * 0.1 + 0.1) / 3 - 0.3,
    "number_over_tensor": lambda a, b: 0.1 / (a.abs() + 1),
    "scalar_compare": lambda a, b: (a > 0.1) & (b <= -0.7),
    "scalar_where": lambda a, b: torch.where(a > 0, a, 0.1),
    "full": lambda a, b: torch.full(a.shape, 0.1, dtype=a.dtype, device=a.device) + a,
    "sum_then_use": lambda a, b: a - a.sum(-1, keepdim=True) * 0.01,
    "square": lambda a, b: a ** 2 + b * b,
    "to_float_after": lambda a, b: (a * b).float() + a.float(),
}


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(HALF_PROGRAMS))
def test_half_precision_results_rounded_as_eager(half, name):
    """Each op's result in a half type is rounded to it, as eager's is, though the kernel
    computes in fp32; Python scalars enter as ATen's kernels take them."""
    g = torch.Generator().manual_seed(1)
    a, b = ((torch.randn(4, 32, generator=g) * 4).to(half).to(DEVICE) for _ in range(2))
    a[0, 0] = 0.1  # the bf16/fp16 nearest 0.1: a comparison with the number 0.1 must see it rounded
    compiled_equals_eager(HALF_PROGRAMS[name], a, b)


ONE_KERNEL_OPS = {
    "log2": lambda x: torch.log2(x.abs() + 1), "log10": lambda x: torch.log10(x.abs() + 1),
    "expm1": lambda x: torch.expm1(x * 0.1), "tan": lambda x: torch.tan(x * 0.3), "softplus": F.softplus,
}


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(ONE_KERNEL_OPS))
def test_one_kernel_ops_round_once(half, name):
    """An op that ATen computes in one kernel (fp32 inside, one rounding) but fuselens with several
    primitives is computed in fp32 too: within the last bit of eager's (expm1 as exp(x) - 1 rounded
    in half precision was off by 128 units in the last place)."""
    fn = ONE_KERNEL_OPS[name]
    x = (torch.randn(4, 32, generator=torch.Generator().manual_seed(4)) * 4).to(half).to(DEVICE)
    _, (got,) = run(lambda x: fn(x), x)
    expected = fn(x)
    assert got.dtype == expected.dtype
    # one unit in the last place is at most eps relative
    torch.testing.assert_close(got.float(), expected.float(), rtol=torch.finfo(half).eps, atol=1e-6)


_ROUNDING_CALL = re.compile(r"(?<!def )fl_round_b?f16\w*\(")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_values_of_the_half_type_are_not_rounded_again(half):
    """Selections, negations, |x|, max/min and copies of values of a half type (loaded, or rounded
    once) are values of it: the kernel rounds only the product, and gives eager's values (-0.0
    included; NaN where eager's is)."""
    a, b = values(half, nan=True), values(half, seed=1)
    a[:3] = torch.tensor([-0.0, float("inf"), float("-inf")], dtype=half)
    fn = lambda a, b: torch.where(a > 0, -a, torch.maximum(a.abs(), b)).clone() * 3  # noqa: E731
    cg, (got,) = run(fn, a.to(DEVICE), b.to(DEVICE))
    assert_same(got, fn(a.to(DEVICE), b.to(DEVICE)))
    assert [len(_ROUNDING_CALL.findall(k.source)) for k in cg.kernels] == [1]


def test_a_quotient_by_a_rows_value_is_eagers_division():
    """x / (x.abs().amax(-1) * s), the divisor the row's own: the bits of IEEE division (eager's), by a
    reciprocal a row and a corrected product an element in Triton kernels (`row_quotient`), for
    numerators of any size and sign and zeros of both signs; subnormal, infinite and NaN operands
    and divisors (the first rows: their blocks divide as IEEE does)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-60, 20, (64, 128), generator=g).float())
    s = torch.ones(64, 1)
    x[1, :40] = 0.0
    x[1, 40:60] = -0.0
    x[2, 5], x[3, 7], x[4, 9] = 1e-40, float("inf"), float("nan")
    x[5] = torch.rand(128, generator=g) * 1e-36  # a subnormal quotient's numerators
    s[6], s[7], s[8] = 1e-30, 1e30, 0.0
    fn = lambda x, s: x / (x.abs().amax(-1, keepdim=True) * s)  # noqa: E731 (a max: the same in any order)
    cg, (got,) = run(fn, x.to(DEVICE), s.to(DEVICE))
    assert_same(got, fn(x.to(DEVICE), s.to(DEVICE)))
    if not CPP:
        assert "tl.fma" in cg.kernels[0].source


# --- result dtypes ----------------------------------------------------------------------------------
RESULT_DTYPE_OPS = {
    "sign": torch.sign, "sgn": torch.sgn, "abs": torch.abs, "neg": torch.neg, "ceil": torch.ceil,
    "floor": torch.floor, "relu": torch.relu, "square": torch.square, "sum": torch.sum, "isnan": torch.isnan,
    "logical_not": torch.logical_not,
    "clamp_float_bound": lambda x: torch.clamp(x, 0.5),
    "clamp_int_bound": lambda x: torch.clamp(x, -3, 3),
    "mul_float": lambda x: x * 1.5,
    "add_bool": lambda x: x + True,
    "mul_bool": lambda x: x * (x > 0),
    "div_int": lambda x: x / 2,
    "amax": lambda x: x.amax(-1),
    "where_float": lambda x: torch.where(x > 0, x, 0.5),
    "where_int": lambda x: torch.where(x > 0, x, 2),
    "max_binary": lambda x: torch.maximum(x, x.flip(-1)),
    "any": lambda x: x.any(-1),
    "masked_fill": lambda x: x.masked_fill(x > 0, 2),
    "rpow_int": lambda x: 2 ** ((x > 1).long() * -1),  # integer powers: 2 ** -1 == 0
    "pow_small": lambda x: x ** 2,
    "max_dim": lambda x: (x.max(-1)[0], x.max(-1)[1]),
}


@pytest.mark.parametrize("dtype", FLOATS + [torch.float64, torch.int64, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("name", sorted(RESULT_DTYPE_OPS))
def test_result_dtype_and_value(name, dtype):
    """The result's dtype is torch's (type promotion, the op's own rule: sign keeps a float dtype),
    and so is its value."""
    fn = RESULT_DTYPE_OPS[name]
    x = values(dtype, n=48, nan=dtype.is_floating_point).reshape(4, 12)
    try:
        fn(x)
    except (RuntimeError, NotImplementedError):
        pytest.skip("eager rejects this dtype")
    compiled_equals_eager(lambda x: fn(x), x)


def test_sign_of_a_reduction():
    """The repro: sign of a float max is a float."""
    compiled_equals_eager(lambda y: torch.sign(y.max()), torch.randn(4, 3, device=DEVICE))


# --- NaN in the max/min family -----------------------------------------------------------------------
NAN_OPS = {
    "max": lambda x: torch.max(x),
    "min": lambda x: torch.min(x),
    "amax_row": lambda x: x.amax(-1),
    "amin_row": lambda x: x.amin(-1),
    "amax_col": lambda x: x.amax(0),
    "amin_col": lambda x: x.amin(0),
    "max_dim": lambda x: (torch.max(x, -1)[0], torch.max(x, -1)[1]),
    "min_dim": lambda x: (torch.min(x, 0)[0], torch.min(x, 0)[1]),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(),
    "maximum": lambda x: torch.maximum(x, x.flip(0)),
    "minimum": lambda x: torch.minimum(x, 0.5 * x.flip(-1)),
    "fmax": lambda x: torch.fmax(x, x.flip(0)),
    "fmin": lambda x: torch.fmin(x, x.flip(-1)),
    "clamp": lambda x: torch.clamp(x, -0.5, 0.5),
    "relu": lambda x: torch.relu(x),
    "max_then_sub": lambda x: x - x.amax(-1, True),
    "sqrt_max": lambda x: x.sqrt().max(),
    "clamp_nan_bound": lambda x: torch.clamp(x.flip(0), min=x, max=x.flip(-1) + 1),
    "clamp_nan_scalar": lambda x: torch.clamp(x, max=float("nan")),
}
# persistent rows, looped rows (past 4096 elements), a column reduction split in two stages
NAN_SHAPES = [(5, 12), (2, 4500), (2048, 3)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(NAN_OPS))
def test_nan_propagates_as_eager(name, shape, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g)
    x[0, 1] = float("nan")  # one NaN in the first row and column
    x[-1, :] = float("nan")  # a row of NaNs
    if shape[1] > 3:
        x[1, -1] = float("nan")  # a NaN in the last, partly masked block of a row
    compiled_equals_eager(NAN_OPS[name], x.to(dtype).to(DEVICE))


@pytest.mark.parametrize("shape", NAN_SHAPES, ids=str)
def test_nan_through_softmax(shape):
    x = torch.randn(*shape)
    x[0, 1] = float("nan")
    x[-1, :] = float("nan")
    nans_where_eager_has_them(lambda x: torch.softmax(x, -1) + torch.log_softmax(x, 0), x.to(DEVICE))


# --- programs the backend used to fall back to eager on ---------------------------------------------
@pytest.mark.parametrize("spelling", ["and", "or", "xor", "rand", "method"])
def test_logical_op_with_python_bool(spelling):
    fn = {"and": lambda t: t & True, "or": lambda t: t | False, "xor": lambda t: t ^ True,
          "rand": lambda t: True & t, "method": lambda t: t.__and__(False)}[spelling]
    compiled_equals_eager(lambda x: fn(x > 0), torch.randn(9, device=DEVICE))


def test_maximum_with_0d_tensor():
    compiled_equals_eager(lambda x, c: torch.maximum(x, c) + torch.minimum(c, x), torch.randn(4, 5, device=DEVICE),
                          torch.tensor(0.3, device=DEVICE))


@pytest.mark.parametrize("grad", [False, True])
def test_long_chain(grad):
    """Hundreds of fused ops in one kernel: no RecursionError (every op's result feeds the next)."""
    def fn(x):
        for _ in range(300):
            x = x * 1.0001 + 0.001
        return x
    check(fn, torch.randn(7, device=DEVICE), grad=grad)


def test_constant_stored_from_looped_reduction_kernel():
    """A 0-d gradient that is a constant (zero), computed in a looped reduction kernel over a
    0-d mean: stored as a block of the single element's pointer shape."""
    def fn(x, c):
        m = x.mean()
        return (x / (m * m + 1)).sum() + 0
    check(fn, torch.randn(3, 5000, device=DEVICE), torch.randn((), device=DEVICE), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("op", [operator.add, operator.mul, torch.maximum])
def test_0d_values_in_looped_reductions(op):
    # Tolerances for sums of 10^4 terms: x is offset from zero so that s = x.sum() is no near-
    # cancellation (5000 * s magnifies its float32 rounding, ~1e-5 in eager and here alike), and
    # x's gradient, ~5000 * (sum of two random cotangents), may cancel to a small value but keeps
    # the absolute error of summing 10^4 of them (eager's up to 0.005 from float64's, the float
    # lanes' here 0.01).
    def fn(x, c):
        s = x.sum()
        return op(x, s).sum(-1), op(c, x.amax(-1)), (op(c, x) * s).amax(-1)
    check(fn, torch.randn(2, 5000, device=DEVICE) + 1, torch.tensor(0.5, device=DEVICE), rtol=1e-4, atol=5e-2)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_gradient_rounds_once(half):
    """A primitive's VJP in half precision is computed in fp32 and rounded once: tanh's gradient
    from the compiled forward's output is g * (1 - y * y) in fp32, rounded, bit for bit (rounding
    after each step is not). That is ATen's CPU tanh_backward; ATen's CUDA kernel rounds y * y to
    the half type first, so on a GPU the gradient is compared by its error instead: no larger
    than eager's against float64."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 16, generator=g) * 2).to(half).to(DEVICE).requires_grad_(True)
    cotangent = torch.randn(4, 16, generator=g).to(half).to(DEVICE)
    _, (out,) = run(lambda x: torch.tanh(x), x)
    got, = torch.autograd.grad(out, x, cotangent)
    y = out.detach()
    assert_same(got, (cotangent.float() * (1 - y.float() * y.float())).to(half))
    eager = torch.ops.aten.tanh_backward(cotangent, y)
    if DEVICE == "cpu":
        assert_same(got, eager)
    else:
        reference = cotangent.double() * (1 - y.double() * y.double())
        assert ulp_error(got, reference, half) <= ulp_error(eager, reference, half)
