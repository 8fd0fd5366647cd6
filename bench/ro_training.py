"""mode="reduce-overhead" training steps over fresh batches: the bench's MLP fwd+bwd (bf16,
8192x1024x4096) with a new x each step (copied into the forward graph) and `.grad` set to None
before each step; ms a step (do_bench, 5 alternating rounds) for eager, fuselens default and
reduce-overhead, torch.compile default and reduce-overhead.

    PYTHONPATH=compiler python bench/ro_training.py [variant ...]
"""
import sys

import torch

import run as bench
from workloads import workloads

import fuselens


def main():
    w = next(w for w in workloads() if w.name == "mlp fwd+bwd bf16")
    x, *params = w.make_inputs()
    batches = [torch.randn_like(x) for _ in range(4)]  # fresh tensors, in turn
    fns = {"eager": w.fn, "fuselens": fuselens.compile(w.fn), "fuselens reduce-overhead":
           fuselens.compile(w.fn, mode="reduce-overhead"), "torch.compile": torch.compile(w.fn),
           "torch.compile reduce-overhead": torch.compile(w.fn, mode="reduce-overhead")}
    g = torch.randn(x.shape[0], params[2].shape[0], device="cuda", dtype=x.dtype)

    def step(fn):
        turn = [0]

        def s():
            turn[0] = (turn[0] + 1) % len(batches)
            for p in params:
                p.grad = None
            fn(batches[turn[0]], *params).backward(g)
        return s
    steps = {k: step(f) for k, f in fns.items() if k in (sys.argv[1:] or fns)}
    for s in steps.values():
        for _ in range(40):  # compiles, records, past the replay-or-launch trials
            s()
    torch.cuda.synchronize()
    times = bench.in_rounds(steps, bench.do_bench)
    for k, ms in times.items():
        print(f"{k:32} {ms:.3f} ms" + (f"  ({ms / times['eager']:.2f}x eager)" if "eager" in times else ""))


if __name__ == "__main__":
    main()
