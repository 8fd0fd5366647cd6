"""The worker process for "Compile & benchmark": the only place where user code runs.

Started by the server as `python -m fuselens_lsp.worker` (one process per run, killed on time
limit or cancel). Reads one JSON job from stdin; writes JSON lines to its original stdout:
`{"type": "progress", "message": ...}` while working and one `{"type": "result", ...}` at the
end. Everything the user's code prints goes to stderr, which the server keeps for error reports.
"""
from __future__ import annotations

import contextlib
import json
import linecache
import math
import os
import re
import sys
import time
import traceback
import types

from . import examples
from .run_checks import cpu_kernels, eval_mode, modules_in, random_ops, time_cpu, use_cpp_kernels

_PROTO = None


def emit(obj: dict) -> None:
    _PROTO.write(json.dumps(obj, default=str) + "\n")
    _PROTO.flush()


def progress(message: str, percentage: int | None = None) -> None:
    emit({"type": "progress", "message": message, "percentage": percentage})


class UserError(Exception):
    """A problem the user can fix (no inputs, bad example comment, function not found)."""


class NoInputs(UserError):
    """None of the ways tried found example inputs."""


class _Recorded(BaseException):
    pass


# ------------------------------------------------------------------ loading the user's module

@contextlib.contextmanager
def passthrough_compile():
    """While the user's module runs to define functions or record inputs, `torch.compile` and
    `fuselens.compile` return what they are given: the raw function is what gets benchmarked."""
    import torch
    saved = []

    def fake(fn=None, *a, **kw):
        if fn is None:
            return lambda f: f
        return fn
    targets = [(torch, "compile")]
    try:
        import fuselens
        targets.append((fuselens, "compile"))
    except Exception:
        pass
    for mod, name in targets:
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, fake)
    try:
        yield
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)


def _module_for(path: str, source: str, name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = path
    mod.__builtins__ = __builtins__
    sys.modules[name] = mod
    # inspect.getsource (used by capture) must see the editor's text, saved or not
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    return mod


def _code_matches(code, path: str, name: str, def_line: int) -> bool:
    return (code.co_name == name and os.path.realpath(code.co_filename) == os.path.realpath(path)
            and code.co_firstlineno <= def_line and def_line - code.co_firstlineno <= 50)


def _record_calls(run, path: str, name: str, def_line: int):
    """Runs `run()` with a trace hook; stops at the first call of the target function and
    returns its arguments as (frame locals in parameter order, code)."""
    found = {}

    def tracer(frame, event, arg):
        if event == "call" and _code_matches(frame.f_code, path, name, def_line):
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount
            names = list(code.co_varnames[:n])
            if code.co_flags & 0x04:
                names.append(code.co_varnames[n])
                n += 1
            if code.co_flags & 0x08:
                names.append(code.co_varnames[n])
            found["locals"] = {k: frame.f_locals[k] for k in names if k in frame.f_locals}
            found["code"] = code
            found["names"] = names
            found["posonly"] = code.co_posonlyargcount
            found["argcount"] = code.co_argcount
            found["varargs"] = bool(code.co_flags & 0x04)
            found["varkw"] = bool(code.co_flags & 0x08)
            sys.settrace(None)
            raise _Recorded()
        return None
    sys.settrace(tracer)
    try:
        run()
    except _Recorded:
        pass
    finally:
        sys.settrace(None)
    return found or None


def _args_from_record(rec) -> tuple[list, dict]:
    loc = rec["locals"]
    names = rec["names"]
    args = [loc[n] for n in names[:rec["argcount"]]]
    kwargs = {}
    i = rec["argcount"]
    kwonly = [n for n in names[i:] if not (rec["varargs"] and n == names[i]) and not (rec["varkw"] and n == names[-1])]
    if rec["varargs"]:
        args += list(loc[names[i]])
    for n in kwonly:
        if n in loc:
            kwargs[n] = loc[n]
    if rec["varkw"]:
        kwargs.update(loc[names[-1]])
    return args, kwargs


def _detach_copy(v):
    import torch
    if isinstance(v, torch.Tensor):
        return v.detach().clone().requires_grad_(v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v)(_detach_copy(x) for x in v)
    if isinstance(v, dict):
        return {k: _detach_copy(x) for k, x in v.items()}
    return v


def resolve(ns: dict, qualname: str):
    parts = qualname.split(".")
    if "<locals>" in parts:
        raise UserError(f"`{qualname}` is defined inside another function; only module-level "
                        "functions and methods can be benchmarked")
    obj = ns.get(parts[0])
    if obj is None:
        raise UserError(f"`{parts[0]}` is not defined at module level")
    for p in parts[1:]:
        obj = getattr(obj, p)
    return _unwrap(obj)


def _unwrap(fn):
    for attr in ("_torchdynamo_orig_callable", "_orig_mod", "__wrapped__", "_fn"):
        inner = getattr(fn, attr, None)
        if inner is not None and callable(inner):
            fn = inner
    return fn


def find_inputs(job, device, log):
    """Returns (fn_callable, args, kwargs, how) — the function bound to its instance for
    methods — or raises UserError with the how-to."""
    path, source, qualname = job["path"], job["source"], job["qualname"]
    name = qualname.split(".")[-1]
    def_line = job["def_line"]
    is_method = "." in qualname and "<locals>" not in qualname
    tried = []
    for way in job.get("discovery", ["comment", "main", "pytest"]):
        if way == "comment":
            c = examples.find_example_comment(source, def_line)
            if c is None:
                tried.append("no `# fuselens: example(...)` comment above the function")
                continue
            line, text = c
            try:
                spec = examples.parse_example(text)
            except examples.ExampleSyntaxError as e:
                raise UserError(f"line {line}: {e}") from None
            ns = load_module(path, source, "__fuselens_user__")
            fn = resolve(ns, qualname)
            args, kwargs = examples.build(spec, device)
            if is_method:
                owner = resolve(ns, qualname.rsplit(".", 1)[0])
                try:
                    inst = owner()
                except Exception as e:
                    raise UserError(f"`{owner.__name__}()` failed ({e}); for methods of classes whose "
                                    "constructor needs arguments, record inputs from the "
                                    "`__main__` block or a test instead") from None
                if hasattr(inst, "to"):
                    inst = inst.to(device)
                # methods are compiled unbound, with the instance as their first argument
                # (fuselens guards a module argument by identity and `training`)
                args = [inst] + list(args)
            return fn, args, kwargs, f"comment on line {line}: {examples.describe(spec)}"
        if way == "main":
            if not re.search(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", source, re.M):
                tried.append("no `if __name__ == \"__main__\":` block in the file")
                continue
            progress("recording inputs from the __main__ block")
            ns_holder = {}

            def run():
                mod = _module_for(path, source, "__main__fuselens__")
                mod.__name__ = "__main__"
                ns_holder["ns"] = mod.__dict__
                code = compile(source, path, "exec")
                with passthrough_compile():
                    exec(code, mod.__dict__)
            rec = _record_calls(run, path, name, def_line)
            if rec is None:
                tried.append("the `__main__` block does not call the function")
                continue
            args, kwargs = _args_from_record(rec)
            args, kwargs = _detach_copy(args), _detach_copy(kwargs)
            fn = resolve(ns_holder["ns"], qualname)
            return fn, args, kwargs, "recorded from the __main__ block"
        if way == "pytest":
            for test_path, test_names in job.get("tests", []):
                for tname in test_names:
                    progress(f"recording inputs from {os.path.basename(test_path)}::{tname}")

                    def run(test_path=test_path, tname=tname):
                        with passthrough_compile():
                            tmod = load_file_module(test_path)
                            getattr(tmod, tname)()
                    try:
                        rec = _record_calls(run, path, name, def_line)
                    except Exception as e:
                        log(f"{test_path}::{tname} failed before calling `{name}`: {e!r}")
                        continue
                    if rec is None:
                        continue
                    args, kwargs = _args_from_record(rec)
                    args, kwargs = _detach_copy(args), _detach_copy(kwargs)
                    ns = load_module(path, source, "__fuselens_user__")
                    fn = resolve(ns, qualname)
                    return fn, args, kwargs, f"recorded from {os.path.basename(test_path)}::{tname}"
            tried.append("no pytest test in the workspace calls the function" if not job.get("tests")
                         else "the tests that mention the function did not call it")
    raise NoInputs("No example inputs for `" + qualname + "` (" + "; ".join(tried) + ").\n" + examples.HOW_TO)


def load_module(path, source, modname):
    mod = _module_for(path, source, modname)
    code = compile(source, path, "exec")
    with passthrough_compile():
        exec(code, mod.__dict__)
    return mod.__dict__


def load_file_module(path):
    import importlib.util
    d = os.path.dirname(os.path.abspath(path))
    if d not in sys.path:
        sys.path.insert(0, d)
    modname = "__fuselens_test_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ comparing and timing

def _flatten(v, out):
    import torch
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _flatten(x, out)
    elif isinstance(v, dict):
        for k in sorted(v, key=str):
            _flatten(v[k], out)
    else:
        out.append(v)
    return out


def compare(expected, actual) -> dict:
    import torch
    a, b = _flatten(expected, []), _flatten(actual, [])
    if len(a) != len(b):
        return {"ok": False, "message": f"eager returned {len(a)} values, fuselens {len(b)}"}
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return {"ok": False, "message": f"output {i}: eager gave {type(x).__name__}, fuselens {type(y).__name__}"}
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape:
                return {"ok": False, "message": f"output {i}: shape {tuple(x.shape)} in eager, {tuple(y.shape)} in fuselens"}
            if x.dtype != y.dtype:
                return {"ok": False, "message": f"output {i}: dtype {x.dtype} in eager, {y.dtype} in fuselens"}
            if x.numel() == 0:
                continue
            tol = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2)}.get(x.dtype, (1e-4, 1e-5))
            xf, yf = x.detach().double().cpu(), y.detach().double().cpu()
            if not torch.allclose(xf, yf, rtol=tol[0], atol=tol[1], equal_nan=True):
                err = (xf - yf).abs().nan_to_num(nan=math.inf).max().item()
                return {"ok": False, "message": f"output {i}: max abs difference {err:.3g} (rtol={tol[0]}, atol={tol[1]})", "maxAbsErr": err}
            if x.dtype.is_floating_point:
                worst = max(worst, (xf - yf).abs().nan_to_num(nan=0.0).max().item())
        elif x != y and not (isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=1e-5)):
            return {"ok": False, "message": f"output {i}: {x!r} in eager, {y!r} in fuselens"}
    return {"ok": True, "message": f"matches eager (max abs difference {worst:.3g})", "maxAbsErr": worst}


def time_cuda(fn, args, kwargs, budget_s=0.5) -> float:
    """Median milliseconds per call, CUDA events, after warm-up."""
    import torch
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 200):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(*args, **kwargs)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def kernel_times_cuda(fn, args, kwargs) -> tuple[dict, float]:
    """Device time per kernel name (ms per call) and the total, from the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    n = 10
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
    per, total = {}, 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            per[ev.key] = per.get(ev.key, 0.0) + t / 1000.0 / n
            total += t / 1000.0 / n
    return per, total


# ------------------------------------------------------------------ describing what fuselens made
# Only `fuselens.inspect`'s plain data is read here (never the runtime's objects).

def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def kernel_provenance(kernel, path, source: str = "") -> list[dict]:
    """For each kernel source line that came from the user's file: {kernelLine, line, col,
    endLine, endCol} (0-based), the source line's non-blank extent."""
    src_lines = source.split("\n") if source else []
    out = []
    for p in kernel.provenance:
        if not _same_file(p.filename, path):
            continue
        text = src_lines[p.line - 1] if 0 < p.line <= len(src_lines) else ""
        start = len(text) - len(text.lstrip())
        out.append({"kernelLine": p.kernel_line, "line": p.line - 1, "col": start, "endLine": p.line - 1,
                    "endCol": len(text)})
    return out


def kernel_json(k, path, source="") -> dict:
    return {"name": k.name, "source": k.source, "language": k.language,
            "provenance": kernel_provenance(k, path, source),
            "sourceLines": sorted({line - 1 for f, line in k.source_lines if _same_file(f, path)}),
            "bytes": k.bytes_moved, "timeMs": None, "share": None, "bandwidthGBs": None}


def describe_compiled(compiled, path, source="") -> dict:
    import fuselens
    entries = fuselens.inspect(compiled)
    graphs = []
    for entry in entries:
        for g in entry.graphs:
            kjs = [kernel_json(k, path, source) for k in g.kernels]
            if len(kjs) == 1 and kjs[0]["bytes"] is None:  # dynamic sizes: the graph's own I/O
                kjs[0]["bytes"] = g.io_bytes
            graphs.append({"index": len(graphs), "ir": g.ir, "nodeCount": g.op_count, "kernels": kjs,
                           "wrapper": g.wrapper, "function": entry.function})
    return {"graphs": graphs, "transformedSource": "\n\n".join(e.source for e in entries if e.source),
            "guards": [g.reason for e in entries for g in e.guards], "entries": len(entries)}


def recompiles_json(compiled) -> dict:
    """What the run's calls recompiled (the timing loop calls the function again and again: a
    guard that fails on every call, a counter read as a constant, shows here) and whether the
    recompile limit stopped compiling it (`fuselens.explain` of the compiled function)."""
    import fuselens
    ex = fuselens.explain(compiled)
    return {"recompiles": [{"function": f, "because": because, "dynamicDims": {k: list(v) for k, v in dims.items()},
                            "text": text} for (f, because, dims), text in zip(ex.recompiles, ex.recompile_lines())],
            "recompileLimit": ex.disabled}


def break_json(b) -> dict:
    """A break the concrete capture found, with its file (it may be in a callee's file) and the
    calls that led there, for the server to publish where it occurs."""
    return {"code": b.code, "title": b.title, "filename": os.path.realpath(b.filename) if b.filename else None,
            "line": b.line - 1, "col": b.col, "endLine": (b.end_line or b.line) - 1, "endCol": b.end_col,
            "explanation": b.explanation, "hint": b.hint, "docUrl": b.doc_url, "torchCode": b.torch_code,
            "function": b.function,
            "stack": [{"function": f.function, "filename": os.path.realpath(f.filename) if f.filename else None,
                       "line": f.line - 1, "col": f.col, "endLine": (f.end_line or f.line) - 1, "endCol": f.end_col}
                      for f in b.stack]}


def _check_random(fn, args, kwargs, plain_check: dict) -> dict:
    """A failed check, explained when random ops make eager and fuselens differ by design:
    checked again with the call's modules in eval mode where that removes them (compiled on its
    own: eval mode would be a recompile of the run's function, reported as the user's)."""
    import torch
    import fuselens
    ops = random_ops(lambda: fn(*_detach_copy(args), **_detach_copy(kwargs)))
    if not ops:
        return plain_check
    why = (f"differs from eager through random ops ({', '.join(ops)}): a compiled graph draws its "
           f"random numbers its own way, so train-mode outputs cannot match ({plain_check['message']})")
    with eval_mode(modules_in(fn, args, kwargs)):
        left = random_ops(lambda: fn(*_detach_copy(args), **_detach_copy(kwargs)))
        if left:
            return {"ok": False, "randomOps": ops, "maxAbsErr": plain_check.get("maxAbsErr"),
                    "message": why + f"; in eval mode random ops remain ({', '.join(left)}): not comparable"}
        torch.manual_seed(0)
        expected = fn(*_detach_copy(args), **_detach_copy(kwargs))
        torch.manual_seed(0)
        again = compare(expected, fuselens.compile(fn)(*_detach_copy(args), **_detach_copy(kwargs)))
    return {**again, "randomOps": ops, "evalMode": True,
            "message": why + f"; in eval mode (no random ops) it {again['message']}"}


# ------------------------------------------------------------------ the job

def run_job(job: dict) -> dict:
    t0 = time.perf_counter()
    logs = []

    def log(msg):
        logs.append(msg)
        print(msg, file=sys.stderr)

    progress("importing torch")
    import torch
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if not gpu:
        # kernels run (and are checked) in Triton's interpreter on CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("FUSELENS_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(job["path"])))
    for root in job.get("roots", []):
        if root not in sys.path:
            sys.path.insert(1, root)
    import fuselens
    # no GPU: the CPU's C++ kernels are what runs, is checked and is shown (Triton's kernels, in
    # its interpreter, where there is no C++ compiler)
    cpp = not gpu and use_cpp_kernels()

    progress("finding example inputs")
    fn, args, kwargs, how = find_inputs(job, device, log)
    result = {"ok": True, "qualname": job["qualname"], "inputs": how, "device": device,
              "gpu": torch.cuda.get_device_name() if gpu else None}

    progress("running eagerly", 10)
    torch.manual_seed(0)
    expected = fn(*_detach_copy(args), **_detach_copy(kwargs))

    progress("capturing (fuselens.explain)", 25)
    expl = fuselens.explain(fn, *_detach_copy(args), **_detach_copy(kwargs))
    result["graphCount"] = len(expl.graphs)
    result["breaks"] = [break_json(b) for b in expl.graph_breaks]
    result["explanation"] = str(expl)

    progress("compiling with fuselens" + ("" if gpu else " (C++ kernels: no GPU)" if cpp else
                                           " (Triton interpreter: no GPU, no C++ compiler)"), 40)
    compiled = fuselens.compile(fn)
    torch.manual_seed(0)
    actual = compiled(*_detach_copy(args), **_detach_copy(kwargs))
    result["check"] = compare(expected, actual)
    # (described before any check in eval mode adds a specialization of its own)
    result.update(describe_compiled(compiled, job["path"], job["source"]))
    if not result["check"]["ok"]:
        result["check"] = _check_random(fn, args, kwargs, result["check"])
    kernels = [k for g in result["graphs"] for k in g["kernels"]]

    timings = {"eager": None, "fuselens": None, "torchCompile": None, "torchCompileError": None}
    if gpu:
        progress("timing eager", 60)
        timings["eager"] = time_cuda(fn, args, kwargs)
        progress("timing fuselens", 70)
        timings["fuselens"] = time_cuda(compiled, args, kwargs)
        progress("timing torch.compile", 80)
        try:
            tc = torch.compile(fn)
            got = tc(*_detach_copy(args), **_detach_copy(kwargs))
            ok = compare(expected, got)
            if not ok["ok"]:
                raise RuntimeError("torch.compile result differs from eager: " + ok["message"])
            timings["torchCompile"] = time_cuda(tc, args, kwargs)
        except Exception as e:
            timings["torchCompileError"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        progress("profiling kernels", 90)
        try:
            per, total = kernel_times_cuda(compiled, args, kwargs)
            for k in kernels:
                t = per.get(k["name"])
                if t is None:
                    t = next((v for n, v in per.items() if n.startswith(k["name"])), None)
                if t is not None:
                    k["timeMs"] = t
                    k["share"] = t / total if total else None
                    if k["bytes"]:
                        k["bandwidthGBs"] = k["bytes"] / (t / 1000.0) / 1e9
            result["deviceTotalMs"] = total
        except Exception as e:
            log(f"kernel profiling failed: {e!r}")
        result["timingNote"] = None
    else:
        progress("timing eager on the CPU (no GPU)", 60)
        timings["eager"] = time_cpu(fn, args, kwargs)
        with cpu_kernels() as kernels:
            progress("timing fuselens's C++ kernels" if kernels.cpp else "timing fuselens's graphs as plain PyTorch", 70)
            timings["fuselens"] = time_cpu(compiled if cpp else fuselens.compile(fn), args, kwargs)
        progress("timing torch.compile on the CPU", 80)
        try:
            if os.environ.get("FUSELENS_BENCH_TORCH_COMPILE", "1") == "0":
                raise RuntimeError("not timed (FUSELENS_BENCH_TORCH_COMPILE=0)")
            tc = torch.compile(fn)
            ok = compare(expected, tc(*_detach_copy(args), **_detach_copy(kwargs)))
            if not ok["ok"] and not result["check"].get("randomOps"):
                raise RuntimeError("torch.compile result differs from eager: " + ok["message"])
            timings["torchCompile"] = time_cpu(tc, args, kwargs)
        except Exception as e:
            timings["torchCompileError"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        timings["cpu"] = True
        timings["cpuKernels"] = "cpp" if kernels.cpp else "plain PyTorch"
        result["timingNote"] = (
            "No GPU: times on the CPU, where fuselens's graphs ran as its C++ kernels (shown and checked "
            "against eager; its Triton kernels need a GPU)" if kernels.cpp else
            "No GPU: times on the CPU, where fuselens's graphs ran as plain PyTorch (no C++ compiler for its "
            "CPU kernels: install g++ or clang; its Triton kernels need a GPU; they were checked in Triton's "
            "interpreter), so they show what the graph breaks cost, not the kernels' speed")
    result["timings"] = timings
    result.update(recompiles_json(compiled))
    if gpu and timings["eager"] and timings["fuselens"]:
        result["speedup"] = timings["eager"] / timings["fuselens"]
    result["elapsedS"] = time.perf_counter() - t0
    result["log"] = logs[-20:]
    return result


def main() -> int:
    global _PROTO
    # Our protocol gets the real stdout; anything else printed (user code, libraries, C code)
    # goes to stderr.
    _PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        job = json.loads(sys.stdin.read())
    except Exception as e:
        emit({"type": "result", "ok": False, "error": f"bad job: {e}"})
        return 2
    try:
        res = run_job(job)
        emit({"type": "result", **res})
        return 0
    except UserError as e:
        emit({"type": "result", "ok": False, "userError": True, "noInputs": isinstance(e, NoInputs), "error": str(e)})
        return 0
    except BaseException as e:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        where = _user_frame(e, job.get("path"))
        emit({"type": "result", "ok": False, "userError": False,
              "error": f"{type(e).__name__}: {e}" + (f" (at {where})" if where else ""),
              "traceback": tb[-4000:]})
        return 1


def _user_frame(e, path):
    tb = e.__traceback__
    where = None
    while tb is not None:
        if path and os.path.realpath(tb.tb_frame.f_code.co_filename) == os.path.realpath(path):
            where = f"line {tb.tb_lineno}"
        tb = tb.tb_next
    return where


if __name__ == "__main__":
    sys.exit(main())
