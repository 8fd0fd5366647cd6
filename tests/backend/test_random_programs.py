"""Random compositions of ops (pointwise, dtype casts, broadcasts, reductions, views, cat, pad)
against eager, with gradients; a quarter of the programs get a NaN input. FL_SEEDS=300 runs more
programs than CI's 24; FL_SEED_BASE=3000 starts them elsewhere (seeds BASE..BASE+N-1)."""
import os
import random

import pytest
import torch

from fl_backend_testing import DEVICE, check

UNARY = [torch.sin, torch.tanh, torch.sigmoid, torch.exp, lambda v: v * 0.5 + 1, torch.relu, torch.neg,
         lambda v: torch.sqrt(v * v + 1), lambda v: torch.where(v > 0, v, v * 0.1),
         # dtype casts: a bf16 round trip is the rounded value, int<->float truncates, bool
         lambda v: v.bfloat16().float(), lambda v: (v * 3).long().to(v.dtype) + v,
         lambda v: (v > 0).to(v.dtype) * v, lambda v: (v.bfloat16() * 3).to(v.dtype),
         lambda v: v.clamp(-1, 1), lambda v: v.argmax(-1, keepdim=True).to(v.dtype) + v]
BINARY = [torch.add, torch.sub, torch.mul, lambda a, b: a / (b * b + 1), torch.maximum, torch.minimum]


VIEWS = [lambda v: v.t(), lambda v: v[:, ::2], lambda v: v[1:], lambda v: v.reshape(-1, 2),
         lambda v: torch.nn.functional.pad(v, (1, 0, 0, 2)), lambda v: torch.softmax(v, -1), lambda v: v[-2:, 1::3]]
REDUCTIONS = [torch.sum, torch.mean, torch.amax, torch.var, torch.amin]


def apply(kind, k, x, y):
    if kind == "unary":
        return UNARY[k % len(UNARY)](x)
    if kind == "binary":
        return BINARY[k % len(BINARY)](x, y)
    if kind == "reduce":
        return REDUCTIONS[k % len(REDUCTIONS)](x, k % x.dim(), keepdim=True)
    if kind == "cat":
        return torch.cat([x, y], k % 2)
    return VIEWS[k % len(VIEWS)](x)


def random_program(rng: random.Random, x, y):
    """A function of (x, y): a random DAG of 4-10 ops that are valid for these shapes (checked by
    running them), returning the last value and one from the middle."""
    steps, values = [], [x, y]
    while len(steps) < rng.randint(4, 10):
        step = (rng.choice(["unary", "binary", "binary", "reduce", "view", "cat"]), rng.randrange(1000),
                rng.randrange(len(values)), rng.randrange(len(values)))
        try:
            out = apply(step[0], step[1], values[step[2]], values[step[3]])
        except RuntimeError:  # shapes that do not broadcast / view
            continue
        if out.dim() == 2 and 0 < out.numel() < 200:
            steps.append(step)
            values.append(out)

    def program(x, y):
        values = [x, y]
        for kind, k, a, b in steps:
            values.append(apply(kind, k, values[a], values[b]))
        return values[-1] + 0, values[len(values) // 2] * 1
    return program


_BASE = int(os.environ.get("FL_SEED_BASE", 0))


@pytest.mark.parametrize("seed", range(_BASE, _BASE + int(os.environ.get("FL_SEEDS", 24))))
def test_random_program(seed):
    torch.manual_seed(seed)
    layout = seed % 3  # contiguous fp32, transposed fp32, contiguous fp64
    if layout == 1:
        x, y = torch.randn(6, 4, device=DEVICE).t(), torch.randn(6, 4, device=DEVICE).t()
    else:
        dtype = torch.float64 if layout == 2 else torch.float32
        x, y = torch.randn(4, 6, device=DEVICE, dtype=dtype), torch.randn(4, 6, device=DEVICE, dtype=dtype)
    if seed % 4 == 3:  # a NaN input: max/min/clamp propagate it, and their gradients are eager's
        x = x.clone()
        x[seed % x.shape[0], seed % x.shape[1]] = float("nan")
    check(random_program(random.Random(seed), x, y), x, y, atol=1e-4, rtol=1e-4)
