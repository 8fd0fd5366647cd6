"""Column reductions on a GPU (issue 5): layer norm forward+backward, a plain column sum and a
bias gradient, each as eager and fuselens: median step time (do_bench, as bench/run.py), the
GPU kernels of the fuselens step (torch.profiler, as bench/profile_step.py), and the largest
difference from eager (outputs and gradients).

    PYTHONPATH=compiler python bench/column_reductions.py [--mode max-autotune] [--no-profile]
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from run import copy_bandwidth, do_bench, profile_calls, step  # noqa: E402
from workloads import layer_norm_manual  # noqa: E402

import fuselens  # noqa: E402

M, N = 8192, 4096
F32 = 4


def bias_tanh(x, b):
    return torch.tanh(x + b)  # b's gradient: the column sum of dy * (1 - tanh^2)


def cases():
    r = lambda *s, dtype=torch.float32, grad=False: torch.randn(*s, device="cuda", dtype=dtype).requires_grad_(grad)  # noqa: E731
    # (name, fn, inputs, backward, fewest bytes)
    yield ("layernorm fwd+bwd 8192x4096 f32", layer_norm_manual, (r(M, N, grad=True), r(N, grad=True), r(N, grad=True)),
           True, 5 * F32 * M * N)
    yield "x.sum(0) 8192x4096 f32", lambda x: x.sum(0), (r(M, N),), False, F32 * M * N
    yield "x.sum(0) 8192x4096 bf16", lambda x: x.sum(0), (r(M, N, dtype=torch.bfloat16),), False, 2 * M * N
    yield ("bias grad tanh(x + b) fwd+bwd 8192x4096", bias_tanh, (r(M, N, grad=True), r(N, grad=True)), True,
           5 * F32 * M * N)  # x read twice, y written, dy read, dx written


def outputs_and_grads(fn, inputs, backward, dy_seed=0):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    res = [out.detach()]
    if backward:
        g = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                        generator=torch.Generator(out.device).manual_seed(dy_seed))
        res += list(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g))
    return res


def kernels(s):
    prof = profile_calls(s)
    rows = [(e.key, e.count // 5, e.device_time_total / e.count) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1] * r[2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="default")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()}, mode {args.mode})")
    for name, fn, inputs, backward, nbytes in cases():
        compiled = fuselens.compile(fn, mode=args.mode)
        ref = outputs_and_grads(fn, inputs, backward)
        got = outputs_and_grads(compiled, inputs, backward)
        err = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, ref))
        scale = max(b.double().abs().max().item() for b in ref)
        t_eager = do_bench(step(fn, inputs, backward))
        s = step(compiled, inputs, backward)
        t = do_bench(s)
        floor = nbytes / bw * 1e3
        print(f"\n== {name}: eager {t_eager * 1e3:.1f} us, fuselens {t * 1e3:.1f} us "
              f"({floor / t:.0%} of copy rate; floor {floor * 1e3:.0f} us); max |err| vs eager {err:.3g} "
              f"(max |value| {scale:.3g})")
        if not args.no_profile:
            for key, count, us in kernels(s):
                print(f"   {us:8.1f} us x{count}  {key[:90]}")


if __name__ == "__main__":
    main()
