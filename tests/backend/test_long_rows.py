"""Reductions of few long rows (a loss over everything, argmax over a vocabulary) run in two
stages on Triton targets (schedule/fusion.py `split_long_rows`); argmax and argmin are two
reductions, not ATen's call (ops/decompositions/reductions.py `_index_of_extreme`)."""
import re

import pytest
import torch

import fuselens
from fl_backend_testing import CPP, DEVICE, tolerance


def full_sum(x):
    return x.sum()


def mean_of_squares(x):
    return (x.float() * x.float()).mean()


def row_max(x):
    return x.amax(-1)


def outer_and_inner(x):
    return x.sum((0, 2))


@pytest.mark.parametrize("fn, shape", [(full_sum, (64, 1024)), (mean_of_squares, (2, 3, 128, 128)),
                                       (row_max, (3, 1 << 15)), (outer_and_inner, (8, 2, 8192)),
                                       (full_sum, (40000,))],
                         ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_long_rows_reduce_in_two_stages(fn, shape, dtype):
    x = torch.randn(*shape, device=DEVICE).to(dtype)
    cf = fuselens.compile(fn, dynamic=False)
    got, want = cf(x), fn(x)
    if not torch.allclose(got, want, **tolerance(dtype)):  # eager's bf16 sum errs by more at times
        exact = fn(x.double())  # (a full sum of 64x1024: 10.625 against eager's 10.0, exactly 10.606)
        assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max(), (got, want, exact)
    sizes = re.findall(r"xnumel=(\d+), rnumel=(\d+)", fuselens.inspect(cf)[0].graphs[0].wrapper)
    if CPP:  # (a C++ kernel shares a long row among its threads)
        return
    rows = {row_max: 3, outer_and_inner: 2}.get(fn, 1)
    assert len(sizes) == 2 and int(sizes[0][0]) >= 4 * rows and int(sizes[1][0]) == rows, sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("op", ["argmax", "argmin", "max", "min", "argmax_flat"])
def test_index_of_the_extreme_is_a_reduction_equal_to_eager(op, dtype):
    """The index of the first extreme of each row, a NaN's where the row has one, ties to the
    first; rows short (one kernel) and long (split): no ATen call."""
    fn = {"argmax": lambda x: x.argmax(-1), "argmin": lambda x: x.argmin(0, keepdim=True),
          "max": lambda x: torch.max(x, 1), "min": lambda x: x.min(-1, keepdim=True),
          "argmax_flat": lambda x: x.argmax()}[op]
    for shape in ((5, 7), (2, 40000)):
        x = (torch.randn(*shape, device=DEVICE) * 2).round().to(dtype)  # (ties)
        if dtype.is_floating_point:
            x[0, 3] = float("nan")
        cf = fuselens.compile(fn, dynamic=False)
        got, want = cf(x), fn(x)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        assert "prims.arg" not in fuselens.inspect(cf)[0].graphs[0].wrapper


def test_the_extreme_of_no_elements_raises_as_eager():
    fn = lambda x: x.argmax(1)  # noqa: E731
    x = torch.randn(3, 0, device=DEVICE)
    with pytest.raises(Exception) as expected:
        fn(x)
    with pytest.raises(Exception) as got:
        fuselens.compile(fn)(x)
    assert (type(got.value), str(got.value)) == (type(expected.value), str(expected.value))
