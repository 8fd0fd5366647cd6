"""Eager vs fuselens vs torch.compile on the fusion examples, on a GPU (not a test: run it directly).

    PYTHONPATH=compiler python3 tests/backend/gpu_bench.py
Prints one row per function: median times (triton.testing.do_bench) and the fraction of the
H100's memory bandwidth fuselens reaches, counting each input read once and each output written once.
do_bench times the GPU (events around each call, behind a cache flush), so Python call overhead
does not show in these numbers.
"""
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["FUSELENS_INTERPRET"] = "0"  # real Triton compilation (the tests default to the interpreter)

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fl_backend_testing import compile  # noqa: E402
from test_fusion import manual_gelu_tanh, manual_layer_norm, manual_softmax, sin_plus_cos  # noqa: E402

PEAK_BYTES_PER_S = 3.35e12  # H100 SXM HBM3


def bench(fn, args):
    return do_bench(lambda: fn(*args), warmup=25, rep=100, return_mode="median") * 1e-3


def main():
    dev = "cuda"
    cases = [
        ("manual_softmax", manual_softmax, [torch.randn(8192, 2048, device=dev)]),
        ("manual_layer_norm", manual_layer_norm,
         [torch.randn(8192, 2048, device=dev), torch.randn(2048, device=dev), torch.randn(2048, device=dev)]),
        ("manual_gelu_tanh", manual_gelu_tanh, [torch.randn(16 * 1024 * 1024, device=dev)]),
        ("sin_plus_cos", sin_plus_cos, [torch.randn(4096, 4096, device=dev), torch.randn(4096, 4096, device=dev)]),
        ("softmax_fp16_long_rows", manual_softmax, [torch.randn(1024, 16384, device=dev, dtype=torch.float16)]),
        ("tiny_gelu_1k", manual_gelu_tanh, [torch.randn(1024, device=dev)]),
    ]
    print(f"{'function':26} {'kernels':>7} {'eager ms':>9} {'fuselens ms':>12} {'torch.compile ms':>17} "
          f"{'fl % peak BW':>13}")
    for name, fn, args in cases:
        cg = compile(fn, *args)
        got = cg(*args)[0]
        expected = fn(*args)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        t_eager, t_fl = bench(fn, args), bench(cg, args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rival = torch.compile(fn)
                rival(*args)
                t_tc = f"{bench(rival, args) * 1e3:17.3f}"
            except Exception as e:  # torch.compile is only a comparison
                t_tc = f"{'failed: ' + type(e).__name__:>17}"
        nbytes = sum(a.numel() * a.element_size() for a in args) + got.numel() * got.element_size()
        print(f"{name:26} {len(cg.kernels):7d} {t_eager * 1e3:9.3f} {t_fl * 1e3:12.3f} {t_tc} "
              f"{100 * nbytes / t_fl / PEAK_BYTES_PER_S:12.1f}%")


def training():
    """Forward + backward (the gradient of a weighted sum of the output)."""
    dev = "cuda"
    cases = [
        ("manual_layer_norm", manual_layer_norm,
         [torch.randn(8192, 2048, device=dev), torch.randn(2048, device=dev), torch.randn(2048, device=dev)]),
        ("manual_gelu_tanh", manual_gelu_tanh, [torch.randn(16 * 1024 * 1024, device=dev)]),
        ("manual_softmax", manual_softmax, [torch.randn(8192, 2048, device=dev)]),
    ]
    print(f"\n{'fwd+bwd':24} {'kernels':>7} {'eager ms':>9} {'fuselens ms':>12} {'torch.compile ms':>17}")
    for name, fn, args in cases:
        args = [a.requires_grad_() for a in args]
        cg = compile(fn, *args)
        grad_out = torch.randn_like(fn(*args))

        def step(f):
            return lambda *xs: torch.autograd.grad(f(*xs)[0] if f is cg else f(*xs), xs, grad_out)
        got, expected = step(cg)(*args), step(fn)(*args)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-3, rtol=1e-3)
        t_eager, t_fl = bench(step(fn), args), bench(step(cg), args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                rival = torch.compile(fn)
                step(rival)(*args)  # compile outside the timing
                t_tc = f"{bench(step(rival), args) * 1e3:17.3f}"
            except Exception as e:
                t_tc = f"{'failed: ' + type(e).__name__:>17}"
        print(f"{name:24} {len(cg.kernels):7d} {t_eager * 1e3:9.3f} {t_fl * 1e3:12.3f} {t_tc}")


def end_to_end():
    """fuselens.compile (capture + backend) on a small module: one training step, gradients vs eager."""
    import copy

    import torch.nn as nn
    import torch.nn.functional as F

    import fuselens

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc1 = nn.Embedding(100, 64), nn.Linear(64, 256)
            self.ln, self.fc2 = nn.LayerNorm(256), nn.Linear(256, 100)

        def forward(self, idx, target):
            h = self.ln(F.gelu(self.fc1(self.emb(idx))))
            return F.cross_entropy(self.fc2(h).view(-1, 100), target.view(-1))

    model = Block().cuda()
    compiled = fuselens.compile(copy.deepcopy(model))
    idx, target = torch.randint(0, 100, (8, 32), device="cuda"), torch.randint(0, 100, (8, 32), device="cuda")
    model(idx, target).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an eager fallback fails this check
        compiled(idx, target).backward()
    worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), compiled.parameters()))
    print(f"\nend to end (fuselens.compile, module, one training step): max gradient difference {worst:.2e}")
    assert worst < 1e-3


if __name__ == "__main__":
    main()
    training()
    end_to_end()
