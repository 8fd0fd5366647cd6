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
from run import step as train_step  # noqa: E402
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

    def step(fn):
        return train_step(fn, inputs, True)
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
    programs = state.backward

    def inside_backward(runs):
        """Median us of each of `runs` calls of the backward program inside backward() of a step:
        a cold thread pays on the first call only, a slower context on every one."""
        times = [[] for _ in range(runs)]

        def timed(*xs):
            for ts in times:
                t0 = time.perf_counter()
                out = programs(*xs)
                ts.append(time.perf_counter() - t0)
            return out
        state.backward = timed
        median_us(step(f))
        state.backward = programs
        return [sorted(ts[10:])[(len(ts) - 10) // 2] * 1e6 for ts in times]
    rows.append(("... inside backward() of a step (autograd's thread)", inside_backward(1)[0]))
    for label, us in zip(("first", "second"), inside_backward(2)):
        rows.append((f"... called twice inside backward(): the {label}", us))
    stamps = []

    def stamped(*xs):
        stamps.append(time.perf_counter())
        out = programs(*xs)
        stamps.append(time.perf_counter())
        return out
    state.backward = stamped
    spans = []
    for _ in range(110):
        o = f(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o.backward(g)
        t3 = time.perf_counter()
        spans.append((stamps[-2] - t0, stamps[-1] - stamps[-2], t3 - stamps[-1]))
    state.backward = programs
    for k, label in enumerate(("backward() call to our program's start", "our program", "its end to backward()'s return")):
        v = sorted(x[k] for x in spans[10:])
        rows.append((f"... {label}", v[len(v) // 2] * 1e6))
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


class PyBackward(torch.autograd.Function):
    """x.view_as(x) whose backward runs `PyBackward.body(ctx, g)`: what a Python backward's pieces cost."""
    body = None

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return PyBackward.body(ctx, g)


def engine_overhead():
    """backward() of one small op: eager, Python autograd.Functions doing parts of what fuselens's
    backward does, a fuselens graph; with the autograd engine's device thread and, for comparison,
    without it (multithreading off)."""
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    g = torch.randn(64, 64, device="cuda")
    fl = fuselens.compile(lambda x: x * 2)
    fl(x).backward(g)
    run = next(iter(fl.entries[0].graph_calls[0].compiled._specializations.values())).run
    bw = next(iter(inspect.getclosurevars(run).nonlocals["state"].backward.programs.values()))
    launch = bw.call.__globals__[bw.kernels[0].name].launch

    def launched(ctx, g):
        out = torch.empty_like(g)
        launch(g, out)
        return out
    bodies = (("return g", lambda ctx, g: g),
              ("ctx.saved_tensors; return g", lambda ctx, g: ctx.saved_tensors and g),
              ("return torch.empty_like(g)", lambda ctx, g: torch.empty_like(g)),
              ("return g * 2 (torch)", lambda ctx, g: g * 2),
              ("empty_like + fuselens launch function", launched))
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        rows = [("eager x * 2", lambda x: x * 2)] + [(f"Function: {b}", PyBackward.apply) for b, _ in bodies] + \
            [("fuselens x * 2", fl)]
        for i, (label, fn) in enumerate(rows):
            if 1 <= i <= len(bodies):
                PyBackward.body = bodies[i - 1][1]
            us = median_us(lambda o: o.backward(g), lambda fn=fn: fn(x))
            print(f"  backward() of {label:45} device thread {threads!s:5}: {us:7.1f} us")
    torch.autograd.set_multithreading_enabled(True)


def busy_us(step, n=12, rounds=15):
    """Host us a step with the GPU kept busy, so the host never waits for it (as in a GPU-bound
    loop): ~n steps queued behind a long GPU sleep, the median of `rounds` such runs."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU work ahead of the steps
        t = time.perf_counter()
        for _ in range(n):
            step()
        times.append((time.perf_counter() - t) / n)
    torch.cuda.synchronize()
    return sorted(times)[rounds // 2] * 1e6


def busy(names):
    """Host time of a training step with the GPU busy (eager, fuselens), then a cProfile of
    fuselens's steps."""
    import cProfile
    import pstats
    for name in names:
        w = next(w for w in workloads() if w.name == name)
        inputs = w.make_inputs()
        f = fuselens.compile(w.fn)

        def step(fn):
            return train_step(fn, inputs, True)
        for fn in (w.fn, f):
            for _ in range(5):
                step(fn)()
        rows = [(label, busy_us(step(fn))) for label, fn in (("eager", w.fn), ("fuselens", f)) for _ in range(2)]
        print(f"\n{name}: host us a step, GPU busy: " + ", ".join(f"{label} {us:.1f}" for label, us in rows))
        # one profiler: from Python 3.12 it sees every thread (autograd's too), before that the main one
        prof, s = cProfile.Profile(), step(f)
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)
        prof.enable()
        for _ in range(20):
            s()
        prof.disable()
        torch.cuda.synchronize()
        print("-- cProfile of 20 fuselens steps: us a step, own time (and with what it calls)")
        stats = pstats.Stats(prof).stats
        for (file, line, fn), (_, calls, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]:
            print(f"  {own / 20 * 1e6:7.1f} {cum / 20 * 1e6:7.1f}  {calls / 20:4.1f}x  {pathlib.Path(file).name}:{line}({fn})")


if __name__ == "__main__":
    if sys.argv[1:] == ["engine"]:
        engine_overhead()
    elif sys.argv[1:2] == ["busy"]:
        busy(sys.argv[2:] or ["mlp fwd+bwd bf16", "layernorm fwd+bwd 8192x4096"])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "mlp fwd+bwd bf16")
