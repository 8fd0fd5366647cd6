"""Functions for checking Compile & benchmark's GPU path (timings, per-kernel profile)."""
import torch


# fuselens: example(x=float32[8192, 4096])
@torch.compile
def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


# fuselens: example(x=float32[8192, 1024])
@torch.compile
def softmax(x):
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


# fuselens: example(x=float32[4096, 4096])
@torch.compile
def sincos(x):
    return torch.sin(x) + torch.cos(x)
