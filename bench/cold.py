"""One cold first call (run it in a fresh process with empty caches: bench/run.py does):
prints {"seconds": ..., "own_seconds": ...}; own = everything but Triton compiling kernels.

    python bench/cold.py NAME fuselens|torch.compile [--profile]   (cProfile to stderr)"""
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workloads import workloads  # noqa: E402


def main(name, compiler):
    w = next(w for w in workloads() if w.name == name)
    inputs = w.make_inputs()
    torch.cuda.synchronize()
    if compiler == "fuselens":
        import fuselens
        from fuselens import stats
        fn = fuselens.compile(w.fn)
    else:
        fn = torch.compile(w.fn)
    profile = "--profile" in sys.argv
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    out = fn(*inputs)
    if w.backward:
        out.sum().backward()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if profile:
        import pstats
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
    res = {"seconds": seconds}
    if compiler == "fuselens":
        res["own_seconds"] = seconds - stats.triton_compile_seconds()
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
