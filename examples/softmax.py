"""Manual softmax over the last dim: two reductions and pointwise ops, one kernel."""
import torch

import fuselens


@fuselens.compile
def softmax(x):
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


EXAMPLE_INPUTS = {"softmax": lambda: (torch.randn(64, 128),)}

if __name__ == "__main__":
    print(softmax(torch.randn(4, 8)).sum(-1))
