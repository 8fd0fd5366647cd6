"""F.conv2d of an unbatched (C, H, W) input with a bias: the result is unbatched too (the OpInfo
suite's full matrix found the bias broadcast adding a batch dim)."""
import torch
import torch.nn.functional as F

import fuselens


def conv(x, w, b):
    return F.conv2d(x, w, b, padding=1)


def test_unbatched_conv2d_with_bias():
    x, w, b = torch.randn(3, 5, 5), torch.randn(4, 3, 3, 3), torch.randn(4)
    got = fuselens.compile(conv)(x, w, b)
    want = conv(x, w, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
