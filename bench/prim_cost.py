"""Host cost of the calls a training step's wrapper makes (back-to-back, the GPU kept busy), on
the main thread and on a second thread: what each line of a generated wrapper costs on this host.

    PYTHONPATH=compiler python bench/prim_cost.py"""
import pathlib
import sys
import threading

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from host_profile import busy_us  # noqa: E402


def per_call_us(fn):
    return busy_us(fn, n=400, rounds=7)


def main():
    d, bf = "cuda", torch.bfloat16
    x = torch.randn(64, 32, device=d, dtype=bf)
    w = torch.randn(48, 32, device=d, dtype=bf)
    b = torch.randn(48, device=d, dtype=bf)
    g = torch.randn(64, 48, device=d, dtype=bf)
    wt = w.t()
    rows = {
        "w.t()": lambda: w.t(),
        "torch.addmm(b, x, w.t())": lambda: torch.addmm(b, x, w.t()),
        "torch.addmm(b, x, wt) (view made ahead)": lambda: torch.addmm(b, x, wt),
        "F.linear(x, w, b)": lambda: F.linear(x, w, b),
        "torch.mm(g.t(), x)": lambda: torch.mm(g.t(), x),
        "torch.mm(g, w)": lambda: torch.mm(g, w),
        "torch.empty_strided": lambda: torch.empty_strided((64, 48), (48, 1), dtype=bf, device=x.device),
        "torch.empty_like": lambda: torch.empty_like(g),
        "g.view((3072,))": lambda: g.view((3072,)),
        "key of 6 tensors": lambda: tuple((t.shape, t.stride(), t.dtype) for t in (x, w, b, g, x, w)),
    }
    with torch.no_grad():
        main_us = {k: per_call_us(f) for k, f in rows.items()}
        other = {}
        t = threading.Thread(target=lambda: other.update({k: per_call_us(f) for k, f in rows.items()}))
        t.start()
        t.join()
    print(f"{'call':45} {'main':>8} {'thread':>8}  (us)")
    for k in rows:
        print(f"{k:45} {main_us[k]:8.2f} {other[k]:8.2f}")


if __name__ == "__main__":
    main()
