"""NumPy scalars are numbers in capture: the graph computes with the number eager's torch reads
each one as (int, float or complex, whatever its NumPy type), they are guarded by value wherever
they come from (globals, closures, attributes, arguments, NumPy calls on constants), and no
generated code names NumPy (`np.float64(0.5)` is no name a graph's or a resume's code has)."""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import fuselens
from fuselens import FuselensWarning
from fl_capture_testing import check

SCALARS = [np.bool_(True), np.int8(-3), np.int16(300), np.int32(-7), np.int64(2**40), np.uint8(200),
           np.uint16(60000), np.uint32(3_000_000_000), np.uint64(2**40 + 1), np.float16(0.1),
           np.float32(0.1), np.float64(0.1), np.complex64(0.5 + 2j), np.complex128(0.5 - 1j)]


def _as_number(s):
    def f(x, a):
        out = (x * s, s * x, x + a, x * s.item(), x * np.sqrt(abs(s)))
        if x.dtype != torch.bool:  # (eager refuses to subtract from a bool tensor)
            out += (x - s,)
        if not isinstance(s, np.complexfloating):
            out += (x * float(s), x * int(s))
        return out
    return f


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("s", SCALARS, ids=lambda s: type(s).__name__)
def test_a_numpy_scalar_is_the_number_eager_reads(s, dtype):
    """Each NumPy scalar type, as an operand in both orders, as an argument, through `.item()`,
    `float()`, `int()` and a ufunc: the results' values and dtypes are eager's (a float32 scalar
    was a 0.0 in the graph; a float64 one a NameError from the graph's code)."""
    x = (torch.arange(4) - 1).to(dtype)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", FuselensWarning)
        check(_as_number(s), x, s, graphs=1, breaks=[])
    # (Python's complex numbers are no constant the backend has: that graph runs eagerly)
    assert isinstance(s, np.complexfloating) or not [w for w in seen if w.category is FuselensWarning]


@pytest.mark.parametrize("s", [np.bool_(False), np.int32(3), np.int64(-2), np.float16(0.1), np.float32(0.1),
                               np.float64(0.1)], ids=lambda s: type(s).__name__)
def test_a_tensor_made_from_a_numpy_scalar_has_its_dtype(s):
    def f(x):
        return torch.tensor(s), torch.as_tensor(s) + x, torch.full((2,), s), torch.tensor([s, s])
    check(f, torch.ones(2), graphs=1, breaks=[])


def test_a_numpy_bool_for_a_bool_parameter_raises_as_in_eager():
    def f(x):
        return x.sum(0, keepdim=np.True_)
    with pytest.raises(TypeError) as eager:  # its words differ between torch versions
        f(torch.randn(3, 4))
    with pytest.raises(TypeError, match=re.escape(str(eager.value))):
        fuselens.compile(f)(torch.randn(3, 4))


# ------------------------------------------------------------------ guarded by value, wherever found
SCALE = np.float32(0.5)
ENABLED = np.True_


class Config:
    eps = np.float64(1e-5)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = np.float16(2.0)

    def forward(self, x):
        d = x.shape[-1]
        y = x / np.sqrt(d) * self.scale + Config.eps + np.prod(x.shape) * SCALE
        return y if ENABLED else -y


def _set(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old)


CHANGES = {
    "global float32": lambda m: _set(__import__(__name__), "SCALE", np.float32(0.25)),
    "global bool_": lambda m: _set(__import__(__name__), "ENABLED", np.False_),
    "class attribute": lambda m: _set(Config, "eps", np.float64(0.5)),
    "module attribute": lambda m: _set(m, "scale", np.float16(3.0)),
    "module attribute, same value, other type": lambda m: _set(m, "scale", 2.0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_numpy_scalar_changed_between_calls_recompiles(change):
    m = Norm()
    cm = fuselens.compile(m)
    x = torch.randn(3, 8)
    check(m, x, graphs=1, breaks=[])  # (np.sqrt and np.prod of sizes are computed, not a break)
    torch.testing.assert_close(cm(x), m(x), rtol=0, atol=0)
    restore = CHANGES[change](m)
    try:
        got, want = cm(x), m(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(fuselens.inspect(cm)) == 2
    finally:
        restore()


def test_a_closure_and_an_argument_that_change_recompile():
    def outer(s):
        def f(x, a):
            return x * s + a
        return f
    for s, a in [(np.float32(0.5), np.int64(2)), (np.float32(1.5), np.int64(2)), (np.float32(1.5), np.int8(3))]:
        f = outer(s)
        cf = fuselens.compile(f)
        torch.testing.assert_close(cf(torch.ones(2), a), f(torch.ones(2), a), rtol=0, atol=0)
        torch.testing.assert_close(cf(torch.ones(2), np.int64(-1)), f(torch.ones(2), np.int64(-1)), rtol=0, atol=0)


def test_a_nan_scalar_keeps_its_entry():
    cf = fuselens.compile(lambda x, s: x + s)
    for _ in range(3):
        assert cf(torch.ones(2), np.float32(math.nan)).isnan().all()
    assert len(fuselens.inspect(cf)) == 1
    assert cf(torch.ones(2), np.float32(1.0)).tolist() == [2.0, 2.0]


def test_numpy_scalars_live_across_a_graph_break():
    """The resume function gets NumPy scalars (and values made from them) from the transformed
    function; neither names NumPy."""
    def f(x):
        s = np.float32(0.1) * 3
        y = x * s
        print("break")
        return y * s + s.item() + np.float64(0.2) * np.int16(2)
    check(f, torch.randn(4), graphs=2)


def test_a_size_compared_with_a_numpy_integer_under_dynamic_dims():
    def f(x):
        return x * 2 if x.shape[0] == np.int64(5) else x - np.int64(x.shape[0])
    cf = fuselens.compile(f)
    for n in (3, 4, 5, 6):
        x = torch.randn(n)
        torch.testing.assert_close(cf(x), f(x), rtol=0, atol=0)


def test_the_editor_reports_no_break_where_capture_computes_numpy(tmp_path):
    from fuselens.capture.analyze import analyze_source
    path = tmp_path / "fl_numpy_numbers.py"
    path.write_text("import numpy as np\n\n\ndef f(x):\n"
                    "    return x / np.sqrt(x.shape[-1]) * np.float32(0.5) + np.prod(x.shape)\n")
    [fn] = analyze_source(path.read_text(), str(path)).functions
    assert fn.breaks == []
    x = torch.randn(2, 3)
    assert not fuselens.explain(_numpy_of_sizes, x).graph_breaks


def _numpy_of_sizes(x):
    return x / np.sqrt(x.shape[-1]) * np.float32(0.5) + np.prod(x.shape)
