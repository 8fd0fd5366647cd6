"""Process-wide compile-time counters, so benchmarks can report fuselens's own compile time
apart from Triton's compilation of the kernel source, the program cache's part
(runtime/program_cache.py) apart from the backend's, and capture's (every function and resume
function captured, guards included)."""
from __future__ import annotations

import contextlib
import time

_triton_seconds = 0.0
# the backend compiling a graph's programs (ops -> ... -> codegen) vs loading them from the program
# cache; backward_layouts: backward programs compiled at a backward call for a layout of its
# inputs not compiled ahead (their time is in `seconds`)
backend = {"compiles": 0, "seconds": 0.0, "cache_hits": 0, "cache_load_seconds": 0.0, "backward_layouts": 0}
capture = {"functions": 0, "seconds": 0.0}


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
