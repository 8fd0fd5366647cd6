"""Where a training step's host time goes, fuselens against eager: medians of single calls (the
GPU synchronized between calls, outside the timed part), for the step, its forward, its
backward() and each statement of fuselens's forward and backward wrappers.

    PYTHONPATH=compiler python bench/host_profile.py ["mlp fwd+bwd bf16"]
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workloads import workloads  # noqa: E402

import fuselens  # noqa: E402


def median_us(fn, setup=None, n=200, sync=True):
    times = []
    for i in range(n + 10):
        if not sync:
            torch.cuda.synchronize()
        state = setup() if setup else None
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn() if state is None else fn(state)
        times.append(time.perf_counter() - t)
    return sorted(times[10:])[n // 2] * 1e6


def wrapper_lines(program, args):
    """(statement, median us) for each statement of a program's wrapper, run one at a time."""
    tree = ast.parse(program.wrapper_source)
    fn = tree.body[0]
    params = [a.arg for a in fn.args.args]
    stmts = [s for s in fn.body if not isinstance(s, ast.Return)]
    codes = [(ast.unparse(s), compile(ast.Module([s], []), "<line>", "exec")) for s in stmts]
    rows = []
    base = dict(program.call.__globals__, **dict(zip(params, args)))
    for k, (text, code) in enumerate(codes):
        def setup(k=k):
            ns = dict(base)
            for _, c in codes[:k]:
                exec(c, ns)
            return ns
        rows.append((text[:90], median_us(lambda ns: exec(code, ns), setup, n=100)))
    rows.append(("(exec of `pass`)", median_us(lambda ns: exec("pass", ns), lambda: {}, n=100)))
    return rows


def main(name):
    w = next(w for w in workloads() if w.name == name)
    inputs = w.make_inputs()
    f = fuselens.compile(w.fn)
    out = f(*inputs)
    g = torch.randn_like(out)
    out.backward(g)
    run = next(iter(f.entries[0].graph_calls[0].compiled._specializations.values())).run
    state = inspect.getclosurevars(run).nonlocals["state"]
    with torch.no_grad():
        outs = state.forward(*inputs)
    saved = outs[state.num_fw_outputs:]
    bw = next(iter(state.backward.programs.values()))
    leaves = [t for t in inputs if t.requires_grad]

    def step(fn):
        def s():
            for t in leaves:
                t.grad = None
            fn(*inputs).backward(g)
        return s
    rows = []
    for label, fn in (("eager", w.fn), ("fuselens", f)):
        rows.append((f"{label} step", median_us(step(fn))))
        rows.append((f"{label} forward (grad mode)", median_us(lambda fn=fn: fn(*inputs))))
        rows.append((f"{label} backward()", median_us(lambda o: o.backward(g), lambda fn=fn: fn(*inputs))))
    rows.append(("fuselens backward program, called directly", median_us(lambda: bw(*saved, g))))
    import threading
    on_thread = []
    t = threading.Thread(target=lambda: on_thread.append(median_us(lambda: bw(*saved, g))))
    t.start()
    t.join()
    rows.append(("... called directly on another Python thread", on_thread[0]))
    inside, programs = [], state.backward

    def timed(*xs):
        t0 = time.perf_counter()
        out = programs(*xs)
        inside.append(time.perf_counter() - t0)
        return out
    state.backward = timed
    median_us(step(f))
    state.backward = programs
    inside = sorted(inside[10:])
    rows.append(("... inside backward() of a step (autograd's thread)", inside[len(inside) // 2] * 1e6))
    rows.append(("fuselens forward program, called directly", median_us(lambda: state.forward(*inputs))))
    # a wait for the GPU inside a call shows as host time that grows with work queued before it
    for label, fn in (("eager", w.fn), ("fuselens", f)):
        def queued(fn=fn):
            out = fn(*inputs)
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead of the backward
            return out
        rows.append((f"{label} backward() behind ~1 ms of queued GPU work", median_us(lambda o: o.backward(g), queued)))
        rows.append((f"{label} backward() right after its forward", median_us(
            lambda o: o.backward(g), lambda fn=fn: fn(*inputs), sync=False)))
    from torch.profiler import ProfilerActivity, profile
    s = step(f)
    for _ in range(3):
        s()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            s()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    print(f"\n{name}: host us a call (median)")
    for label, us in rows:
        print(f"  {label:60} {us:8.1f}")
    for label, program, args in (("forward", state.forward, inputs), ("backward", bw, [*saved, g])):
        print(f"{label} wrapper, statement by statement:")
        for text, us in wrapper_lines(program, args):
            print(f"  {us:7.1f}  {text}")


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def engine_overhead():
    """backward() of one small op: eager, a Python autograd.Function, a fuselens graph; with the
    autograd engine's device thread and, for comparison, without it (multithreading off)."""
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    g = torch.randn(64, 64, device="cuda")
    fl = fuselens.compile(lambda x: x * 2)
    fl(x).backward(g)
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for label, fn in (("eager x * 2", lambda x: x * 2), ("autograd.Function (Python backward)", Identity.apply),
                          ("fuselens x * 2", fl)):
            us = median_us(lambda o: o.backward(g), lambda fn=fn: fn(x))
            print(f"  backward() of {label:40} device thread {threads!s:5}: {us:7.1f} us")
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    if sys.argv[1:] == ["engine"]:
        engine_overhead()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "mlp fwd+bwd bf16")
