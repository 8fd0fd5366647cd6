"""F.conv2d of an unbatched (C, H, W) input with a bias: the result is unbatched too (the OpInfo
suite's full matrix found the bias broadcast adding a batch dim); F.conv1d, batched or not, as the
2-d convolution over one row."""
import pytest
import torch
import torch.nn.functional as F

import fuselens
from fl_backend_testing import DEVICE, check, exact_fp32_convolutions


def conv(x, w, b):
    return F.conv2d(x, w, b, padding=1)


def test_unbatched_conv2d_with_bias():
    x, w, b = torch.randn(3, 5, 5), torch.randn(4, 3, 3, 3), torch.randn(4)
    got = fuselens.compile(conv)(x, w, b)
    want = conv(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batched", [True, False])
def test_conv1d_is_a_convolution_over_one_row(batched):
    """F.conv1d (speech models' feature encoders) as the 2-d convolution primitive over (1, L):
    values and gradients as eager's, no extern call of torch's conv1d."""
    x = torch.randn(*((2,) if batched else ()), 4, 20, device=DEVICE)
    w, b = torch.randn(6, 2, 5, device=DEVICE), torch.randn(6, device=DEVICE)
    with exact_fp32_convolutions():
        cg = check(lambda x, w, b: F.gelu(F.conv1d(x, w, b, stride=2, padding=3, dilation=2, groups=2)), x, w, b,
                   rtol=1e-4, atol=1e-4)
    assert "call_torch" not in cg.wrapper_source
