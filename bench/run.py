"""The benchmark suite: eager vs fuselens vs torch.compile on a CUDA machine, one table.

    PYTHONPATH=compiler python bench/run.py [--only NAME] [--no-cold | --cold-only] [--json OUT.json]
    PYTHONPATH=compiler python bench/run.py --merge WARM.json COLD.json --json bench/results/h100.json

Times are medians of many runs (CUDA events via triton.testing.do_bench) after warm-up, taken in
ROUNDS rounds that alternate eager, fuselens and torch.compile (the median round is reported): an
H100 runs its first heavy fraction of a second at higher clocks, which favoured whichever was timed
first by up to 4% on the MLP rows; the copy ceiling (device-to-device copy bandwidth, bytes read + written) is measured in the same
run. Cold compile times come from fresh processes with empty caches (bench/cold.py); per-call
host time is back-to-back calls with one synchronize at the end."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workloads import workloads  # noqa: E402

import fuselens  # noqa: E402

SMALL = "small pointwise 64x64"
ROUNDS = 5  # ties at the copy rate moved by +-1% between runs of 3 rounds (bench/NOTES.md 29)


def do_bench(fn, reps_ms=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3)


def step(fn, inputs, backward):
    if not backward:
        return lambda: fn(*inputs)
    leaves = [t for t in inputs if t.requires_grad]
    grad_out = None

    def run():
        nonlocal grad_out
        for t in leaves:  # a fresh gradient each step, not accumulated into the last one
            t.grad = None
        out = fn(*inputs)
        if grad_out is None:  # a dense random incoming gradient (out.sum() would give a broadcast one)
            grad_out = torch.randn_like(out)
        out.backward(grad_out)
    return run


def host_time(call, n=2000) -> float:
    """Seconds per call of back-to-back calls, one synchronize at the end (what an
    overhead-bound user pays; for large workloads this is GPU-bound)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def in_rounds(calls: dict, timer) -> dict:
    """{name: [timer(call) of each round]} in ROUNDS rounds that alternate the calls (the machine's
    speed drifts within a run: whichever is timed first must not be favoured); `median` of each
    is what a table reports."""
    times = {k: [] for k in calls}
    for _ in range(ROUNDS):
        for k, call in calls.items():
            times[k].append(timer(call))
    return times


def median(times):
    return sorted(times)[len(times) // 2]


def host_per_call(call, n=25) -> float:
    """Median host (CPU) seconds of one call, no synchronize in between: guards, wrapper and
    launches, while the GPU works behind (few enough calls that its queue never fills)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return sorted(times)[n // 2]


def profile_calls(call, steps=5):
    """torch.profiler (GPU activity) over `steps` calls after 3 warm-up calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    return prof


def exclusive_us(events) -> list[float]:
    """Each GPU activity's microseconds not overlapped by the ones that started before it. A kernel
    launched with programmatic dependent launch (fuselens's, codegen/cuda.py) starts while its
    predecessor runs and waits for it: its own duration holds the predecessor's (a bias
    gradient's 172 KB second stage measured 123 us, the GeLU backward before it), and a sum of
    durations counts that time twice."""
    order = sorted(range(len(events)), key=lambda i: events[i].time_range.start)
    out, reached = [0.0] * len(events), float("-inf")
    for i in order:
        r = events[i].time_range
        out[i] = max(0.0, r.end - max(r.start, reached))
        reached = max(reached, r.end)
    return out


def busy_ms(events) -> float:
    """Milliseconds the GPU was busy over `events` (the union of their intervals)."""
    return sum(exclusive_us(events)) / 1e3


def kernel_time(call, steps=5) -> float:
    """GPU-busy milliseconds per call: a training step's device work alone, without the host
    time between its kernels that the step's wall time also holds."""
    prof = profile_calls(call, steps)
    return busy_ms([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]) / steps


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def cold_compile(name: str, compiler: str) -> dict:
    """First-call compile seconds in a fresh process with empty caches."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TRITON_CACHE_DIR=f"{d}/triton", TORCHINDUCTOR_CACHE_DIR=f"{d}/inductor",
                   FUSELENS_CACHE_DIR=f"{d}/fuselens")
        out = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "cold.py"), name, compiler],
                             env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
        return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--range", default=None, help="workloads START:END (by position) only")
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--cold-only", action="store_true", help="only the cold first-call compile times")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of a warm and a cold part of one run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.json)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    chosen = workloads()
    if args.range:
        start, end = (int(v) if v else None for v in args.range.split(":"))
        chosen = chosen[start:end]
    for w in chosen:
        if args.only and args.only not in w.name:
            continue
        try:
            if args.cold_only:
                row = {"workload": w.name, "cold_fuselens": cold_compile(w.name, "fuselens"),
                       "cold_torch_compile": cold_compile(w.name, "torch.compile")}
            else:
                row = measure(w, bw, args)
        except Exception as e:  # one broken workload must not lose the others' numbers
            import traceback
            traceback.print_exc()
            print(f"{w.name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": triton.__version__, "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
        if args.json:  # after every row: a run cut short keeps what it measured
            pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    print_table(result)


def merge(paths, out):
    """One table from the parts of one run (the warm part and the cold part: one device command
    may run 10 minutes at most, and the whole suite takes longer)."""
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    result = dict(parts[0])
    rows = {r["workload"]: dict(r) for r in parts[0]["rows"]}
    for part in parts[1:]:
        for r in part["rows"]:
            rows.setdefault(r["workload"], {}).update(r)
    result["rows"] = [r for r in rows.values() if "eager_ms" in r]
    result["parts"] = [{k: v for k, v in p.items() if k != "rows"} for p in parts]
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=1))
    print_table(result)


def measure(w, bw, args) -> dict:
    torch._dynamo.reset()  # no recompiles or automatic dynamic shapes from an earlier workload
    inputs = w.make_inputs()
    fl = fuselens.compile(w.fn)
    tc = torch.compile(w.fn)
    with torch.no_grad() if not w.backward else contextlib.nullcontext():
        ref = w.fn(*inputs)
    t = time.perf_counter()
    got = fl(*inputs)
    torch.cuda.synchronize()
    warm_fl = time.perf_counter() - t
    t = time.perf_counter()
    tc(*inputs)
    torch.cuda.synchronize()
    warm_tc = time.perf_counter() - t
    row = {"workload": w.name, "max_err": max_error(got, ref), "first_call_s_in_process": [warm_fl, warm_tc]}
    fns = {"eager": w.fn, "fuselens": fl, "torch_compile": tc}
    if w.backward:  # training steps in reduce-overhead mode too: CUDA graphs, no host time per kernel
        fns.update(fuselens_ro=fuselens.compile(w.fn, mode="reduce-overhead"),
                   torch_compile_ro=torch.compile(w.fn, mode="reduce-overhead"))
    steps = {k: step(f, inputs, w.backward) for k, f in fns.items()}
    for k, s in steps.items():
        for _ in range(40 if k.endswith("_ro") else 1):  # compiles the backward too; past the
            s()                                          # recordings and replay-or-launch trials
        torch.cuda.synchronize()
    if w.backward:
        row["fuselens_ro_max_err"] = max_error(fns["fuselens_ro"](*inputs), ref)
    for k, ms in in_rounds(steps, do_bench).items():
        row[f"{k}_ms"] = median(ms)
    row["ratio"] = row["fuselens_ms"] / row["torch_compile_ms"]
    if w.min_bytes:
        row["bw_frac"] = w.min_bytes / (row["fuselens_ms"] * 1e-3) / bw
        row["tc_bw_frac"] = w.min_bytes / (row["torch_compile_ms"] * 1e-3) / bw
    if w.backward and w.min_bytes:  # a step's kernels alone at the copy rate (host time aside)
        for k in ("fuselens", "torch_compile"):
            row[f"{k}_kernel_ms"] = kernel_time(steps[k])
            row[f"{k}_kernel_bw_frac"] = w.min_bytes / (row[f"{k}_kernel_ms"] * 1e-3) / bw
    for k, s in steps.items():
        row[f"{k}_host_us"] = host_per_call(s) * 1e6
    if w.name == SMALL:  # overhead-bound: back-to-back throughput, one synchronize at the end
        ro = fuselens.compile(w.fn, mode="reduce-overhead")
        tro = torch.compile(w.fn, mode="reduce-overhead")
        # reduce-overhead when each call's inputs lie elsewhere (two input sets, alternating):
        # what a loop over fresh tensors pays, as against one that refills the same buffers
        # (and when only the first input moves: the second, a weight say, is read where it lies)
        moved, other = fuselens.compile(w.fn, mode="reduce-overhead"), w.make_inputs()
        x_moved = fuselens.compile(w.fn, mode="reduce-overhead")

        def alternating(fn, second):
            parity = [0]

            def call():
                parity[0] ^= 1
                return fn(*(other[:1] + second if parity[0] else inputs))
            return call
        calls = dict(steps, fuselens_ro=step(ro, inputs, False), torch_compile_ro=step(tro, inputs, False),
                     fuselens_ro_moved=alternating(moved, other[1:]),
                     fuselens_ro_x_moved=alternating(x_moved, inputs[1:]))
        for k, seconds in in_rounds(calls, host_time).items():  # host time drifts there too
            row[f"{k}_b2b_us"] = median(seconds) * 1e6
        for k, f in (("fuselens_ro", ro), ("torch_compile_ro", tro)):
            row[f"{k}_host_us"] = host_per_call(calls[k]) * 1e6
            row[f"{k}_max_err"] = max_error(f(*inputs), ref)
        row["fuselens_ro_moved_max_err"] = max(max_error(moved(*inputs), ref), max_error(moved(*other), w.fn(*other)))
    if not args.no_cold:
        row["cold_fuselens"] = cold_compile(w.name, "fuselens")
        row["cold_torch_compile"] = cold_compile(w.name, "torch.compile")
    return row


def print_table(result):
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, "
          f"copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s (read + write)")
    fmt = lambda v, f: (f % v) if isinstance(v, (int, float)) else "-"
    hdr = (f"{'workload':28} {'eager':>7} {'fuselens':>8} {'t.comp':>7} {'fl/tc':>5} {'fl/eg':>5} {'bw%':>4} {'tcbw%':>5} "
           f"{'cold fl':>7} {'(own)':>5} {'cold tc':>7} {'cold fl/tc':>10} {'host fl':>7} {'host tc':>7} {'maxerr':>7}")
    print("times in ms; cold in s (fresh process, empty caches); host: us per call (CPU, median)")
    print(hdr)
    for r in result["rows"]:
        cf, ct = r.get("cold_fuselens", {}), r.get("cold_torch_compile", {})
        cold_ratio = cf["seconds"] / ct["seconds"] if "seconds" in cf and "seconds" in ct else None
        print(f"{r['workload'][:28]:28} {fmt(r.get('eager_ms'), '%7.3f')} {fmt(r.get('fuselens_ms'), '%8.3f')} "
              f"{fmt(r.get('torch_compile_ms'), '%7.3f')} "
              f"{fmt(r.get('ratio'), '%5.2f')} "
              f"{fmt(r['fuselens_ms'] / r['eager_ms'] if 'eager_ms' in r else None, '%5.2f')} "
              f"{fmt(100 * r['bw_frac'] if 'bw_frac' in r else None, '%4.0f')} "
              f"{fmt(100 * r['tc_bw_frac'] if 'tc_bw_frac' in r else None, '%5.0f')} "
              f"{fmt(cf.get('seconds'), '%7.2f')} {fmt(cf.get('own_seconds'), '%5.2f')} "
              f"{fmt(ct.get('seconds'), '%7.2f')} {fmt(cold_ratio, '%10.2f')} "
              f"{fmt(r.get('fuselens_host_us'), '%7.1f')} {fmt(r.get('torch_compile_host_us'), '%7.1f')} "
              f"{fmt(r.get('max_err'), '%7.1e')}")
    for r in result["rows"]:
        if "fuselens_ro_ms" in r:
            print(f"{r['workload']}: reduce-overhead (CUDA graphs), ms a step: fuselens {r['fuselens_ro_ms']:.3f} "
                  f"({r['fuselens_ro_ms'] / r['eager_ms']:.2f}x eager), torch.compile {r['torch_compile_ro_ms']:.3f} "
                  f"({r['torch_compile_ro_ms'] / r['eager_ms']:.2f}x eager)")
        if "fuselens_kernel_ms" in r:
            print(f"{r['workload']}: GPU kernels per step: fuselens {r['fuselens_kernel_ms']:.3f} ms "
                  f"({100 * r['fuselens_kernel_bw_frac']:.0f}% of the copy rate), torch.compile "
                  f"{r['torch_compile_kernel_ms']:.3f} ms ({100 * r['torch_compile_kernel_bw_frac']:.0f}%)")
        if "fuselens_b2b_us" in r:
            print(f"{r['workload']}: back-to-back us/call: eager {r['eager_b2b_us']:.1f}, "
                  f"fuselens {r['fuselens_b2b_us']:.1f}, torch.compile {r['torch_compile_b2b_us']:.1f}, "
                  f"fuselens reduce-overhead {r['fuselens_ro_b2b_us']:.1f} "
                  f"({r['fuselens_ro_moved_b2b_us']:.1f} with inputs elsewhere each call, "
                  f"{r.get('fuselens_ro_x_moved_b2b_us', float('nan')):.1f} with x alone), "
                  f"torch.compile reduce-overhead {r['torch_compile_ro_b2b_us']:.1f}")


if __name__ == "__main__":
    main()
