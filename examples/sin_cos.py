"""The smallest fusion: sin(x) + cos(y)."""
import torch

import fuselens


@fuselens.compile
def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


EXAMPLE_INPUTS = {"foo": lambda: (torch.randn(100, 100), torch.randn(100, 100))}

if __name__ == "__main__":
    print(foo(torch.randn(3), torch.randn(3)))
