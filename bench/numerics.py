"""The numerics contract of fuselens's kernels on a GPU (docs/backend.md, Numerics), measured: for
each pointwise math primitive and float dtype, the largest error against a float64 reference of
eager's CUDA kernel and of fuselens's compiled kernel, in units in the last place of the dtype,
and the fraction of elements bit-equal to eager's. Inputs span each function's domain (2^22 of
them). Prints a table; `--json PATH` writes the rows.

    PYTHONPATH=compiler python bench/numerics.py --json bench/results/numerics-h200.json
"""
from __future__ import annotations

import argparse
import json

import torch

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def ulp_error(got, reference, dtype) -> float:
    """The largest error of `got` against a float64 `reference`, in units in the last place of
    `dtype` at the reference's value (where the reference is finite in `dtype`)."""
    ref, got = reference.double().cpu(), got.double().cpu()
    finite = torch.isfinite(ref) & torch.isfinite(ref.to(dtype).double())
    if not finite.any():
        return 0.0
    ref, got = ref[finite], got[finite]
    exponent = torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny)))
    return ((got - ref).abs() / torch.exp2(exponent - MANTISSA_BITS[dtype])).max().item()


OPS = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log1p": torch.log1p, "sqrt": torch.sqrt,
       "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
       "erf": torch.erf, "pow": torch.pow, "div": torch.div, "gelu": torch.nn.functional.gelu}
N = 1 << 22


def inputs(name, g):
    """float64 values in the op's domain: wide magnitudes where the function takes them."""
    def uniform(lo, hi):
        return torch.rand(N, generator=g, dtype=torch.float64) * (hi - lo) + lo

    def wide(lo, hi):  # magnitudes log-uniform in [2^lo, 2^hi), either sign
        return torch.exp2(uniform(lo, hi)) * torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).double()
    return {"exp": lambda: [uniform(-87, 88)], "exp2": lambda: [uniform(-125, 127)],
            "log": lambda: [wide(-60, 60).abs()], "log1p": lambda: [wide(-60, 60).abs()],
            "sqrt": lambda: [wide(-60, 60).abs()], "rsqrt": lambda: [wide(-60, 60).abs()],
            "sin": lambda: [uniform(-100, 100)], "cos": lambda: [uniform(-100, 100)],
            "tanh": lambda: [torch.randn(N, generator=g, dtype=torch.float64) * 4],
            "sigmoid": lambda: [torch.randn(N, generator=g, dtype=torch.float64) * 4],
            "erf": lambda: [torch.randn(N, generator=g, dtype=torch.float64) * 4],
            "gelu": lambda: [torch.randn(N, generator=g, dtype=torch.float64) * 4],
            "pow": lambda: [wide(-8, 8).abs(), uniform(-4, 4)],
            "div": lambda: [wide(-30, 30), wide(-30, 30)]}[name]()


def measure(device="cuda", ops=None):
    import fuselens
    rows = []
    for name, fn in OPS.items():
        if ops and name not in ops:
            continue
        g = torch.Generator().manual_seed(list(OPS).index(name))
        masters = inputs(name, g)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xs = [m.to(dtype) for m in masters]
            reference = fn(*[x.double() for x in xs])
            on = [x.to(device) for x in xs]
            eager = fn(*on)
            compiled = fuselens.compile(lambda *a, fn=fn: fn(*a))(*on)
            same = (compiled == eager) | (compiled.isnan() & eager.isnan())
            rows.append({"op": name, "dtype": str(dtype)[6:], "eager_ulp": round(ulp_error(eager, reference, dtype), 3),
                         "fuselens_ulp": round(ulp_error(compiled, reference, dtype), 3),
                         "bit_equal": round(same.double().mean().item(), 6)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--ops", help="these ops only, comma-separated")
    args = parser.parse_args()
    rows = measure(ops=args.ops.split(",") if args.ops else None)
    print(f"{'op':8} {'dtype':9} {'eager ulp':>9} {'fuselens ulp':>12} {'bit-equal':>9}")
    for r in rows:
        print(f"{r['op']:8} {r['dtype']:9} {r['eager_ulp']:9.3f} {r['fuselens_ulp']:12.3f} {r['bit_equal']:9.6f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
