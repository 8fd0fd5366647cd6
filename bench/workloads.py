"""The benchmark workloads: each a function, its inputs, and the bytes it must move."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Workload:
    name: str
    fn: object                # the function compiled by each compiler
    make_inputs: object       # () -> tuple of tensors (fresh random data)
    min_bytes: int | None     # bytes a perfect kernel must move (None: compute-bound)
    backward: bool = False    # time forward + backward


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def softmax_manual(x):
    m = x.amax(dim=-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=-1, keepdim=True)


def sin_cos(x, y):
    return torch.sin(x) + torch.cos(y)


def relu_affine(x):
    return torch.relu((x + 1) * 2)


def layer_norm_manual(x, w, b):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def small_pointwise(x, y):
    return torch.relu(x * y + 1.0) * 0.5


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def attention(q, k, v):
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v


def _r(*shape, dtype=torch.float32, grad=False):
    return lambda: torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


def workloads() -> list[Workload]:
    N24 = 1 << 24
    f32, bf16 = 4, 2
    ln_in = lambda grad: (lambda: (torch.randn(8192, 4096, device="cuda", requires_grad=grad),
                                   torch.randn(4096, device="cuda", requires_grad=grad),
                                   torch.randn(4096, device="cuda", requires_grad=grad)))
    def mlp_in(grad):
        def make():
            ts = (torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16),
                  torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 0.03,
                  torch.randn(4096, device="cuda", dtype=torch.bfloat16) * 0.1,
                  torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 0.015,
                  torch.randn(1024, device="cuda", dtype=torch.bfloat16) * 0.1)
            return tuple(t.requires_grad_(grad) for t in ts)  # leaves (a scaled tensor would not be one)
        return make
    return [
        Workload("gelu_tanh 2^24 f32", gelu_tanh, lambda: (_r(N24)(),), 2 * f32 * N24),
        Workload("softmax 4096x4096 f32", softmax_manual, lambda: (_r(4096, 4096)(),), 2 * f32 * 4096 * 4096),
        Workload("sin+cos 10000^2 f32", sin_cos, lambda: (_r(10000, 10000)(), _r(10000, 10000)()),
                 3 * f32 * 10 ** 8),
        Workload("relu((x+1)*2) 10000^2", relu_affine, lambda: (_r(10000, 10000)(),), 2 * f32 * 10 ** 8),
        Workload("layernorm 8192x4096 f32", layer_norm_manual, ln_in(False), 2 * f32 * 8192 * 4096),
        Workload("rmsnorm 8192x4096 bf16", rms_norm,
                 lambda: (_r(8192, 4096, dtype=torch.bfloat16)(), _r(4096, dtype=torch.bfloat16)()),
                 2 * bf16 * 8192 * 4096),
        Workload("small pointwise 64x64", small_pointwise, lambda: (_r(64, 64)(), _r(64, 64)()), None),
        Workload("layernorm fwd+bwd 8192x4096", layer_norm_manual, ln_in(True),
                 5 * f32 * 8192 * 4096, backward=True),
        Workload("mlp fwd 8192x1024x4096 bf16", mlp, mlp_in(False), None),
        Workload("mlp fwd+bwd bf16", mlp, mlp_in(True), None, backward=True),
        Workload("attention 32x16x512x64 bf16", attention,
                 lambda: tuple(_r(32, 16, 512, 64, dtype=torch.bfloat16)() for _ in range(3)), None),
    ]
