"""Outputs written over inputs (the wrapper's `in place` buffers): a kernel that reads each element of
a dying buffer only where it writes takes that buffer's memory, as Inductor's in-place kernels do; in
both backends (in CPP_TESTS: the C++ kernels print their indices apart from Triton's)."""
import pytest
import torch

from fl_backend_testing import DEVICE, check, run
from test_fusion import manual_layer_norm


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def test_a_value_stored_for_an_extern_is_read_by_its_later_users():
    # r is stored for the matmul; the product after it reads r there. Recomputing the ReLU instead kept s in
    # memory too (a ResNet block's pre-ReLU sum: 49 MB of ResNet-50's training forward at its peak)
    def f(a, b, w):
        s = a + b
        r = torch.relu(s)
        return (r @ w) * r, s.amax()
    cg = check(f, randn(16, 8), randn(16, 8), randn(8, 8), grad=False)
    assert cg.wrapper_source.count("empty((16, 8)") == 1  # r, not s: the result is written over r @ w
    assert "in place" in cg.wrapper_source


def in_place_lines(cg):
    return [line for line in cg.wrapper_source.splitlines() if "in place" in line]


@pytest.mark.parametrize("fn, inputs, over", [
    # GeLU after a 3-D linear: over the GEMM's result, viewed (B, S, N)
    (lambda x, w, v: torch.nn.functional.gelu(torch.nn.functional.linear(x, w)) @ v, ((4, 8, 16), (24, 16), (24, 8)),
     True),
    # with a bias (a transformer's MLP): the GEMM's (B*S, N) result read as (B, S, N) at an index
    # equal to the output's by value only (512 * 4096 against the symbol of 2097152)
    (lambda x, w, b, v: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)) @ v,
     ((2, 4, 8), (8, 8), (8,), (8, 4)), True),
    # a layer norm (a persistent reduction) of a GEMM's result, written over it
    (lambda x, w: manual_layer_norm(x @ w, 1.5, 0.5) + 1, ((32, 16), (16, 64)), True),
    # read at other elements than written (a transpose): not in place
    (lambda x, w: ((x @ w).t() * 2).contiguous() + 1, ((16, 16), (16, 16)), False),
    # the GEMM's result read again after the kernel: not in place
    (lambda x, w: (lambda y: (torch.sigmoid(y) + 1) @ y)(x @ w), ((16, 16), (16, 16)), False),
    # the kernel stores z * 2 before it reads the GEMM's result for y + z * 2: only the second
    # output goes over it (the first one there made the second read its own values)
    (lambda x, w, z: (lambda y, a: (a, y + a))(x @ w, z * 2), ((8, 4), (4, 6), (8, 6)), True),
])
def test_an_output_is_written_over_an_input_read_only_where_it_is_written(fn, inputs, over):
    # each element read once, at the element written, by a kernel in one pass: its output takes the
    # memory of an input that dies there (a fresh GEMM result), as Inductor's in-place kernels do
    cg = check(fn, *[randn(*s) for s in inputs], grad=False, atol=1e-4, rtol=1e-4)
    assert bool(in_place_lines(cg)) == over, cg.wrapper_source


def test_what_the_caller_gets_is_no_view_of_an_input_it_was_written_over():
    fn = lambda x, w: torch.nn.functional.gelu(torch.nn.functional.linear(x, w))  # noqa: E731
    cg, (out,) = run(fn, randn(4, 8, 16), randn(24, 16))
    assert not out._is_view() and not in_place_lines(cg)  # (4, 8, 24) over (32, 24): a view, so a new buffer
    fn = lambda x, w: torch.nn.functional.gelu(x @ w)  # noqa: E731
    x, w = randn(32, 16), randn(16, 24)
    cg, (out,) = run(fn, x, w)
    assert not out._is_view() and in_place_lines(cg)  # the same layout: the GEMM's result itself
    torch.testing.assert_close(out, fn(x, w), atol=1e-4, rtol=1e-4)


def test_an_in_place_op_whose_schema_names_a_python_keyword():
    """`t.uniform_(lo, hi)` is `uniform(self, from, to)`: its functional form passes `from` by
    position (written as a keyword, the wrapper did not compile: DINOv3's training fell back, and
    at a second size a SyntaxError reached the user)."""
    import warnings

    import fuselens

    def f(x):
        s = torch.empty(1, device=x.device, dtype=x.dtype).uniform_(-0.5, 0.5)
        unused = x.view(-1, 1) + 1  # noqa: F841 (kept for its shape check where dims are dynamic)
        return x * 2 + s * 0, s

    cf = fuselens.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        for n in (4, 6, 7):
            x = randn(n)
            got, s = cf(x)
            torch.testing.assert_close(got, x * 2)
            assert -0.5 <= s.item() < 0.5
