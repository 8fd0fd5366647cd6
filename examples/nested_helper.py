"""A function calling a nested helper: the helper is inlined into the caller's graph."""
import torch

import fuselens


def scale_shift(x, scale, shift=1.0):
    return x * scale + shift


@fuselens.compile
def normalize_then_scale(x):
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    return scale_shift(centered, 2.0)


EXAMPLE_INPUTS = {"normalize_then_scale": lambda: (torch.randn(16, 32),)}

if __name__ == "__main__":
    print(normalize_then_scale(torch.randn(2, 4)))
