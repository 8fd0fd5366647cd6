"""Loading generated kernels and launching them: grids, block-size configs, autotuning cache.

A kernel's source is written to a cache directory and imported, because Triton's JIT reads the
source of the functions it compiles. Modules are shared by source text, so graphs specialized
for new sizes reuse kernels already compiled.

FUSELENS_INTERPRET=1 runs every kernel in Triton's interpreter (CPU tensors included). Triton
decides interpreted vs compiled for its own library functions (`tl.rand`, ...) when it is first
imported, so this module sets TRITON_INTERPRET=1 before anything imports triton; importing
triton yourself earlier in that process requires TRITON_INTERPRET=1 to be set already.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

INTERPRET = os.environ.get("FUSELENS_INTERPRET", "") not in ("", "0")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

_modules: dict = {}
_lock = threading.Lock()


def check_interpreter():
    """Raise if triton was imported before TRITON_INTERPRET=1 was set: its library functions
    (tl.sum, tl.rand, ...) would then refuse to run in the interpreter."""
    import triton.language as tl
    if INTERPRET and type(tl.standard.sigmoid).__name__ != "InterpretedFunction":
        raise RuntimeError("FUSELENS_INTERPRET=1 needs TRITON_INTERPRET=1 set before triton is first imported "
                           "(set both in the environment)")


def cache_dir():
    path = os.environ.get("FUSELENS_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"fuselens-{os.getuid()}")
    os.makedirs(path, exist_ok=True)
    return path


class _InterpretedLibdevice:
    """libdevice for Triton's interpreter, which does not patch it: numpy on the block's data."""

    def __getattr__(self, name):
        np_fn = {"tanh": np.tanh, "log1p": np.log1p, "pow": np.power}[name]

        def fn(*args):
            import triton.language as tl
            from triton.runtime.interpreter import TensorHandle
            ref = next(a for a in args if isinstance(a, tl.core.tensor))
            data = [a.handle.data if isinstance(a, tl.core.tensor) else a for a in args]
            with np.errstate(all="ignore"):
                out = np.asarray(np_fn(*data)).astype(ref.handle.data.dtype)
            return tl.core.tensor(TensorHandle(out, ref.dtype.scalar), ref.type)
        return fn


def load_module(source: str):
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    with _lock:
        if key in _modules:
            return _modules[key]
        path = os.path.join(cache_dir(), f"k{key}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        name = f"fuselens_kernel_{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if INTERPRET:
            module.libdevice = _InterpretedLibdevice()
        _modules[key] = module
        return module


@dataclass(frozen=True)
class Config:
    XBLOCK: int
    RBLOCK: int | None = None
    num_warps: int = 4

    def kwargs(self):
        out = {"XBLOCK": self.XBLOCK, "num_warps": self.num_warps}
        if self.RBLOCK is not None:
            out["RBLOCK"] = self.RBLOCK
        return out


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def configs(mode: str, xnumel: int, rnumel: int, interpret: bool, max_autotune: bool) -> list[Config]:
    """Candidate block sizes, best guess first. The interpreter runs one numpy op per block,
    so it gets the largest blocks."""
    if mode == "pointwise":
        if interpret:
            return [Config(min(next_power_of_2(xnumel), 1024))]
        sizes = [1024, 512, 256, 128] if max_autotune else [1024, 256]
        warps = [4, 8] if max_autotune else [4]
        return [Config(x, None, w) for x in sizes for w in warps if x <= max(next_power_of_2(xnumel), 128)] or \
            [Config(128)]
    if mode == "persistent":
        rblock = next_power_of_2(rnumel)
        if interpret:
            return [Config(max(1, min(next_power_of_2(xnumel), 4096 // rblock)), rblock)]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64) if x * rblock <= 8192 and x <= next_power_of_2(xnumel)] or [1]
        xs = xs if max_autotune else sorted({xs[0], xs[len(xs) // 2], xs[-1]})
        return [Config(x, rblock, 8 if x * rblock >= 2048 else 4) for x in xs]
    # looped
    if interpret:
        return [Config(max(1, min(next_power_of_2(xnumel), 8)), 512)]
    pairs = [(1, 2048), (4, 512), (8, 256), (32, 64)] + ([(1, 1024), (2, 1024), (16, 128), (64, 64)] if max_autotune
                                                          else [])
    return [Config(x, r, 8 if x * r >= 2048 else 4) for x, r in pairs if x <= max(next_power_of_2(xnumel), 1)]


class TritonKernel:
    """A generated kernel as the wrapper calls it: `kernel.run(*args, xnumel=..., rnumel=...)`."""

    def __init__(self, name, source, mode, max_autotune=False):
        self.name, self.source, self.mode, self.max_autotune = name, source, mode, max_autotune
        self.best: dict = {}  # (device, xnumel, rnumel) -> Config

    def run(self, *args, xnumel, rnumel=None):
        if xnumel == 0:
            return
        device = next(a.device for a in args if hasattr(a, "device"))
        fn = getattr(load_module(self.source), self.name)
        sizes = (xnumel,) if rnumel is None else (xnumel, rnumel)
        key = (str(device), xnumel, rnumel)
        config = self.best.get(key)
        if config is None:
            candidates = configs(self.mode, xnumel, rnumel or 1, INTERPRET, self.max_autotune)
            config = candidates[0] if len(candidates) == 1 else self.autotune(fn, args, sizes, candidates)
            self.best[key] = config
        self.launch(fn, args, sizes, config)

    @staticmethod
    def launch(fn, args, sizes, config):
        grid = (-(-sizes[0] // config.XBLOCK),)
        with np.errstate(all="ignore"):  # the interpreter computes masked-off lanes too (x/0 there is harmless)
            fn[grid](*args, *sizes, **config.kwargs())

    def autotune(self, fn, args, sizes, candidates):
        """Time each config once per shape on the GPU (kernels are pure: outputs never alias inputs)."""
        from triton.testing import do_bench
        timings = []
        for config in candidates:
            try:
                timings.append((do_bench(lambda: self.launch(fn, args, sizes, config), warmup=5, rep=20), config))
            except Exception:  # a config that does not compile (e.g. out of resources) is skipped
                continue
        if not timings:
            raise RuntimeError(f"no block-size config of {self.name} runs")
        return min(timings, key=lambda tc: tc[0])[1]
