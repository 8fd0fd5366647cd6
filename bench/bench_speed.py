"""Issue 18's speed table (run through bench/models.py --speed / --cold / --profile / --merge):
six real-model workloads (published configs, random weights, dropout off), eager vs fuselens vs
torch.compile (Inductor), in default and reduce-overhead modes.

Step times are medians of triton.testing.do_bench in ROUNDS rounds that alternate the compilers (the
median round is kept, each round's time is in the JSON: a GPU's clock drifts within a run, and a
compiled model's first round ran up to 1.5x its later ones on an H200, bench/NOTES.md 58). Per
compiler also: kernels launched per step and their GPU time (torch.profiler), host time of one step
started on an idle GPU (until the call returns, launches queued), peak GPU memory of a training step
above what the model holds, and the largest error against eager, max|got - want| / max|want| over
the outputs (and the parameters' gradients on training rows). First calls (--cold): each compiler in
a fresh process with empty caches (Triton's, Inductor's, fuselens's), then a second process on the
same caches (warm); fuselens's own part is the first call less the time Triton compiled its kernels;
a warm call is split into capture, loading programs from the cache and the rest (first runs);
eager's first step in a fresh process is the floor both compilers stand on."""
from __future__ import annotations

import contextlib
import copy
import cProfile
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

import fuselens
from run import ROUNDS, busy_ms, exclusive_us, in_rounds, median  # (bench/ is on sys.path: models.py runs this module)

HERE = pathlib.Path(__file__).resolve().parent


@dataclass
class Workload:
    name: str
    build: object       # () -> (model, args, kwargs) on the CPU
    train: bool = False
    autocast: bool = False  # bf16 autocast in the forward


def resnet50(batch):
    import torchvision
    return torchvision.models.resnet50(), (torch.randn(batch, 3, 224, 224),), {}


def bert():
    import transformers as T
    return T.BertModel(T.BertConfig()), (), {"input_ids": torch.randint(0, 30522, (32, 128))}


def gpt2():
    import transformers as T
    from models import no_dropout_config
    ids = torch.randint(0, 50257, (8, 512))
    return T.GPT2LMHeadModel(no_dropout_config(T.GPT2Config(use_cache=False))), (), {"input_ids": ids, "labels": ids}


def vit():
    import timm
    return timm.create_model("vit_base_patch16_224", pretrained=False), (torch.randn(32, 3, 224, 224),), {}


def llama():
    import transformers as T
    cfg = T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, use_cache=False)
    return T.LlamaForCausalLM(cfg).to(torch.bfloat16), (), {"input_ids": torch.randint(0, 32000, (4, 512))}


WORKLOADS = [
    Workload("resnet50_fp32_infer", lambda: resnet50(32)),
    Workload("bert_base_fp32_infer", bert),
    Workload("gpt2_bf16_train", gpt2, train=True, autocast=True),
    Workload("vit_b16_bf16_infer", vit, autocast=True),
    Workload("llama_2048x8_bf16_infer", llama),
    Workload("resnet50_bf16_train", lambda: resnet50(32), train=True, autocast=True),
]


def workload(name):
    return next(w for w in WORKLOADS if w.name == name)


class Autocast(torch.nn.Module):
    """The model's forward under bf16 autocast, entered inside the compiled code (as
    accelerate wraps a model's forward). fuselens's capture applies an autocast entered inside
    what it compiles; one entered around the compiled call is not seen (its graph then runs in
    fp32: bench/NOTES.md, issue 18)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *args, **kwargs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.m(*args, **kwargs)


def setup(w, device="cuda"):
    """The eager model (seeded), its inputs on the GPU."""
    from models import no_dropout, to
    torch.manual_seed(0)
    m, args, kwargs = w.build()
    m = m.to(device).train(w.train)
    no_dropout(m)
    return (Autocast(m) if w.autocast else m), to(args, device), to(kwargs, device)


def make_step(model, w, args, kwargs, mark_step=False):
    """One step: inference under no_grad, or forward + backward (the loss when the model returns
    one, else a fixed random gradient of its first output), gradients reset each step.
    `mark_step`: torch.compile's CUDA graphs (reduce-overhead) start a new iteration."""
    from models import outputs
    params = [p for p in model.parameters() if p.requires_grad]
    grad_out = []

    def run():
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        if not w.train:
            with torch.no_grad():
                return outputs(model(*args, **kwargs))
        for p in params:
            p.grad = None
        outs = outputs(model(*args, **kwargs))
        if outs[0].dim() == 0:
            outs[0].backward()
        else:
            if not grad_out:
                grad_out.append(torch.randn_like(outs[0]))
            outs[0].backward(grad_out[0])
        return outs
    return run


def compiled(w, eager, compiler, mode="default"):
    """A deep copy of the eager model compiled (fuselens.compile compiles a module in place)."""
    m = copy.deepcopy(eager)
    if compiler == "eager":
        return m
    return fuselens.compile(m, mode=mode) if compiler == "fuselens" else torch.compile(m, mode=mode)


def results(model, run, w):
    """(outputs, gradients) of one step, copied."""
    outs = [o.detach().clone() for o in run()]
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None] if w.train else []
    return outs, grads


def max_error(got, want) -> float:
    """max|got - want| / max|want| over each output and gradient; a gradient's max|want| taken as
    at least 1e-3 of the largest gradient's (a gradient that is zero in exact arithmetic, or
    nearly, is rounding noise in both; the committed H100 run, without this floor, gave ResNet-50's
    bf16 training step 2.0 for fuselens and Inductor alike: not re-measured since)."""
    if len(got[0]) != len(want[0]) or len(got[1]) != len(want[1]):
        return float("inf")
    floor = 1e-3 * max([b.float().abs().max().item() for b in want[1]] or [0.0])
    errs = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got[0], want[0])]
    errs += [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(max(floor, 1e-30))).item()
             for a, b in zip(got[1], want[1])]
    return max(errs, default=0.0)


def do_bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def profile(call, steps=3):
    from torch.profiler import ProfilerActivity, profile as prof_
    call()
    torch.cuda.synchronize()
    with prof_(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    return prof


def gpu_events(prof):
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def launches(call, steps=3) -> tuple[float, float]:
    """(GPU activities per step: kernels, copies and fills; the GPU's busy milliseconds per step)."""
    ev = gpu_events(profile(call, steps))
    return len(ev) / steps, busy_ms(ev) / steps


def host_ms(call, n=7) -> float:
    """Median host milliseconds of one step started on an idle GPU (until the call returns)."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e3


def peak_mb(call) -> float:
    """Peak GPU memory of one step above what was allocated before it (MB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def measure(w, compilers, ro=True) -> dict:
    torch._dynamo.reset()
    eager, args, kwargs = setup(w)
    row = {"workload": w.name}
    compilers = ["eager"] + [c for c in compilers if c != "eager"]  # (eager's results: the reference)
    variants = [(c, c, "default") for c in compilers]
    if ro:
        variants += [(f"{c}_ro", c, "reduce-overhead") for c in compilers if c != "eager"]
    models, steps = {}, {}
    for key, compiler, mode in variants:
        models[key] = compiled(w, eager, compiler, mode)
        steps[key] = make_step(models[key], w, args, kwargs, mark_step=key == "inductor_ro")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = time.perf_counter()
            steps[key]()
            torch.cuda.synchronize()
            row[f"{key}_first_call_in_process_s"] = time.perf_counter() - t
        if compiler == "fuselens":  # a graph run eagerly instead (fuselens says why)
            row[f"{key}_fallbacks"] = sorted({str(m.message)[:200] for m in caught
                                              if m.category is fuselens.FuselensWarning})[:5]
        for _ in range(3 if not key.endswith("_ro") else 6):  # recordings, replay-or-launch trials
            steps[key]()
        torch.cuda.synchronize()
    want = results(models["eager"], steps["eager"], w)
    for key in steps:
        if key != "eager":
            row[f"{key}_max_err"] = max_error(results(models[key], steps[key], w), want)
    for key, ms in in_rounds(steps, do_bench).items():
        row[f"{key}_ms"], row[f"{key}_rounds_ms"] = median(ms), ms
    for key in compilers:
        row[f"{key}_launches"], row[f"{key}_kernel_ms"] = launches(steps[key])
        row[f"{key}_host_ms"] = host_ms(steps[key])
        if w.train:
            row[f"{key}_peak_mb"] = peak_mb(steps[key])
    try:
        with torch.no_grad() if not w.train else contextlib.nullcontext():
            ex = fuselens.explain(copy.deepcopy(eager), *args, **kwargs)
    except Exception as e:  # noqa: BLE001 (capture failed: fuselens ran the model eagerly)
        row["explain_error"] = f"{type(e).__name__}: {e}"[:300]
        return row
    row["graphs"], row["breaks"] = len(ex.graphs), len(ex.graph_breaks)
    row["break_details"] = sorted({f"{b.code} {b.filename.split('/')[-1]}:{b.line} {b.detail[:100]}"
                                   for b in ex.graph_breaks})[:8]
    return row


# ---- first calls in fresh processes

def first_call(name, compiler):
    """In this (fresh) process: build, then time the compiled model's first step."""
    w = workload(name)
    eager, args, kwargs = setup(w)
    torch.cuda.synchronize()
    m = eager if compiler == "eager" else \
        fuselens.compile(eager) if compiler == "fuselens" else torch.compile(eager)
    run = make_step(m, w, args, kwargs)
    profile = os.environ.get("FL_BENCH_PROFILE")  # a path: the step under cProfile, its stats written there
    profiler = cProfile.Profile() if profile else contextlib.nullcontext()
    t = time.perf_counter()
    with profiler:
        run()
        torch.cuda.synchronize()
    res = {"seconds": time.perf_counter() - t}
    if profile:
        profiler.dump_stats(profile)
    if compiler == "fuselens":
        from fuselens import stats
        res["own_seconds"] = res["seconds"] - stats.triton_compile_seconds()
        res["backend"] = dict(stats.backend)  # graphs compiled vs loaded from the program cache
        res["capture_s"] = stats.capture["seconds"]
        res["captures_kept"] = stats.capture["kept"]  # taken from the first process (capture_cache.py)
        res["triton_s"] = stats.triton_compile_seconds()
    print(json.dumps(res))


def byte_compile():
    """Write the .pyc files of the packages the workloads import, as pip does when it installs them:
    a machine whose packages have none (installed with PYTHONDONTWRITEBYTECODE=1, as the GPU
    machine's are) compiles every module from source in every process, and the first process of
    a run would pay for writing them (0.5-1 s more of eager's first step there)."""
    import importlib.util
    dirs = []
    for name in ("torch", "triton", "sympy", "networkx", "numpy", "transformers", "timm", "torchvision", "fuselens"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += list(spec.submodule_search_locations)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs], capture_output=True)
    print(f"byte-compiled {len(dirs)} packages in {time.perf_counter() - t:.1f} s", flush=True)


def fresh_process(name, compiler, cache, profile=None):
    env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
               FUSELENS_CACHE_DIR=f"{cache}/fuselens")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (byte_compile: every process reads .pyc files)
    if profile:
        env["FL_BENCH_PROFILE"] = profile
    out = subprocess.run([sys.executable, str(HERE / "models.py"), "--first-call", name, compiler], env=env,
                         capture_output=True, text=True, timeout=590)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold(w, keep=None, compilers=("eager", "fuselens", "inductor"), profile_dir=None) -> dict:
    """Each compiler's first step in a fresh process on empty caches, then in a second process on
    the caches the first filled; eager's first step in a fresh process is the floor of both (CUDA
    libraries' start-up, lazy imports, the allocator growing). `keep`: a folder the filled caches
    are merged into, for a `--speed` run after this one to start on (it times steps, not compiles).
    `compilers`: which of eager, fuselens and Inductor to run (rows of several runs merge).
    `profile_dir`: one more process each, eager's first step and each compiler's warm one under
    cProfile (its stats in `<workload>-<compiler>.prof` there; the table's times are unprofiled)."""
    row = {"workload": w.name}
    prof = (lambda c: os.path.join(profile_dir, f"{w.name}-{c}.prof")) if profile_dir else None
    if "eager" in compilers:
        with tempfile.TemporaryDirectory() as d:
            row["eager_first"] = fresh_process(w.name, "eager", d)
            if prof:
                row["eager_first_profiled"] = fresh_process(w.name, "eager", d, prof("eager"))
        print(json.dumps(row), flush=True)
    for compiler in [c for c in ("fuselens", "inductor") if c in compilers]:
        with tempfile.TemporaryDirectory() as d:
            row[f"{compiler}_cold"] = fresh_process(w.name, compiler, d)
            row[f"{compiler}_warm"] = fresh_process(w.name, compiler, d)
            if prof:
                row[f"{compiler}_warm_profiled"] = fresh_process(w.name, compiler, d, prof(compiler))
            if keep:
                shutil.copytree(d, keep, dirs_exist_ok=True)
        print(json.dumps(row), flush=True)
    return row


# ---- profile: kernel time by kernel

def kernel_bytes(m) -> dict:
    """Bytes fuselens's kernels move a step, by the name the profiler shows (the kernel's name
    without its index in the graph: kernels of one name add up; None where a size is dynamic)."""
    from fuselens.codegen.launcher import canonical
    names = {}
    for entry in fuselens.inspect(m):
        for graph in entry.graphs:
            for k in graph.kernels:
                name, _ = canonical(k.name, "")
                known = names.get(name, 0) is not None and k.bytes_moved is not None
                names[name] = names.get(name, 0) + k.bytes_moved if known else None
    return names


def profile_workload(name, compilers):
    w = workload(name)
    eager, args, kwargs = setup(w)
    for compiler in compilers:
        m = compiled(w, eager, compiler)
        run = make_step(m, w, args, kwargs)
        for _ in range(3):
            run()
        prof = profile(run, steps=3)
        ev = gpu_events(prof)
        print(f"== {name} {compiler}: {len(ev) / 3:.0f} GPU activities/step, "
              f"{busy_ms(ev) / 3:.3f} ms GPU-busy/step, host {host_ms(run):.2f} ms/step, "
              f"step {do_bench(run):.3f} ms")
        by = {}
        for e, us in zip(ev, exclusive_us(ev)):
            n, t = by.get(e.name, (0, 0.0))
            by[e.name] = (n + 1, t + us)
        moved = kernel_bytes(m) if compiler == "fuselens" else {}
        print(f"{'ms/step':>8} {'n/step':>6} {'GB/s':>6}  kernel (GB/s: fuselens's kernels, bytes of their arguments)")
        for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
            rate = f"{moved[k] * 3 / (t * 1e3):6.0f}" if moved.get(k) else f"{'':6}"
            print(f"{t / 3e3:8.3f} {n / 3:6.1f} {rate}  {k[:110]}")
        if compiler == "fuselens":  # where its host time goes
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(3):
                run()
                torch.cuda.synchronize()
            pr.disable()
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(28)
            print("\n".join(line[:150] for line in text.getvalue().splitlines()[:48]))


# ---- table

def fmt(v, f):
    return (f % v) if isinstance(v, (int, float)) else "-"


def print_table(result):
    print(f"\n{result.get('device')}, torch {result.get('torch')}; step ms (median of alternating rounds, "
          f"{ROUNDS} a run since session 28: a row's *_rounds_ms)")
    print(f"{'workload':26} {'eager':>7} {'fuselens':>8} {'induct':>7} {'fl/ind':>6} {'fl/eag':>6} {'fl RO':>7} "
          f"{'ind RO':>7} {'launch e/f/i':>14} {'host ms f/i':>11} {'err f/i':>15} {'g/b':>5} {'peak MB f/i/e':>16}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['workload']:26} ERROR {r['error'][:100]}")
            continue
        if "eager_ms" not in r:
            continue
        print(f"{r['workload'][:26]:26} {fmt(r.get('eager_ms'), '%7.2f')} {fmt(r.get('fuselens_ms'), '%8.2f')} "
              f"{fmt(r.get('inductor_ms'), '%7.2f')} {fmt(r['fuselens_ms'] / r.get('inductor_ms', float('nan')), '%6.2f')} "
              f"{fmt(r['fuselens_ms'] / r['eager_ms'], '%6.2f')} {fmt(r.get('fuselens_ro_ms'), '%7.2f')} "
              f"{fmt(r.get('inductor_ro_ms'), '%7.2f')} "
              f"{r.get('eager_launches', 0):4.0f}/{r.get('fuselens_launches', 0):4.0f}/{r.get('inductor_launches', 0):4.0f} "
              f"{fmt(r.get('fuselens_host_ms'), '%5.1f')}/{fmt(r.get('inductor_host_ms'), '%5.1f')} "
              f"{fmt(r.get('fuselens_max_err'), '%7.1e')}/{fmt(r.get('inductor_max_err'), '%7.1e')} "
              f"{r.get('graphs', '-')}/{r.get('breaks', '-')} "
              f"{fmt(r.get('fuselens_peak_mb'), '%5.0f')}/{fmt(r.get('inductor_peak_mb'), '%5.0f')}/"
              f"{fmt(r.get('eager_peak_mb'), '%4.0f')}")
    cold_rows = [r for r in result["rows"] if any(k in r for k in ("fuselens_cold", "inductor_cold", "eager_first"))]
    if cold_rows:
        print("\nfirst call s (fresh process; cold = empty caches, warm = a second process on them)")
        print(f"{'workload':26} {'fl cold':>8} {'(own)':>6} {'ind cold':>8} {'fl/ind':>6} {'fl warm':>8} "
              f"{'(capture':>8} {'kept':>4} {'load':>5} {'runs)':>5} {'ind warm':>8} {'eager':>6}")
        for r in cold_rows:
            fc, ic, fw, iw, e = (r.get(k, {}) for k in ("fuselens_cold", "inductor_cold", "fuselens_warm",
                                                          "inductor_warm", "eager_first"))
            ratio = fc["seconds"] / ic["seconds"] if "seconds" in fc and "seconds" in ic else None
            load = fw.get("backend", {}).get("cache_load_seconds")
            runs = fw["seconds"] - fw["capture_s"] - load if "capture_s" in fw and load is not None else None
            print(f"{r['workload'][:26]:26} {fmt(fc.get('seconds'), '%8.2f')} {fmt(fc.get('own_seconds'), '%6.2f')} "
                  f"{fmt(ic.get('seconds'), '%8.2f')} {fmt(ratio, '%6.2f')} {fmt(fw.get('seconds'), '%8.2f')} "
                  f"{fmt(fw.get('capture_s'), '%8.2f')} {fmt(fw.get('captures_kept'), '%4d')} {fmt(load, '%5.2f')} "
                  f"{fmt(runs, '%5.2f')} "
                  f"{fmt(iw.get('seconds'), '%8.2f')} {fmt(e.get('seconds'), '%6.2f')} "
                  f"{fc.get('error') or ic.get('error') or ''}")
    for r in result["rows"]:
        for b in r.get("break_details", []):
            print(f"{r['workload']}: break: {b}")
        for fb in r.get("fuselens_fallbacks", []):
            print(f"{r['workload']}: fuselens fallback: {fb}")
        if "explain_error" in r:
            print(f"{r['workload']}: explain: {r['explain_error'][:200]}")


def save(rows, path):
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": rows}
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(result, indent=1))
    return result


def merge(paths, out):
    parts = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    rows = {}
    for part in parts:
        for r in part["rows"]:
            rows.setdefault(r["workload"], {}).update(r)
    result = dict(parts[0], rows=list(rows.values()))
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=1))
    print_table(result)


def main(a):
    if a.first_call:
        return first_call(*a.first_call)
    if a.merge:
        return merge(a.merge, a.json)
    compilers = a.compilers.split(",")
    if a.profile:
        return profile_workload(a.profile, compilers)
    chosen = [workload(n) for n in a.workloads.split(",")] if a.workloads else WORKLOADS
    if a.cold:
        byte_compile()
    rows = []
    for w in chosen:
        try:
            row = cold(w, a.keep_caches, compilers, a.profile_first) if a.cold else \
                measure(w, compilers, ro=not a.no_ro)
        except Exception as e:  # noqa: BLE001 (one broken workload must not lose the others' numbers)
            import traceback
            traceback.print_exc()
            row = {"workload": w.name, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = save(rows, a.json)
    print_table(result)
