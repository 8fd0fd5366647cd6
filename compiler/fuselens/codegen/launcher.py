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


def configs(mode: str, xnumel: int, rnumel: int, interpret: bool, max_autotune: bool,
            chunk: int | None = None) -> list[Config]:
    """Candidate block sizes, best guess first. The interpreter runs one numpy op per block,
    so it gets the largest blocks. Chunked kernels (partials of column reductions) walk `chunk`
    rows per program in blocks of XBLOCK rows: XBLOCK divides the chunk (both powers of two)."""
    if mode == "chunked_rows":  # whole rows per block, as persistent
        rblock = next_power_of_2(rnumel)
        if interpret:
            return [Config(max(1, min(chunk, 4096 // rblock)), rblock)]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64) if x * rblock <= 8192 and x <= chunk] or [1]
        xs = xs if max_autotune else xs[-1:]
        return [Config(x, rblock, 8 if x * rblock >= 2048 else 4) for x in xs]
    if mode == "chunked_tiles":  # [XBLOCK rows, RBLOCK columns] tiles, RBLOCK <= MAX_RTILE (1024)
        rmax = min(next_power_of_2(rnumel), 1024)
        if interpret:
            return [Config(min(chunk, 16), min(rmax, 512))]
        # default mode: the two shapes that won the H100 timings (bench/column_reductions.py, max-autotune):
        # 64x64 for bf16 column sums (50 us vs 80-150 for the rest) and a bias gradient, 8x512 for fp32
        pairs = [(64, 64), (8, 512)] + ([(16, 256), (4, 1024), (32, 128), (32, 256), (16, 512), (8, 256)]
                                        if max_autotune else [])
        out = []
        for x, r in pairs:
            c = Config(min(x, chunk), min(r, rmax), 8 if min(x, chunk) * min(r, rmax) >= 4096 else 4)
            if c not in out:
                out.append(c)
        return out
    if mode == "pointwise":
        if interpret:
            return [Config(min(next_power_of_2(xnumel), 1024))]
        # default mode: one config, no autotuning (each candidate is one more Triton compile in a
        # cold first call); 1024 elements / 4 warps won every pointwise timing on the H100 (bench/NOTES.md)
        sizes = [1024, 512, 256, 128] if max_autotune else [1024]
        warps = [4, 8] if max_autotune else [4]
        return [Config(x, None, w) for x in sizes for w in warps if x <= max(next_power_of_2(xnumel), 128)] or \
            [Config(128)]
    if mode == "persistent":
        rblock = next_power_of_2(rnumel)
        if interpret:
            return [Config(max(1, min(next_power_of_2(xnumel), 4096 // rblock)), rblock)]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64) if x * rblock <= 8192 and x <= next_power_of_2(xnumel)] or [1]
        # default mode: the most rows a block holds (as fast as fewer for long rows, faster for short
        # ones in the H100 timings); looped reductions still autotune (column sums vary 4x by config)
        xs = xs if max_autotune else xs[-1:]
        return [Config(x, rblock, 8 if x * rblock >= 2048 else 4) for x in xs]
    # looped
    if interpret:
        return [Config(max(1, min(next_power_of_2(xnumel), 8)), 512)]
    # default mode: the two shapes that won the H100 timings (1x2048 along contiguous rows, 8x256
    # for column sums, 2-4x faster than the others there); each candidate is one more compile
    pairs = [(1, 2048), (8, 256)] + ([(4, 512), (32, 64), (1, 1024), (2, 1024), (16, 128), (64, 64)] if max_autotune
                                     else [])
    return [Config(x, r, 8 if x * r >= 2048 else 4) for x, r in pairs if x <= max(next_power_of_2(xnumel), 1)]


def grid0(mode, sizes, config):
    """Programs of one launch. sizes: (xnumel,), (xnumel, rnumel) or (xnumel, rnumel, xchunk)."""
    if mode == "chunked_rows":
        return -(-sizes[0] // sizes[2])
    if mode == "chunked_tiles":
        return -(-sizes[0] // sizes[2]) * -(-sizes[1] // config.RBLOCK)
    return -(-sizes[0] // config.XBLOCK)


def _arg_sig(args):
    """What Triton specializes a launch on, for the arguments that can change between calls of
    one program: pointer alignment (16 bytes) and integer divisibility/size. Finer than Triton's
    own key (an unspecialized seed only makes a few more entries), never coarser."""
    sig = []
    for a in args:
        if isinstance(a, int):
            sig.append(a == 1 or (a % 16 == 0) * 2 or (-(1 << 31) <= a < (1 << 31)) * 3)
        elif isinstance(a, float):
            sig.append(-1)
        else:
            sig.append(not a.data_ptr() & 15)
    return tuple(sig)


class TritonKernel:
    """A generated kernel as the wrapper calls it: `kernel.run(*args, xnumel=..., rnumel=...)`.

    The module is imported once per kernel object (not hashed per launch). On a GPU, after the
    first launch of a (config, argument specialization) through Triton's JIT (which compiles,
    timed under `stats.triton_compile`), later launches call the compiled kernel's launcher
    directly, as Triton's own `JITFunction.run` does after its cache lookup (binder, cache key
    and global checks skipped: the wrapper passes the same kinds of arguments every call)."""

    def __init__(self, name, source, mode, max_autotune=False):
        self.name, self.source, self.mode, self.max_autotune = name, source, mode, max_autotune
        self.best: dict = {}  # (device, xnumel, rnumel) -> Config
        self._fn = None
        self._fast: dict = {}  # (xnumel, rnumel) -> (device, grid0, tail, {arg sig: CompiledKernel})
        self._compiled: set = set()  # (config, device, arg sig) compiled by Triton already

    @property
    def fn(self):
        if self._fn is None:
            _join_prewarm()  # importing triton here while the prewarm thread imports it: wait for it
            self._fn = getattr(load_module(self.source), self.name)
        return self._fn

    def run(self, *args, xnumel, rnumel=None, xchunk=None):
        if xnumel == 0:
            return
        fast = self._fast.get((xnumel, rnumel))
        if fast is not None:
            device, nprog, tail, kernels = fast
            k = kernels.get(_arg_sig(args))
            if k is not None and _get_device() == device:
                hooks = _hooks()
                if hooks is not None:
                    k[0](nprog, 1, 1, _get_stream(device), k[1], k[2], None, *hooks, *args, *tail)
                    return
        device = next(a.device for a in args if hasattr(a, "device"))
        fn = self.fn
        sizes = (xnumel,) if rnumel is None else (xnumel, rnumel) if xchunk is None else (xnumel, rnumel, xchunk)
        key = (str(device), xnumel, rnumel)
        config = self.best.get(key)
        if config is None:
            candidates = configs(self.mode, xnumel, rnumel or 1, INTERPRET, self.max_autotune, xchunk)
            config = candidates[0] if len(candidates) == 1 else self.autotune(fn, args, sizes, candidates)
            self.best[key] = config
        ck = self.launch(fn, args, sizes, config)
        if ck is not None and not INTERPRET and device.type == "cuda" and hasattr(ck, "packed_metadata"):
            tail = sizes + ((config.XBLOCK,) if config.RBLOCK is None else (config.XBLOCK, config.RBLOCK))
            grid = grid0(self.mode, sizes, config)
            entry = self._fast.setdefault((xnumel, rnumel), (torch_cuda_device(), grid, tail, {}))
            if entry[1] == grid and entry[2] == tail:
                entry[3][_arg_sig(args)] = (ck.run, ck.function, ck.packed_metadata)
            _bind_cuda()

    def launch(self, fn, args, sizes, config):
        """Launch through Triton's JIT; returns the compiled kernel (None in the interpreter)."""
        grid = (grid0(self.mode, sizes, config),)
        if INTERPRET:
            with np.errstate(all="ignore"):  # the interpreter computes masked-off lanes too (x/0 is harmless)
                fn[grid](*args, *sizes, **config.kwargs())
            return None
        key = (config, torch_cuda_device(), _arg_sig(args))
        if key in self._compiled:
            return fn[grid](*args, *sizes, **config.kwargs())
        from ..runtime import stats
        with stats.triton_compile():  # first launch of this specialization: Triton compiles it
            _join_prewarm()
            ck = fn[grid](*args, *sizes, **config.kwargs())
        self._compiled.add(key)
        return ck

    def autotune(self, fn, args, sizes, candidates):
        """Time each config once per shape on the GPU (kernels are pure: outputs never alias inputs)."""
        from triton.testing import do_bench
        timings = []
        for config in candidates:
            try:
                self.launch(fn, args, sizes, config)  # compile outside the timing
                timings.append((do_bench(lambda: self.launch(fn, args, sizes, config), warmup=2, rep=10), config))
            except Exception:  # a config that does not compile (e.g. out of resources) is skipped
                continue
        if not timings:
            raise RuntimeError(f"no block-size config of {self.name} runs")
        if os.environ.get("FUSELENS_AUTOTUNE_LOG"):
            print(f"autotune {self.name} {self.mode} {sizes}: " +
                  ", ".join(f"{c.XBLOCK}x{c.RBLOCK}/{c.num_warps}w {ms * 1e3:.1f}us" for ms, c in timings),
                  file=sys.stderr, flush=True)
        return min(timings, key=lambda tc: tc[0])[1]


_prewarm_thread = None


def _prewarm():
    try:
        import triton
        try:
            from triton.runtime.cache import triton_key
        except ImportError:
            from triton.compiler.compiler import triton_key
        triton_key()  # hashes Triton's own files and library: the first compile's cache key needs it
        triton.runtime.driver.active.get_current_device()  # driver start (builds its C helpers on a cold cache)
    except Exception:  # only a head start: the first launch does all this itself
        pass


def prewarm():
    """Start Triton's one-time work (import, cache key, driver) in a thread while the backend
    lowers and generates kernels; the first launch waits for it (Triton's lazy driver setup is not
    thread-safe). Its file reads, hashing and compiler subprocesses release the GIL."""
    global _prewarm_thread
    if _prewarm_thread is None and not INTERPRET:
        _prewarm_thread = threading.Thread(target=_prewarm, name="fuselens-triton-prewarm", daemon=True)
        _prewarm_thread.start()


def _join_prewarm():
    if _prewarm_thread is not None and _prewarm_thread.is_alive():
        _prewarm_thread.join()


_rt = None  # triton.knobs.runtime (launch hooks), looked up once
_get_device = _get_stream = None  # torch's current CUDA device and raw stream, bound on first GPU launch


def _bind_cuda():
    global _get_device, _get_stream
    import torch
    _get_device, _get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream


def torch_cuda_device():
    import torch
    return torch._C._cuda_getDevice()


def _idle(hook):
    return hook is None or (hasattr(hook, "calls") and not hook.calls)  # triton >= 3.7: an empty HookChain


def _hooks():
    """Triton's launch hooks when none is set (the direct launch then passes no launch metadata),
    else None (launch through Triton's JIT, which builds the metadata the hooks read)."""
    global _rt
    if _rt is None:
        from triton import knobs
        _rt = knobs.runtime
    enter, exit_ = _rt.launch_enter_hook, _rt.launch_exit_hook
    return (enter, exit_) if _idle(enter) and _idle(exit_) else None
