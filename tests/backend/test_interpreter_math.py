"""Each pointwise primitive, alone in a kernel, computes what eager computes, in float32, bfloat16
and float16. On CPU (FUSELENS_INTERPRET=1) the interpreter computes each primitive with the
primitive's own torch function, as eager does: bit for bit (numpy's tanh, exp or sigmoid
differed from torch's in the last bit: issue 15). The C++ kernels (FUSELENS_CPU_BACKEND=cpp) call
SLEEF's float routines (within 1 ulp), as ATen's vectorised kernels do, and are held to the GPU's
rule with a bound of at least 1 ulp; a float32 exp, log, sin, cos, tanh or erf alone is eager's own
MKL routine there (codegen/cpp_vml.py): bit for bit. On a GPU, Triton's math against CUDA's: the
numerics contract of docs/backend.md, an error against a float64 reference no larger than eager's
kernel's, and bit equality wherever eager's result is correctly rounded (division, square root,
and every result in a half type, which eager computes in float32 and rounds once).
"""
import re

import pytest
import torch

from fl_backend_testing import CPP, DEVICE, run, ulp_error
from fuselens.codegen import cpp_vml
from fuselens.ops.primitives import PRIMITIVES

FLOATS = [torch.float32, torch.bfloat16, torch.float16]



def arity(prim):
    """The number of operands of a primitive's kernel line."""
    return len(set(re.findall(r"\{(\d)\}", prim.triton_for(torch.float32) or "")))


# every pointwise primitive computing a value from one or two tensors of one float dtype (where's
# first operand is a condition; convert, slice_backward and cat are lowered by codegen itself;
# copy and stop_gradient compute nothing)
MATH = sorted(n for n, p in PRIMITIVES.items()
              if p.kind == "pointwise" and arity(p) in (1, 2) and p.triton_for(torch.float32) != "{0}")


def operands(impl, n, dtype):
    """Signed values, or positive ones where eager gives NaN for signed ones (log, sqrt, pow).
    2048 elements: a whole number of eager's vector loops (its scalar remainder loop may differ
    from its vector loop in the last bit, so eager itself is not bit-stable for odd tails)."""
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(32, 64, generator=g) * 3).to(dtype) for _ in range(n)]
    if impl(*xs).isnan().any():
        xs = [x.abs() + 0.125 for x in xs]
    return [x.to(DEVICE) for x in xs]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", MATH)
def test_primitive_alone_equals_eager(name, dtype):
    prim = PRIMITIVES[name]
    impl = prim.impl
    xs = operands(impl, arity(prim), dtype)
    f = (lambda x: impl(x)) if len(xs) == 1 else (lambda x, y: impl(x, y))
    cg, (got,) = run(f, *xs)
    expected = f(*xs)
    assert len(cg.kernels) <= 1
    assert got.dtype == expected.dtype
    differ = (got.view(-1)[(got != expected).view(-1)][:4], expected.view(-1)[(got != expected).view(-1)][:4])
    if DEVICE == "cpu" and (not CPP or dtype == torch.float32 and name in cpp_vml.ROUTINES and cpp_vml.available()):
        assert torch.equal(got, expected), differ
        return
    reference = f(*[x.double() for x in xs])
    error, eager_error = ulp_error(got, reference, dtype), ulp_error(expected, reference, dtype)
    # (C++: SLEEF's float routines err by up to 1 ulp, as ATen's vectorised kernels that call them;
    # CUDA: Triton's libdevice is not the CUDA math library eager's kernels were built with, and
    # their float routines differ within CUDA's documented bounds: atan2f by 1.58 ulp where eager's 1.48)
    bound = max(eager_error, 1.0) if CPP else max(eager_error, 2.0) if DEVICE == "cuda" else eager_error
    assert error <= bound, (f"{error:.3f} ulp where eager's kernel errs by {eager_error:.3f}", differ)
    if eager_error <= 0.5:  # eager is correctly rounded: so is fuselens, to the same value
        assert torch.equal(got, expected), differ


@pytest.mark.skipif(DEVICE != "cpu" or CPP, reason="Triton's interpreter")
def test_the_interpreter_refuses_an_access_outside_the_arguments():
    """Every load and store of an interpreted kernel is checked against its tensor arguments'
    memory (codegen/launcher.py patch_interpreter_bounds): a lane past the end raises, where on a
    GPU it reads another tensor or faults at a later call; the same kernel within bounds runs."""
    import triton
    import triton.language as tl
    from fuselens.codegen import launcher
    launcher.patch_interpreter_bounds()

    @triton.jit
    def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i), i < n)  # (the load unmasked)
    x, y = torch.randn(10), torch.empty(10)
    from triton.runtime.errors import InterpreterError
    with pytest.raises(InterpreterError, match="copy: a load of 6 elements outside"):
        copy[(1,)](x, y, 10, BLOCK=16)
    copy[(1,)](x[:8], y, 8, BLOCK=8)
    assert torch.equal(y[:8], x[:8])
