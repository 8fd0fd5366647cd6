"""A graph-break showcase: print, `.item()`, a data-dependent `if`, and a break inside an
inlined helper. Each break ends a graph; Python runs the breaking code; capture resumes."""
import torch

import fuselens


def log_and_double(x):
    print("inside helper, sum =", x.sum())
    return x * 2


@fuselens.compile
def showcase(x):
    y = torch.relu(x) + 1
    print("y computed")
    scale = y.mean().item()
    z = y * scale
    if z.sum() > 0:
        z = z - 1
    else:
        z = z + 1
    return log_and_double(z)


EXAMPLE_INPUTS = {"showcase": lambda: (torch.randn(8, 8),)}

if __name__ == "__main__":
    print(showcase(torch.randn(2, 2)))
