"""A broad GPU suite in the manner of PyTorch's dashboard (benchmarks/dynamo): eager vs fuselens vs
torch.compile (Inductor) on models nobody tuned fuselens for (bench/suite_models.py: transformers,
timm, torchvision, a diffusion-style UNet), training with bf16 autocast and an optimizer step, and
inference in bf16 (and fp32 for the convolutional networks).

    PYTHONPATH=compiler python bench/suite.py --only t5_small --mode train      # one model
    PYTHONPATH=compiler python bench/suite.py --part 2/6 --json part2.json      # a sixth of the rows
    PYTHONPATH=compiler python bench/suite.py --inductor-from old.json ...      # Inductor's rows reused
    PYTHONPATH=compiler python bench/suite.py --mode infer --warm-inductor 5 ... # Inductor compiled 5 at a time first
    PYTHONPATH=compiler python bench/suite.py --part 2/6 --json part2.json --resume   # the rows part2.json lacks
    python bench/suite.py --merge part*.json --json bench/results/suite-h200.json
    python bench/suite.py --list

Per row (model, mode, dtype), in one process:
- the first step of each compiler from identical copies of the model, timed (compile included:
  `*_first_s`; every compiler's disk caches are empty when the process starts, and the rows of one
  process share them: run one model per process for first calls that find nothing of another
  model's) and checked against eager's: every output,
  and in training every parameter's gradient, within 1e-2 (bf16) or 1e-3 (fp32) relative error
  ||got - want|| / ||want||; where one is not, the step in float64 decides, as the dashboard's
  `same()` does: it passes where its error against float64 is at most 2x eager's + tol/10;
- steps timed in ROUNDS rounds alternating the compilers (medians of triton.testing.do_bench);
- per compiler, kernels launched per step and their GPU time (the profiler), peak memory of a step;
- fuselens's graphs and graph breaks (fuselens.inspect), and any fallback to eager (a failure).
Training: SGD (foreach) steps eagerly after the compiled forward and backward, for all three; the
loss is the model's own where it returns one, else a fixed random gradient of its first output.
Inductor's rows may be taken from an earlier run on the same GPU and torch version
(`--inductor-from`): its compile time dominates a run; eager and fuselens are always timed side
by side in one run."""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fuselens  # noqa: E402
from models import no_dropout, outputs, rel  # noqa: E402
from run import busy_ms, exclusive_us, in_rounds, median, profile_calls  # noqa: E402
from suite_models import MODELS  # noqa: E402

COMPILERS = ("eager", "fuselens", "inductor")
TOL = {"bf16": 1e-2, "fp32": 1e-3}
# the row's keys the Inductor columns are made of (taken whole from an earlier run by --inductor-from)
INDUCTOR_KEYS = ("inductor_ms", "inductor_first_s", "inductor_peak_mb", "inductor_start_mb", "inductor_gpu_ms",
                 "inductor_kernels", "inductor_ok", "inductor_err", "inductor_rounds_ms", "inductor_first_warm_s", "inductor_first_parallel")


class Autocast(torch.nn.Module):
    """The model's forward under bf16 autocast entered inside the compiled code (as accelerate
    wraps a model's forward); `enabled` off for the float64 twin."""

    def __init__(self, m, device_type):
        super().__init__()
        self.m, self.device_type, self.enabled = m, device_type, True

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.enabled):
            return self.m(*args, **kwargs)


def build(name, mode, dtype, device, batch=None):
    """(model, args, kwargs) of one row, seeded, on `device`."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model, inputs = spec.build(batch or spec.batch)
    no_dropout(model)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), dict(inputs))
    if mode == "infer":
        for k in spec.train_only_inputs:
            kwargs.pop(k, None)
        model.eval()
        if dtype == "bf16":
            model.to(torch.bfloat16)
            half = lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t
            args, kwargs = _tensors(args, half), _tensors(kwargs, half)
    else:
        model = Autocast(model.train(), torch.device(device).type)
    move = lambda t: t.to(device)
    return model.to(device), _tensors(args, move), _tensors(kwargs, move)


def _tensors(v, fn):
    """`fn` applied to each tensor of a tuple or dict of inputs (others, as `return_loss`, kept)."""
    if isinstance(v, dict):
        return {k: _tensors(x, fn) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(_tensors(x, fn) for x in v)
    return fn(v) if isinstance(v, torch.Tensor) else v


class Step:
    """One step of a model: inference under no_grad, or forward, backward and an SGD step."""

    def __init__(self, model, mode, args, kwargs):
        self.model, self.train, self.args, self.kwargs = model, mode == "train", args, kwargs
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=1e-5, foreach=True) if self.train else None
        self.grad_out = None

    def forward_backward(self):
        if not self.train:
            with torch.no_grad():
                return outputs(self.model(*self.args, **self.kwargs))
        self.opt.zero_grad(set_to_none=True)
        outs = outputs(self.model(*self.args, **self.kwargs))
        if outs[0].dim() == 0:  # the model's loss
            outs[0].backward()
        else:  # a dense random gradient (a mean would give a final LayerNorm's gradients zero)
            if self.grad_out is None:
                gen = torch.Generator(device=outs[0].device).manual_seed(0)
                self.grad_out = torch.randn(outs[0].shape, generator=gen, device=outs[0].device, dtype=outs[0].dtype)
            outs[0].backward(self.grad_out)
        return outs

    def __call__(self):
        outs = self.forward_backward()
        if self.train:
            self.opt.step()
        return outs

    def checked(self):
        """(outputs, gradients) of one step before the optimizer moves the parameters, copied."""
        outs = [o.detach().clone() for o in self.forward_backward()]
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in self.params] if self.train else []
        if self.train:
            self.opt.step()
        return outs, grads


def errors(got, want):
    """The relative error of each output and gradient (inf where they do not pair up)."""
    if len(got[0]) != len(want[0]) or len(got[1]) != len(want[1]):
        return [math.inf]
    return [rel(a.float() if a is not None else a, b.float() if b is not None else b)
            for a, b in zip(got[0] + got[1], want[0] + want[1])]


def passes(got, want, tol, float64):
    """Within `tol` of eager's, or, where not, as close to the float64 step's as the dashboard
    asks (`float64()` computes it once, on demand). (ok, the largest relative error)."""
    errs = errors(got, want)
    worst = max(errs, default=0.0)
    if worst <= tol:
        return True, worst
    if math.isinf(worst):
        return False, worst
    exact = float64()
    pairs = list(zip(got[0] + got[1], want[0] + want[1], exact[0] + exact[1]))
    return all(e <= tol or rel(a, x) <= 2 * rel(b, x) + tol / 10 for e, (a, b, x) in zip(errs, pairs)), worst


def float64_step(pristine, mode, args, kwargs):
    m = copy.deepcopy(pristine).double()
    if isinstance(m, Autocast):
        m.enabled = False
    wide = lambda t: t.double() if t.is_floating_point() else t
    return Step(m, mode, _tensors(args, wide), _tensors(kwargs, wide)).checked()


def empty_disk_caches(root):
    """Each compiler's disk caches (Triton's, Inductor's, fuselens's) empty, under `root`: set
    before anything compiles (fuselens's compile workers, forked once, keep the directory)."""
    for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FUSELENS_CACHE_DIR"):
        os.environ[k] = os.path.join(root, k.lower())


def timer(device):
    if device.startswith("cuda"):
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu(fn, n=3):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return median(times)
    return cpu


def gpu_activity(call, steps=3, top=8):
    """(GPU activities per step: kernels, copies, fills; the GPU's busy milliseconds per step; the
    `top` kernel names by GPU time (not overlapped by earlier kernels: run.exclusive_us), with their
    milliseconds and launches per step)."""
    ev = [e for e in profile_calls(call, steps).events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name = {}
    for e, us in zip(ev, exclusive_us(ev)):
        ms, n = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (ms + us / steps / 1e3, n + 1 / steps)
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return len(ev) / steps, busy_ms(ev) / steps, \
        [[name[:90], round(ms, 3), round(n, 1)] for name, (ms, n) in heaviest]


def peak_mb(call):
    """(Peak GPU memory during one step, memory allocated when it starts), MB. Both include every
    model in the process (eager's, the other compiler's, with their gradients): peak - start is
    the step's own, comparable between runs that hold other models (bench/NOTES.md 88)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 20, start / 2 ** 20


def measure(name, mode, dtype, device, compilers, batch=None):
    """One row of the table."""
    spec = MODELS[name]
    row = {"model": name, "suite": spec.suite, "mode": mode, "dtype": dtype, "batch": batch or spec.batch,
           "layers": spec.layers}
    eager, args, kwargs = build(name, mode, dtype, device, batch)
    pristine = copy.deepcopy(eager)
    models = {"eager": eager}
    for c in compilers[1:]:
        m = copy.deepcopy(pristine)
        models[c] = fuselens.compile(m) if c == "fuselens" else torch.compile(m)
    steps = {c: Step(models[c], mode, args, kwargs) for c in compilers}
    results, cuda = {}, device.startswith("cuda")
    for c in compilers:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", fuselens.FuselensWarning)
            t = time.perf_counter()
            try:
                results[c] = steps[c].checked()
                if cuda:
                    torch.cuda.synchronize()
            except Exception as e:
                # a fall-back's warning names the first failure (a kernel's fault shows later, in
                # whatever the GPU ran next: the eager fall-back's own call)
                warned = [str(w.message) for w in caught if issubclass(w.category, fuselens.FuselensWarning)]
                if warned:
                    raise RuntimeError(f"after fuselens's fall-back ({warned[0][:200]}): {type(e).__name__}: {e}") from e
                raise
            row[f"{c}_first_s"] = round(time.perf_counter() - t, 3)
        if c == "fuselens":
            row["fallbacks"] = sorted({str(w.message)[:300] for w in caught
                                       if issubclass(w.category, fuselens.FuselensWarning)})
    exact = []
    float64 = lambda: exact[0] if exact else exact.append(float64_step(pristine, mode, args, kwargs)) or exact[0]
    for c in compilers[1:]:
        row[f"{c}_ok"], row[f"{c}_err"] = passes(results[c], results["eager"], TOL[dtype], float64)
    del results, exact, pristine
    entries = fuselens.inspect(models["fuselens"])
    row["graphs"] = sum(len(e.graphs) for e in entries)
    row["breaks"] = sum(e.graph_break is not None for e in entries)
    row["break_details"] = sorted({f"{b.code} {os.path.basename(b.filename)}:{b.line} {b.detail[:100]}"
                                   for e in entries if (b := e.graph_break) is not None})[:8]
    row["ok"] = row["fuselens_ok"] and not row["fallbacks"]
    row["why"] = ("fallback: " + row["fallbacks"][0]) if row["fallbacks"] else \
        None if row["fuselens_ok"] else f"mismatch: relative error {row['fuselens_err']:.2e}"
    for s in steps.values():  # warm: the rounds time steady steps
        s()
    for c, ms in in_rounds(steps, timer(device)).items():
        row[f"{c}_ms"], row[f"{c}_rounds_ms"] = round(median(ms), 3), [round(x, 3) for x in ms]
    if cuda:
        for c in compilers:
            kernels, gpu_ms, row[f"{c}_top_kernels"] = gpu_activity(steps[c])
            row[f"{c}_kernels"], row[f"{c}_gpu_ms"] = round(kernels, 1), round(gpu_ms, 3)
            peak, start = peak_mb(steps[c])
            row[f"{c}_peak_mb"], row[f"{c}_start_mb"] = round(peak, 1), round(start, 1)
    return row


def inductor_first_step(name, mode, dtype, device, batch=None):
    """Seconds of Inductor's cold first step of one row (its compile): what --warm-inductor's
    processes run, filling the disk caches that the row's timed run then reads."""
    model, args, kwargs = build(name, mode, dtype, device, batch)
    step = Step(torch.compile(model), mode, args, kwargs)
    t = time.perf_counter()
    step.checked()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return round(time.perf_counter() - t, 3)


def warm_inductor(keys, procs, a):
    """{row: Inductor's cold first-step seconds}, compiled in `procs` processes at once before the
    rows are timed one by one: Inductor's compile is most of a row's time, and from its disk
    caches (the same directory: `empty_disk_caches`) the timed run compiles the row again in a
    fraction of it. The kernel configurations that Inductor's first runs autotuned on a GPU shared
    by the other processes are deleted, so the timed run tunes them alone. The seconds were
    measured beside `procs - 1` other compiles: the summary keeps them apart (`inductor_first_parallel`)."""
    import concurrent.futures
    import subprocess

    def one(key):
        cmd = [sys.executable, __file__, "--warm-row", ":".join(key), "--device", a.device] + \
            (["--batch", str(a.batch)] if a.batch else [])
        # (each process's compile pool sized to its share of the cores)
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 2) // procs)))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        last = (p.stdout.strip().splitlines() or [""])[-1]
        return key, float(last) if p.returncode == 0 and last.replace(".", "", 1).isdigit() else None

    with concurrent.futures.ThreadPoolExecutor(procs) as pool:
        firsts = dict(pool.map(one, keys))
    for f in pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.best_config"):
        f.unlink()
    print(f"[suite] Inductor compiled {sum(v is not None for v in firsts.values())} of {len(keys)} rows in "
          f"{procs} processes", flush=True)
    return firsts


def rows_of(a):
    """The (model, mode, dtype) rows selected by --only, --suite, --mode and --part."""
    names = a.only.split(",") if a.only else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"suite: no model named {', '.join(unknown)} (--list shows them)")
    rows = [(n, mode, dtype) for n in names if not a.suite or MODELS[n].suite == a.suite
            for mode, dtype in MODELS[n].modes if not a.mode or mode == a.mode]
    if a.part:
        k, n = (int(x) for x in a.part.split("/"))
        rows = rows[k - 1::n]
    return rows


def machine():
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__}


def inductor_rows(path, here, key=None, tool="suite"):
    """The rows with Inductor's columns of an earlier run on the same GPU and torch version, by
    `key` (default: row_key)."""
    if not path:
        return {}
    old = json.loads(pathlib.Path(path).read_text())
    if old.get("machine") != here:
        sys.exit(f"{tool}: {path} was measured on {old.get('machine')}, this is {here}: Inductor's rows "
                 "are reused only from the same GPU and torch version")
    return {(key or row_key)(r): r for r in old["rows"] if any(k.startswith("inductor_ms") for k in r)}


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 3) if xs else None


def summary(rows):
    out = {}
    for mode in ("train", "infer"):
        rs = [r for r in rows if r["mode"] == mode]
        # the rows with all three times (Inductor's columns are measured apart), and those with
        # eager's and fuselens's
        timed = [r for r in rs if r.get("fuselens_ms") and r.get("inductor_ms") and r.get("eager_ms")]
        ran = [r for r in rs if r.get("fuselens_ms") and r.get("eager_ms")]
        if not rs:
            continue
        out[mode] = {
            "rows": len(rs), "passed": sum(bool(r.get("ok")) for r in rs),
            "pass_rate": round(sum(bool(r.get("ok")) for r in rs) / len(rs), 3),
            "rows_with_inductor": len(timed),
            "fuselens_speedup_geomean_every_row": geomean([r["eager_ms"] / r["fuselens_ms"] for r in ran]),
            "fuselens_speedup_geomean": geomean([r["eager_ms"] / r["fuselens_ms"] for r in timed]),
            "inductor_speedup_geomean": geomean([r["eager_ms"] / r["inductor_ms"] for r in timed]),
            "fuselens_over_inductor_geomean": geomean([r["fuselens_ms"] / r["inductor_ms"] for r in timed]),
            # (Inductor's cold compiles measured one at a time; those of --warm-inductor, several at once, apart)
            "first_call_fuselens_over_inductor_geomean": geomean(
                [r["fuselens_first_s"] / r["inductor_first_s"] for r in timed
                 if r.get("inductor_first_s") and not r.get("inductor_first_parallel")]),
            "first_call_fuselens_over_inductor_geomean_compiled_in_parallel": geomean(
                [r["fuselens_first_s"] / r["inductor_first_s"] for r in timed
                 if r.get("inductor_first_s") and r.get("inductor_first_parallel")]),
            "rows_above_1.03x_inductor": sorted(r["model"] for r in timed if r["fuselens_ms"] > 1.03 * r["inductor_ms"]),
            "rows_slower_than_eager": sorted(r["model"] for r in ran if r["fuselens_ms"] > r["eager_ms"]),
            "rows_peak_above_inductor": sorted(r["model"] for r in timed if mode == "train" and
                                               r.get("fuselens_peak_mb", 0) > r.get("inductor_peak_mb", math.inf)),
            "rows_inductor_reused_from_another_eager": sorted(
                r["model"] for r in timed if not 0.9 <= r.get("eager_over_reused_run", 1.0) <= 1.1),
        }
    return out


def save(rows, path, here):
    if path:
        pathlib.Path(path).write_text(json.dumps({"machine": here, "rows": rows, "summary": summary(rows)}, indent=1))


def row_key(r):
    return r["model"], r["mode"], r["dtype"]


def merge(paths, key=row_key, tool="suite"):
    """The rows of several runs (a later file's row replaces an earlier one's, rows matched by
    `key`), one machine's."""
    rows, here = {}, None
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        if here is not None and d["machine"] != here:
            sys.exit(f"{tool}: {p} is from {d['machine']}, the others from {here}")
        here = d["machine"]
        rows.update({key(r): r for r in d["rows"]})
    return list(rows.values()), here


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows):
    print(f"\n{'model':26} {'mode':5} {'dt':4} {'ok':3} {'eager':>8} {'fuselens':>8} {'inductor':>8} {'fl/ind':>6} "
          f"{'1st fl':>6} {'1st ind':>7} {'g/b':>6} {'gpu fl/ind':>12}")
    for r in rows:
        ratio = r["fuselens_ms"] / r["inductor_ms"] if r.get("fuselens_ms") and r.get("inductor_ms") else None
        print(f"{r['model']:26} {r['mode']:5} {r['dtype']:4} {'yes' if r.get('ok') else 'NO':3} "
              f"{fmt(r.get('eager_ms'), '8.2f')} {fmt(r.get('fuselens_ms'), '8.2f')} {fmt(r.get('inductor_ms'), '8.2f')} "
              f"{fmt(ratio, '6.2f')} {fmt(r.get('fuselens_first_s'), '6.1f')} {fmt(r.get('inductor_first_s'), '7.1f')} "
              f"{r.get('graphs', '-')}/{r.get('breaks', '-'):<4} "
              f"{fmt(r.get('fuselens_gpu_ms'), '5.1f')}/{fmt(r.get('inductor_gpu_ms'), '<6.1f')}")
        if r.get("why"):
            print(f"{'':32} {r['why'][:160]}")
    for mode, s in summary(rows).items():
        print(f"{mode}: {s['passed']}/{s['rows']} pass; fuselens over eager {s['fuselens_speedup_geomean_every_row']} "
              f"(every row); on the {s['rows_with_inductor']} rows with Inductor's: speedup over eager fuselens "
              f"{s['fuselens_speedup_geomean']}, Inductor {s['inductor_speedup_geomean']}; fuselens/Inductor "
              f"{s['fuselens_over_inductor_geomean']}; first call fuselens/Inductor "
              f"{s['first_call_fuselens_over_inductor_geomean']} (Inductor's compiled in parallel: "
              f"{s['first_call_fuselens_over_inductor_geomean_compiled_in_parallel']}); slower than eager: {', '.join(s['rows_slower_than_eager']) or 'none'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="models, comma-separated (--list names them)")
    ap.add_argument("--suite", choices=("hf", "timm", "torchvision", "own"))
    ap.add_argument("--mode", choices=("train", "infer"))
    ap.add_argument("--part", help="k/n: every n-th row from the k-th (a run fits the GPU machine's 10 minutes)")
    ap.add_argument("--inductor-from", help="a suite JSON of the same GPU and torch: Inductor's rows taken from it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, help="override every row's batch size (a smoke test)")
    ap.add_argument("--no-inductor", action="store_true",
                    help="eager and fuselens only (a pass over many rows that finds failures; Inductor's columns "
                         "from --inductor-from where given)")
    ap.add_argument("--json", help="write the rows and summary here (after every row)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows --json already holds and run only the others (a run cut by a time "
                         "limit, or by a row that left the GPU unusable)")
    ap.add_argument("--merge", nargs="+", help="merge these runs' JSON into --json")
    ap.add_argument("--warm-inductor", type=int, metavar="N",
                    help="compile the rows' Inductor steps in N processes at once first (its disk caches then "
                         "serve the timed rows; their cold first calls are measured N at a time)")
    ap.add_argument("--warm-row", help=argparse.SUPPRESS)  # (name:mode:dtype: one of --warm-inductor's processes)
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.warm_row:
        torch.backends.cuda.matmul.allow_tf32 = False
        print(inductor_first_step(*a.warm_row.split(":"), a.device, a.batch))
        return
    if a.list:
        for name, mode, dtype in rows_of(a):
            print(name, mode, dtype, MODELS[name].suite)
        return
    if a.merge:
        rows, here = merge(a.merge)
        save(rows, a.json, here)
        print_table(rows)
        return
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 rows as eager's default
    here = machine()
    reuse = inductor_rows(a.inductor_from, here)
    caches = tempfile.TemporaryDirectory(prefix="fl-suite-")
    empty_disk_caches(caches.name)
    rows = json.loads(pathlib.Path(a.json).read_text())["rows"] if a.resume and a.json and \
        pathlib.Path(a.json).exists() else []
    done = {row_key(r) for r in rows}
    todo = [k for k in rows_of(a) if k not in done]
    warmed = warm_inductor([k for k in todo if k not in reuse], a.warm_inductor, a) \
        if a.warm_inductor and not a.no_inductor else {}
    for name, mode, dtype in todo:
        key = (name, mode, dtype)
        compilers = COMPILERS[:2] if key in reuse or a.no_inductor else COMPILERS
        print(f"[suite] {name} {mode} {dtype}", flush=True)
        t = time.perf_counter()
        try:
            row = measure(name, mode, dtype, a.device, compilers, a.batch)
        except Exception as e:  # noqa: BLE001 (a row that cannot be built or run says why; the others go on)
            traceback.print_exc()
            row = {"model": name, "suite": MODELS[name].suite, "mode": mode, "dtype": dtype, "ok": False,
                   # (the first line of a CUDA error; its note names the wrapper line fuselens's run raised at)
                   "why": f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0]} "
                          f"{' '.join(getattr(e, '__notes__', ()))}"[:800]}
        if warmed.get(key) and "inductor_first_s" in row:  # (this run's compile read the warm caches)
            row["inductor_first_warm_s"], row["inductor_first_s"] = row["inductor_first_s"], warmed[key]
            row["inductor_first_parallel"] = a.warm_inductor
        if key in reuse:
            row.update({k: reuse[key][k] for k in INDUCTOR_KEYS if k in reuse[key]}, inductor_reused=True)
            # Inductor's time is comparable only where eager's is as it was then (a busy GPU or host
            # moved a whole run 2x): the ratio says how far this run's eager is from that run's
            if row.get("eager_ms") and reuse[key].get("eager_ms"):
                row["eager_over_reused_run"] = round(row["eager_ms"] / reuse[key]["eager_ms"], 3)
                if not 0.9 <= row["eager_over_reused_run"] <= 1.1:
                    print(f"[suite] {name} {mode}: eager {row['eager_ms']} ms here, {reuse[key]['eager_ms']} ms in the "
                          "run Inductor's row is taken from: its ratio to Inductor is not comparable", flush=True)
        row["row_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        save(rows, a.json, here)
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 (a kernel's fault leaves the CUDA context unusable)
                print_table(rows)
                sys.exit(f"suite: the GPU is unusable after {name} {mode} {dtype} ({type(e).__name__}): the rows "
                         f"so far are in {a.json}; run the rest in a new process with --resume")
    print_table(rows)


if __name__ == "__main__":
    main()
