"""The benchmark suite: eager vs fuselens vs torch.compile on a CUDA machine, one table.

    python bench/run.py [--quick] [--only NAME] [--json bench/results/h100.json]

Times are medians of many runs (CUDA events via triton.testing.do_bench) after warm-up; the
copy ceiling (device-to-device copy bandwidth, bytes read + written) is measured in the same
run. Cold compile times come from fresh processes with empty caches (bench/cold.py); per-call
host time is back-to-back calls with one synchronize at the end."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workloads import workloads  # noqa: E402

import fuselens  # noqa: E402


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
    def run():
        out = fn(*inputs)
        out.sum().backward()
    return run


def host_time(fn, inputs, n=2000) -> float:
    """Seconds per call of back-to-back calls (what an overhead-bound user pays)."""
    for _ in range(20):
        fn(*inputs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


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
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    for w in workloads():
        if args.only and args.only not in w.name:
            continue
        inputs = w.make_inputs()
        fl = fuselens.compile(w.fn)
        tc = torch.compile(w.fn)
        ref = w.fn(*inputs)
        got = fl(*inputs)
        tc(*inputs)
        row = {"workload": w.name, "max_err": max_error(got, ref)}
        for key, f in (("eager", w.fn), ("fuselens", fl), ("torch_compile", tc)):
            row[f"{key}_ms"] = do_bench(step(f, inputs, w.backward))
        row["ratio"] = row["fuselens_ms"] / row["torch_compile_ms"]
        if w.min_bytes:
            row["bw_frac"] = w.min_bytes / (row["fuselens_ms"] * 1e-3) / bw
            row["tc_bw_frac"] = w.min_bytes / (row["torch_compile_ms"] * 1e-3) / bw
        if not w.backward:
            row["fuselens_host_us"] = host_time(fl, inputs) * 1e6
            row["torch_compile_host_us"] = host_time(tc, inputs) * 1e6
            row["eager_host_us"] = host_time(w.fn, inputs) * 1e6
        if not args.no_cold:
            row["cold_fuselens"] = cold_compile(w.name, "fuselens")
            row["cold_torch_compile"] = cold_compile(w.name, "torch.compile")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if "small pointwise 64x64" in [r["workload"] for r in rows]:
        w = next(w for w in workloads() if w.name == "small pointwise 64x64")
        inputs = w.make_inputs()
        ro = fuselens.compile(w.fn, mode="reduce-overhead")
        tro = torch.compile(w.fn, mode="reduce-overhead")
        extra = {"fuselens_reduce_overhead_host_us": host_time(ro, inputs) * 1e6,
                 "torch_compile_reduce_overhead_host_us": host_time(tro, inputs) * 1e6}
        print(json.dumps(extra))
    else:
        extra = {}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_TBps": bw / 1e12, "rows": rows, **extra}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result):
    print(f"\n{result['device']}, torch {result['torch']}, copy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s")
    hdr = f"{'workload':30} {'eager':>7} {'fuselens':>8} {'t.comp':>7} {'fl/tc':>6} {'bw%':>5} {'tc bw%':>6} " \
          f"{'cold fl s':>9} {'(own)':>6} {'cold tc s':>9} {'host fl us':>10} {'host tc us':>10} {'maxerr':>8}"
    print(hdr)
    for r in result["rows"]:
        cf, ct = r.get("cold_fuselens", {}), r.get("cold_torch_compile", {})
        fmt = lambda v, f: (f % v) if isinstance(v, (int, float)) else "-"
        print(f"{r['workload']:30} {r['eager_ms']:7.3f} {r['fuselens_ms']:8.3f} {r['torch_compile_ms']:7.3f} "
              f"{r['ratio']:6.2f} {fmt(r.get('bw_frac', '-') if 'bw_frac' not in r else 100 * r['bw_frac'], '%5.0f')} "
              f"{fmt(100 * r['tc_bw_frac'] if 'tc_bw_frac' in r else '-', '%6.0f')} "
              f"{fmt(cf.get('seconds'), '%9.2f')} {fmt(cf.get('own_seconds'), '%6.2f')} {fmt(ct.get('seconds'), '%9.2f')} "
              f"{fmt(r.get('fuselens_host_us'), '%10.1f')} {fmt(r.get('torch_compile_host_us'), '%10.1f')} "
              f"{r['max_err']:8.1e}")
    for k in ("fuselens_reduce_overhead_host_us", "torch_compile_reduce_overhead_host_us"):
        if k in result:
            print(f"{k}: {result[k]:.1f}")


if __name__ == "__main__":
    main()
