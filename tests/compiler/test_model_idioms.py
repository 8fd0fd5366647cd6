"""Idioms of real model code (torchvision, timm, HF transformers) captured whole: each test is
the reduction of a construct one of those libraries uses."""
from __future__ import annotations

import torch

from fl_capture_testing import check


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.relative_position_bias_table = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("relative_position_index", torch.arange(4))

    def forward(self, x):
        return x + self.relative_position_bias_table[self.relative_position_index]


class _Swin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Module()])])
        self.features[0][0].attn = _Attn()

    def forward(self, x):
        return self.features[0][0].attn(x)


def test_inputs_whose_sources_share_a_long_prefix():
    """torchvision swin_t: `...attn.relative_position_bias_table` and `...attn.relative_position_index`
    agree in their first 40 characters; the graph's parameters stay distinct."""
    with torch.no_grad():
        check(_Swin(), torch.randn(4), graphs=1, breaks=[])
