"""Kernels through fuselens's own compile and launch path (codegen/cuda.py) against eager on a
GPU: pointwise, persistent and looped reductions, random numbers, bf16, sizes >= 2^31, a kernel
with more than 48 KB of shared memory, training (backward kernels run on autograd's thread).
Prints one row per case: max error, tolerance, kernels' largest shared memory.

    PYTHONPATH=compiler python bench/launch_check.py"""
import math
import sys
import warnings

import torch
import torch.nn.functional as F

import fuselens
from fuselens.codegen import launcher


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def column_sum(x):
    return x.sum(0)


def strided_views(x):
    return gelu(x[1:, ::2].t()) + 1


def affine(x):
    return x * 2 + 1


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


def check_forward(fn, *inputs, tol):
    cf = fuselens.compile(fn)
    cf(*inputs)
    out = cf(*inputs)  # a second call: through the launch functions built by the first
    return err(out, fn(*inputs)), tol


def check_training(fn, *inputs, tol):
    leaves = [t.detach().requires_grad_() for t in inputs]
    cf = fuselens.compile(fn)
    for _ in range(2):
        for t in leaves:
            t.grad = None
        out = cf(*leaves)
        out.backward(torch.ones_like(out))
    grads = [t.grad for t in leaves]
    ref_leaves = [t.detach().requires_grad_() for t in inputs]
    ref = fn(*ref_leaves)
    ref.backward(torch.ones_like(ref))
    return max([err(out, ref)] + [err(g, t.grad) for g, t in zip(grads, ref_leaves)]), tol


def dropout(x):
    return F.dropout(x, 0.3, training=True) * 2


def check_dropout():
    """Random numbers: zeros where dropped, x / (1 - p) elsewhere, the rate near p, the same
    seed gives the same mask and another seed another."""
    x = torch.randn(1 << 20, device="cuda") + 5  # never 0
    fn = fuselens.compile(dropout)
    torch.manual_seed(1)
    a = fn(x)
    torch.manual_seed(1)
    b = fn(x)
    c = fn(x)
    kept = a != 0
    bad = err(torch.where(kept, a, x * 2 / 0.7), x * 2 / 0.7)
    rate = 1 - kept.float().mean().item()
    assert torch.equal(a, b) and not torch.equal(a, c), "seeding"
    return max(bad, abs(rate - 0.3)), 1e-2


TRANSPOSE = '''import triton
import triton.language as tl


@triton.jit
def fl_transpose_blocks(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    # 128x128 fp32 blocks transposed: the layout conversion goes through 64 KB of shared memory
    r = tl.arange(0, 128)[:, None] * 128 + tl.arange(0, 128)[None, :]
    base = tl.program_id(0) * 16384
    mask = base + r < xnumel
    x = tl.load(in_ptr0 + base + r, mask)
    tl.store(out_ptr0 + base + r, tl.trans(x), tl.trans(mask))
'''


def check_large_shared():
    x = torch.randn(4, 128, 128, device="cuda")
    out = torch.empty_like(x)
    k = launcher.TritonKernel("fl_transpose_blocks", TRANSPOSE, "pointwise")
    k.run(x, out, xnumel=x.numel())  # 64 programs of which 4 hold a block
    return err(out, x.transpose(1, 2)), 0.0


def max_shared():
    return max((b.shared for loaded in launcher._binaries.values() for b in loaded.values()), default=0)


def main():
    warnings.simplefilter("error", fuselens.FuselensWarning)  # an eager fallback would pass every check
    dev = "cuda"
    r = lambda *s, dtype=torch.float32: torch.randn(*s, device=dev, dtype=dtype)
    big = 2 ** 31 + 4096
    cases = [
        ("pointwise gelu 2^24 f32", lambda: check_forward(gelu, r(1 << 24), tol=1e-5)),
        ("pointwise gelu bf16 odd size", lambda: check_forward(gelu, r(1000, 999, dtype=torch.bfloat16), tol=2e-2)),
        ("persistent softmax 4096x4096", lambda: check_forward(softmax, r(4096, 4096), tol=1e-6)),
        ("persistent softmax 5x33 (masks)", lambda: check_forward(softmax, r(5, 33), tol=1e-6)),
        ("looped softmax 256x16384 fp16", lambda: check_forward(softmax, r(256, 16384, dtype=torch.float16),
                                                                tol=1e-3)),
        ("column sum 8192x1024 (autotuned)", lambda: check_forward(column_sum, r(8192, 1024), tol=1e-2)),
        ("non-contiguous / offset views", lambda: check_forward(strided_views, r(513, 130), tol=1e-5)),
        ("dropout (seed per call)", check_dropout),
        (f"pointwise {big} bf16 (i64 sizes)", lambda: check_forward(affine, torch.ones(big, device=dev, dtype=torch.bfloat16),
                                                                     tol=0.0)),
        ("shared memory > 48 KB (transpose)", check_large_shared),
        ("layernorm fwd+bwd 2048x1024", lambda: check_training(layer_norm, r(2048, 1024), r(1024), r(1024),
                                                               tol=5e-3)),
        ("mlp fwd+bwd bf16", lambda: check_training(mlp, r(512, 256, dtype=torch.bfloat16),
                                                    r(1024, 256, dtype=torch.bfloat16) * 0.05,
                                                    r(1024, dtype=torch.bfloat16) * 0.1,
                                                    r(256, 1024, dtype=torch.bfloat16) * 0.03,
                                                    r(256, dtype=torch.bfloat16) * 0.1, tol=0.25)),
    ]
    failed = 0
    for name, case in cases:
        try:
            e, tol = case()
            ok = e <= tol
            print(f"{name:38} maxerr {e:9.2e} tol {tol:7.1e} {'ok' if ok else 'FAIL'}", flush=True)
        except Exception as ex:  # keep going: the table is the point
            ok = False
            print(f"{name:38} {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        failed += not ok
        torch.cuda.empty_cache()
    print(f"largest shared memory of a kernel: {max_shared()} bytes; {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
