"""Where the per-call host time of the overhead-bound 64x64 workload goes: each layer of
fuselens's call path timed back-to-back (one synchronize at the end), innermost first.

    PYTHONPATH=compiler python bench/overhead.py"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from run import host_time  # noqa: E402
from workloads import small_pointwise  # noqa: E402

import fuselens  # noqa: E402


def main():
    x, y = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    fl = fuselens.compile(small_pointwise)
    fl(x, y)
    gc = fl.entries[0].graph_calls[0]
    cg = gc.compiled
    prog = next(iter(cg._specializations.values())).run
    call = prog.call
    kname = cg.kernels[0].name
    kernel = call.__globals__[kname]
    out = torch.empty_like(x)
    fn = kernel.fn
    cfg = next(iter(kernel.best.values()))
    rows = [
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("triton fn[grid](...)", lambda: fn[(4,)](x, y, out, 4096, **cfg.kwargs())),
        ("TritonKernel.run", lambda: kernel.run(x, y, out, xnumel=4096)),
        ("wrapper call()", lambda: call(x, y)),
        ("Program", lambda: prog(x, y)),
        ("CompiledGraph", lambda: cg(x, y)),
        ("GraphCall", lambda: gc(x, y)),
        ("fuselens.compile(f)", lambda: fl(x, y)),
        ("eager", lambda: small_pointwise(x, y)),
    ]
    print(kernel.source)
    print(call.__globals__.get("__name__"), prog.wrapper_source)
    for name, f in rows:
        try:
            print(f"{name:24} {host_time(f, n=5000) * 1e6:7.2f} us/call", flush=True)
        except Exception as e:  # keep going: the table is the point
            print(f"{name:24} failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
