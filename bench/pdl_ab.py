"""Programmatic dependent launch on and off, in one process: each workload compiled twice by
fuselens (FUSELENS_PDL=0 and 1 while it builds), timed in alternating rounds with eager and
torch.compile (CUDA events, medians, the median of 5 rounds).

    PYTHONPATH=compiler python bench/pdl_ab.py [NAME-SUBSTRING ...]
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

import run as bench
from workloads import workloads

import fuselens


def graphed(step):
    """A CUDA graph of `step` (forward and backward), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main(names):
    bench.ROUNDS = 5
    rows = []
    for w in workloads():
        if names and not any(n in w.name for n in names):
            continue
        inputs = w.make_inputs()
        fns = {"eager": w.fn}
        for flag in ("0", "1"):  # built (on the first call) with PDL off, then on
            os.environ["FUSELENS_PDL"] = flag
            fns[f"pdl={flag}"] = fuselens.compile(w.fn)
            with torch.no_grad() if not w.backward else contextlib.nullcontext():
                fns[f"pdl={flag}"](*inputs)
        fns["torch.compile"] = torch.compile(w.fn)
        steps = {k: bench.step(f, inputs, w.backward) for k, f in fns.items()}
        for s in steps.values():
            s()
        torch.cuda.synchronize()
        times = bench.in_rounds(steps, bench.do_bench)
        rows.append((w.name, times))
        print(w.name, {k: round(v * 1e3, 2) for k, v in times.items()}, flush=True)
        # where a difference comes from: host time per call, and the GPU's kernel time per call
        # (a kernel launched early counts its wait in its profiled time: the sum overstates with PDL)
        print("  host us", {k: round(bench.host_per_call(s) * 1e6, 1) for k, s in steps.items()},
              "kernels us", {k: round(bench.kernel_time(s) * 1e3, 1) for k, s in steps.items()}, flush=True)
        if w.backward:  # a host-bound step: its GPU time alone, as replays of a CUDA graph of it
            graphs = {k: graphed(s) for k, s in steps.items() if k.startswith("pdl")}
            replays = bench.in_rounds(graphs, bench.do_bench)
            print("  graph replay us", {k: round(v * 1e3, 1) for k, v in replays.items()}, flush=True)
    print(f"\n{'workload (us)':28} {'eager':>8} {'pdl=0':>8} {'pdl=1':>8} {'t.comp':>8} {'1/0':>6} {'1/eager':>7} "
          f"{'1/tc':>6}")
    for name, t in rows:
        us = {k: v * 1e3 for k, v in t.items()}
        print(f"{name[:28]:28} {us['eager']:8.1f} {us['pdl=0']:8.1f} {us['pdl=1']:8.1f} {us['torch.compile']:8.1f} "
              f"{us['pdl=1'] / us['pdl=0']:6.3f} {us['pdl=1'] / us['eager']:7.3f} "
              f"{us['pdl=1'] / us['torch.compile']:6.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
