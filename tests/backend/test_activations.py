"""Activations (ops/decompositions/activations.py): every elementwise activation of
torch.nn.functional that OpInfo describes is lowered to kernels (none left to ATen: MobileNetV3's
hardswish and hardsigmoid had run as ATen calls on copies, and their backward through torch's
autograd), equal to eager, and its gradient is ATen's at the points where its formula switches."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fuselens
from fl_backend_testing import tolerance

RANDOM = {"nn.functional.rrelu"}  # (its training form draws; its eval form is leaky_relu)


def _activations():
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo.core import UnaryUfuncInfo
    # the elementwise ones (UnaryUfuncInfo), and those OpInfo files elsewhere
    extra = {"nn.functional.gelu", "nn.functional.glu", "nn.functional.hardswish", "nn.functional.leaky_relu",
             "nn.functional.softmin"}
    return {o.name: o for o in op_db if o.name.startswith("nn.functional.") and o.name not in RANDOM
            and (isinstance(o, UnaryUfuncInfo) or o.name in extra)}


def _call(fn, x, args, kwargs):
    return fn(x, *args, **kwargs)


def _externs(compiled):
    return [line.strip() for e in fuselens.inspect(compiled) for g in e.graphs
            for line in (g.wrapper or "").split("\n")
            if "consts[" in line or "= torch." in line or "call_torch" in line]


def test_every_activation_is_lowered_and_equal_to_eager():
    ops = _activations()
    assert len(ops) >= 20, sorted(ops)
    failures = []
    for name, op in sorted(ops.items()):
        sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=True)))
        x, args, kwargs = sample.input, tuple(sample.args), dict(sample.kwargs)
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            continue
        xe, xc = (x.detach().clone().requires_grad_() for _ in range(2))
        want = _call(op.op, xe, args, kwargs)
        compiled = fuselens.compile(_call)
        got = compiled(op.op, xc, args, kwargs)
        externs = _externs(compiled)
        if externs:
            failures.append(f"{name}: left to ATen: {externs[0]}")
            continue
        torch.testing.assert_close(got, want, **tolerance(x.dtype), equal_nan=True, msg=lambda m: f"{name}: {m}")
        g = torch.randn_like(want)
        want.backward(g)
        got.backward(g)
        torch.testing.assert_close(xc.grad, xe.grad, **tolerance(x.dtype), equal_nan=True, msg=lambda m: f"{name}: {m}")
    assert not failures, "\n".join(failures)


def _hardswish_(x):
    return F.hardswish(x * 1, inplace=True)


def _elu_(x):
    return F.elu(x * 1, 0.7, inplace=True)


# (masks: their gradients at the switch points are exact; the others' are formulas, close there)
MASKS = (F.hardswish, F.hardsigmoid, F.relu6, F.hardtanh, _hardswish_)


@pytest.mark.parametrize("fn", MASKS + (F.logsigmoid, F.selu, F.mish, _elu_), ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_where_the_formula_switches_are_atens(fn, dtype):
    """At the points where an activation's formula switches (hardswish's and hardsigmoid's +-3,
    relu6's 0 and 6, log sigmoid's 0) and at infinities, the gradient is ATen's backward kernel's
    exactly (the gradient derived from a clamp is 1 at its bounds, ATen's 0; a where's unchosen
    branch gave NaN at -inf)."""
    x0 = torch.tensor([-3.0, 3.0, 0.0, -0.0, 6.0, -6.0, 1.0, -1.0, 2.5, -2.5, math.inf, -math.inf, 40.0, -40.0],
                      dtype=dtype)

    def f(x):
        return fn(x)
    xe, xc = (x0.clone().requires_grad_() for _ in range(2))
    compiled = fuselens.compile(f)
    want, got = f(xe), compiled(xc)
    assert not _externs(compiled)
    torch.testing.assert_close(got, want, **tolerance(dtype), equal_nan=True)
    g = torch.linspace(0.5, 1.5, len(x0), dtype=dtype)
    want.backward(g)
    got.backward(g)
    if fn in MASKS:
        at = torch.tensor([v in (-3.0, 3.0, 0.0, 6.0, -6.0) or math.isinf(v) for v in x0.tolist()])
        assert torch.equal(xc.grad[at], xe.grad[at]), (xc.grad, xe.grad)
    torch.testing.assert_close(xc.grad, xe.grad, **tolerance(dtype), equal_nan=True)


def test_prelu_of_every_weight_shape_keeps_the_inputs_shape():
    """Every OpInfo sample of prelu (one slope or one per channel, 0-d to 3-d inputs): a [1]
    weight of a 0-d input broadcast the result to [1]."""
    from torch.testing._internal.common_methods_invocations import op_db
    (op,) = [o for o in op_db if o.name == "nn.functional.prelu"]
    for sample in op.sample_inputs("cpu", torch.float32):
        if sample.input.numel() == 0:
            continue
        args, kwargs = tuple(sample.args), dict(sample.kwargs)
        want = _call(F.prelu, sample.input, args, kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", fuselens.FuselensWarning)  # (no fall-back to eager)
            got = fuselens.compile(_call)(F.prelu, sample.input, args, kwargs)
        assert got.shape == want.shape, (sample.input.shape, args, kwargs)
        torch.testing.assert_close(got, want)
