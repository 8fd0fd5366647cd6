"""Process-wide compile-time counters, so benchmarks can report fuselens's own compile time
apart from Triton's compilation of the kernel source, the program cache's part
(backend/program_cache.py) apart from the backend's, and capture's (every function and resume
function captured, guards included)."""
from __future__ import annotations

import contextlib
import gc
import time

_triton_seconds = 0.0
# the backend compiling a graph's programs (ops -> ... -> codegen) vs loading them from the program
# cache; backward_layouts: backward programs compiled at a backward call for a layout of its
# inputs not compiled ahead (their time is in `seconds`)
backend = {"compiles": 0, "seconds": 0.0, "cache_hits": 0, "cache_load_seconds": 0.0, "backward_layouts": 0}
# functions captured, and captures taken from an earlier process instead (`kept`:
# runtime/capture_cache.py); `seconds` counts both
capture = {"functions": 0, "seconds": 0.0, "kept": 0}


@contextlib.contextmanager
def triton_compile():
    """Wrap the part of a first launch where Triton compiles a kernel."""
    global _triton_seconds
    t = time.perf_counter()
    try:
        yield
    finally:
        _triton_seconds += time.perf_counter() - t


def triton_compile_seconds() -> float:
    return _triton_seconds


@contextlib.contextmanager
def gc_paused():
    """Compile work (a capture, a graph's programs) runs with the garbage collector off: it makes
    ~10^5 objects in a burst (AST, FX and sympy nodes) that hold few reference cycles, and the
    collections they set off each scan the whole heap of a process holding a model (GPT-2's
    training step compiled on the dev CPU: 262 collections, 237 ms of its 2.1 s, one of them a
    full collection of 190 ms; building a ResNet-50's guards: 2/3 of the time). What it leaves is
    collected afterwards, as the thresholds decide."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
