"""A graph with dynamic dims raises eager's shape errors at the sizes where eager raises them, with
no fallback warning (the error is the user's), ops whose results are unused included, and its
inputs are left as eager leaves them: written up to the error."""
import warnings

import pytest
import torch

import fuselens
from fl_backend_testing import DEVICE


def _unused_sum(x, y):
    z = x + y  # unused: its shapes must still match, as eager checks them
    return x * 2


def test_an_unused_op_checks_its_shapes_at_each_size_of_a_dynamic_dim():
    """Checked on meta tensors at each new size; the kernels leave the op out."""
    cf = fuselens.compile(_unused_sum)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        for n in (4, 6):  # the rows go dynamic
            cf(torch.randn(n, 3, device=DEVICE), torch.randn(n, 3, device=DEVICE))
        with pytest.raises(RuntimeError, match="must match the size"):
            cf(torch.randn(7, 3, device=DEVICE), torch.randn(5, 3, device=DEVICE))
        x = torch.randn(8, 3, device=DEVICE)
        torch.testing.assert_close(cf(x, torch.randn(8, 3, device=DEVICE)), x * 2)
    graph = fuselens.inspect(cf)[-1].graphs[0]
    assert "add" in graph.ir and len(graph.kernels) == 1


def _written_then_mismatched(x, y):
    x.add_(1)
    y[:, 0] = 7
    return x + y


def test_inputs_written_before_a_shape_error_are_written():
    cf = fuselens.compile(_written_then_mismatched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        for n in (4, 6):
            cf(torch.randn(n, 3, device=DEVICE), torch.randn(n, 3, device=DEVICE))
        x, y = torch.randn(7, 3, device=DEVICE), torch.randn(5, 3, device=DEVICE)
        xe, ye = x.clone(), y.clone()
        with pytest.raises(RuntimeError, match="must match the size"):
            _written_then_mismatched(xe, ye)
        with pytest.raises(RuntimeError, match="must match the size"):
            cf(x, y)
    torch.testing.assert_close(x, xe)
    torch.testing.assert_close(y, ye)
