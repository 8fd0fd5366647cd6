"""Cold and warm-process first-call seconds: for each workload and compiler, one fresh process
with empty caches (as bench/run.py's cold columns), then a second process with the same
FUSELENS_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR (what a restarted program pays).

    PYTHONPATH=compiler python bench/cold_warm.py NAME... [--compilers fuselens,torch.compile] [--cold-only]"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

COLD = pathlib.Path(__file__).parent / "cold.py"


def first_call(name, compiler, cache):
    env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
               FUSELENS_CACHE_DIR=f"{cache}/fuselens")
    out = subprocess.run([sys.executable, str(COLD), name, compiler], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--compilers", default="fuselens,torch.compile")
    ap.add_argument("--cold-only", action="store_true")
    args = ap.parse_args()
    print(f"{'workload':32} {'compiler':14} {'cold s':>7} {'(own)':>6} {'warm s':>7}", flush=True)
    for name in args.names:
        for compiler in args.compilers.split(","):
            with tempfile.TemporaryDirectory() as d:
                cold = first_call(name, compiler, d)
                warm = {} if args.cold_only else first_call(name, compiler, d)
            fmt = lambda r, k: f"{r[k]:.2f}" if k in r else "-"
            print(f"{name:32} {compiler:14} {fmt(cold, 'seconds'):>7} {fmt(cold, 'own_seconds'):>6} "
                  f"{fmt(warm, 'seconds'):>7} {cold.get('error') or warm.get('error') or ''}", flush=True)


if __name__ == "__main__":
    main()
