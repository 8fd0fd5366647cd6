"""Manual GeLU, tanh form: a chain of pointwise ops that fuses into one kernel."""
import math

import torch

import fuselens


@fuselens.compile
def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


EXAMPLE_INPUTS = {"gelu": lambda: (torch.randn(1024),)}

if __name__ == "__main__":
    x = torch.randn(1024)
    print(gelu(x)[:4])
