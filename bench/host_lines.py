"""Where a real model's host time per step goes in fuselens (issue 18): every statement of its
programs' wrappers timed in place (a clock read after each one) and grouped by kind (kernel
launches, allocations, each extern function, layout checks), beside the step, the guard function
and the rest of the layers around the programs. Steps start on an idle GPU (synchronized before
each), so nothing waits for the GPU while fewer launches are queued than CUDA's queue holds.

    PYTHONPATH=compiler python bench/host_lines.py resnet50_fp32_infer [gpt2_bf16_train ...]
"""
from __future__ import annotations

import ast
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_speed  # noqa: E402

import fuselens  # noqa: E402


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def kind(stmt) -> str:
    """What a wrapper statement does, for grouping."""
    value = stmt.value if isinstance(stmt, (ast.Assign, ast.Expr)) else None
    if isinstance(stmt, ast.If):
        return "constant (first call only)"
    if isinstance(stmt, ast.Delete) or isinstance(value, ast.Name):
        return "del / reuse"
    if isinstance(stmt, ast.Return):
        return "return"
    if isinstance(value, ast.BoolOp):  # `k.launch(...) or k.run(...)`
        value = value.values[0]
    if isinstance(value, ast.Call):
        fn = ast.unparse(value.func)
        if fn.endswith((".run", ".launch")):
            return "kernel launch"
        if "empty" in fn:
            return "allocation"
        return f"extern {fn}"
    return "other"


class Timed:
    """A program whose wrapper is replaced by a copy that reads the clock after each statement."""

    def __init__(self, program, label):
        self.program, self.label = program, label
        module = ast.parse(program.wrapper_source)
        fn = next(f for f in module.body if f.name == "call")  # after make_constants, if any
        self.kinds = [kind(s) for s in fn.body]
        body = [ast.parse("__stamps.append(__clock())").body[0]]
        for s in fn.body:
            if isinstance(s, ast.Return):
                body.append(ast.parse("__stamps.append(__clock())").body[0])
            body.append(s)
            if not isinstance(s, ast.Return):
                body.append(ast.parse("__stamps.append(__clock())").body[0])
        fn.body = body
        self.stamps: list = []
        self.runs: list = []
        ns = dict(program.call.__globals__, __stamps=self.stamps, __clock=time.perf_counter)
        exec(compile(ast.fix_missing_locations(module), "<timed wrapper>", "exec"), ns)
        self.original, program.call = program.call, ns[fn.name]

    def collect(self):
        """Per statement durations of the calls since the last collect."""
        n = len(self.kinds) + 1
        s = self.stamps
        for k in range(0, len(s) - n + 1, n):
            self.runs.append([s[k + i + 1] - s[k + i] for i in range(n - 1)])
        s.clear()

    def restore(self):
        self.program.call = self.original

    def table(self):
        if not self.runs:  # a program compiled ahead for a layout the steps never gave it
            return 0.0
        by: dict = {}
        for i, k in enumerate(self.kinds):
            n, t = by.get(k, (0, 0.0))
            by[k] = (n + 1, t + median([r[i] for r in self.runs]))
        total = median([sum(r) for r in self.runs])
        print(f"  {self.label}: {len(self.kinds)} statements, {total * 1e3:.3f} ms a call (median)")
        for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            print(f"    {t * 1e3:7.3f} ms {n:5}x {t / n * 1e6:6.1f} us  {k}")
        return total


def programs(cm):
    """(label, Program) of every compiled graph of a fuselens-compiled module."""
    from fuselens.backend.driver import Program
    out = []
    for e in cm._fuselens_compiled.all_entries():
        for gc in e.graph_calls:
            for spec in gc.compiled._specializations.values():
                run = spec.run
                if isinstance(run, Program):
                    out.append((f"{gc.info.name} forward", run, gc.compiled))
                    continue
                import inspect
                state = inspect.getclosurevars(run).nonlocals.get("state")
                if state is not None:
                    out.append((f"{gc.info.name} forward (training)", state.forward, gc.compiled))
                    for p in state.backward.programs.values():
                        out.append((f"{gc.info.name} backward", p, gc.compiled))
                    for missing, variant in state.backward.variants.items():  # outputs the loss ignores
                        for p in variant.programs.values():
                            out.append((f"{gc.info.name} backward without tangents {sorted(missing)}", p,
                                        gc.compiled))
    return out


def main(names):
    for name in names:
        w = bench_speed.workload(name)
        eager, args, kwargs = bench_speed.setup(w)
        cm = bench_speed.compiled(w, eager, "fuselens")
        step = bench_speed.make_step(cm, w, args, kwargs)
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        host = bench_speed.host_ms(step, n=21)
        entry = cm._fuselens_compiled.entries[0]
        ctx = torch.no_grad() if not w.train else torch.enable_grad()
        guard = []
        with ctx:
            for _ in range(51):
                t = time.perf_counter()
                entry.guard_fn(cm._modules["_orig_mod"], *args, **kwargs)
                guard.append(time.perf_counter() - t)
        timed = [Timed(p, label) for label, p, _ in programs(cm)]
        for _, _, cg in programs(cm):
            cg._fast = None  # rebinds to the timed wrapper on the next call
        for _ in range(21):
            torch.cuda.synchronize()
            step()
            for t in timed:
                t.collect()
        torch.cuda.synchronize()
        print(f"\n== {name}: host {host:.3f} ms a step (median of 21, GPU idle at each start); "
              f"guard function {median(guard) * 1e3:.3f} ms; {len(cm._fuselens_compiled.all_entries())} entries")
        in_programs = sum(t.table() for t in timed)
        print(f"  the rest (guards, transformed function, autograd, the step's own Python): "
              f"{host - in_programs * 1e3:.3f} ms")
        for t in timed:
            t.restore()


if __name__ == "__main__":
    main(sys.argv[1:] or ["resnet50_fp32_infer"])
