"""Loading generated kernels and launching them: grids, block-size configs, autotuning cache.

A kernel's source is written to a cache directory and imported, because Triton's code generator
reads the source of the functions it compiles. Modules are shared by source text, so graphs
specialized for new sizes reuse kernels already compiled. On a GPU, cuda.py compiles (Triton's
stages, fuselens's cubin cache) and launches (CUDA driver API) them. FUSELENS_INTERPRET=1
(settings.INTERPRET) runs every kernel in Triton's interpreter (CPU tensors included).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import sys
import threading
import time

import numpy as np

from .. import settings, stats
from ..ops.primitives import PRIMITIVES
from . import cuda

_modules: dict = {}
_lock = threading.RLock()


def check_interpreter():
    """Raise if triton was imported before TRITON_INTERPRET=1 was set: its library functions
    (tl.sum, tl.rand, ...) would then refuse to run in the interpreter."""
    import triton.language as tl
    if settings.INTERPRET and type(tl.standard.sigmoid).__name__ != "InterpretedFunction":
        raise RuntimeError("FUSELENS_INTERPRET=1 needs TRITON_INTERPRET=1 set before triton is first imported "
                           "(set both in the environment)")


# a primitive's kernel line that is one call of a Triton function on its operands: `tl.exp({0})`,
# or of a kernel-local helper (ops/primitives.py TRITON_HELPERS): `fl_sigmoid({0})`
_CALL = re.compile(r"((?:tl\.|libdevice\.)?\w+)\(\{0\}(?:, \{\d\})*\)")
# the handle attribute naming the torch computation that made an interpreted value
_TORCH_OP = "fuselens_torch_op"


@functools.cache
def _primitive_functions():
    """{Triton function a pointwise primitive's kernel line calls (`tl.exp`, `libdevice.tanh`):
    that primitive's torch function}. tl.where is left to Triton: codegen's masks call it too,
    and a selection is exact in any implementation."""
    import torch
    out = {}
    for p in PRIMITIVES.values():
        for dtype in (torch.float32, torch.bfloat16, torch.float64):  # spellings may differ by dtype
            m = _CALL.fullmatch(p.triton_for(dtype) or "") if p.kind == "pointwise" else None
            if m and m.group(1) != "tl.where":
                out[m.group(1)] = p.impl
    return out


# A value computed in fp32 rounded to a half type and widened back, as a kernel-local function whose
# conversions Triton's compiler cannot remove: with FMA contraction on it folds
# `x.to(tl.bfloat16).to(tl.float32)` into x, losing the rounding of each half-precision result
# (an H200 run: `(a * b + a) * b - a` in bfloat16 differed from eager in 50% of its elements). In
# Triton's interpreter it is the two casts (patch_interpreter_casts rounds them as torch does).
ROUND_HELPERS = {
    "bfloat16": ("fl_round_bf16", "def fl_round_bf16(x):\n    return tl.inline_asm_elementwise("
                 "\"{ .reg .b16 h, z; cvt.rn.bf16.f32 h, $1; mov.b16 z, 0; mov.b32 $0, {z, h}; }\", "
                 "\"=r,r\", [x], dtype=tl.float32, is_pure=True, pack=1)"),
    "float16": ("fl_round_f16", "def fl_round_f16(x):\n    return tl.inline_asm_elementwise("
                "\"{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.f32.f16 $0, h; }\", "
                "\"=r,r\", [x], dtype=tl.float32, is_pure=True, pack=1)"),
}


def _interpreted_rounding(half):
    def fl_round(x):
        import triton.language as tl
        return x.to(getattr(tl, half)).to(tl.float32)
    return fl_round


def _as_torch(numpy_data, name):
    """Numpy block data of Triton scalar type `name` as a torch tensor (bf16 is stored as uint16)."""
    import torch
    tensor = torch.from_numpy(np.require(numpy_data, requirements=["C", "W"]))
    return tensor.view(torch.bfloat16) if name == "bf16" else tensor


def _as_numpy(tensor):
    import torch
    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _interpreted(torch_fn, name, original=None):
    """The Triton function `name` for the interpreter: `torch_fn` on the block's data, as eager
    computes the primitive (numpy's tanh or exp differ from torch's in the last bit). The result
    remembers its computation, so that rounding it to a half type right away computes it in that
    type instead (see `_round_op`)."""
    def fn(*args, **kwargs):
        import torch
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle
        tensors = [a for a in args if isinstance(a, tl.core.tensor)]
        names = {t.dtype.scalar.name for t in tensors}
        if not kwargs and len(names) == 1 and names <= set(_TORCH_DTYPES):
            scalar = tensors[0].dtype.scalar
            dtype = _TORCH_DTYPES[scalar.name]
            ins = [_as_torch(a.handle.data, scalar.name) if isinstance(a, tl.core.tensor) else
                   torch.tensor(a, dtype=dtype) for a in args]
            out = torch_fn(*ins)
            if out.dtype == dtype:
                handle = TensorHandle(_as_numpy(out), scalar)
                handle.attr[_TORCH_OP] = (torch_fn, ins)
                shape = list(out.shape)
                return tl.core.tensor(handle, tl.core.block_type(scalar, shape) if shape else scalar)
        if original is None:
            raise TypeError(f"{name}: no interpreted version for these arguments")
        return original(*args, **kwargs)
    fn.__name__ = name
    return fn


class _InterpretedLibdevice:
    """libdevice for Triton's interpreter, which does not patch it: the primitives' torch functions."""

    def __getattr__(self, name):
        torch_fn = _primitive_functions().get(f"libdevice.{name}")
        if torch_fn is None:
            raise AttributeError(f"libdevice.{name} has no interpreted version")
        return _interpreted(torch_fn, f"libdevice.{name}")


def patch_interpreter_math():
    """The tl functions pointwise primitives call (tl.exp, tl.sin, tl.sigmoid, ...) run in the
    interpreter as those primitives' torch functions: Triton's interpreter computes them with
    numpy (and tl.sigmoid as 1 / (1 + exp(-x))), whose results differ from eager's in the last
    bit. Interpreter only: a compiled kernel is not affected (nothing of Triton's compiler is
    patched, and FUSELENS_INTERPRET interprets every kernel of the process)."""
    import triton.language as tl
    if getattr(tl, "_fuselens_math", False):
        return
    from triton.runtime.interpreter import interpreter_semantic
    for name, torch_fn in _primitive_functions().items():
        module, _, attr = name.rpartition(".")
        if module != "tl":
            continue
        original = getattr(tl, attr)
        if tl.core.is_builtin(original):  # as the interpreter calls builtins
            original = functools.partial(original, _semantic=interpreter_semantic)
        setattr(tl, attr, _interpreted(torch_fn, name, original))
    tl._fuselens_math = True


def _round_op(src, src_name, dst):
    """An interpreted value rounded to half type `dst` right after its torch computation, as
    eager computes that op in `dst`: the op run on its operands in `dst` (torch's half kernels may
    differ from its fp32 ones in the last bit), in the lanes where the operands are values of
    `dst` (a primitive's operands are; an fp32 intermediate of a decomposition is not); None
    when it is no such value."""
    import torch
    op = src.attr.get(_TORCH_OP)
    if op is None or dst not in (torch.float16, torch.bfloat16):
        return None
    torch_fn, ins = op
    narrow = [t.to(dst) for t in ins]
    exact = torch.ones((), dtype=torch.bool)
    for t, n in zip(ins, narrow):
        exact = exact & ((n.to(t.dtype) == t) | t.isnan())
    rounded = _as_torch(src.data, src_name).to(dst)
    return torch.where(exact, torch_fn(*narrow), rounded)


def _torch_cast(numpy_data, src, dst):
    """Cast numpy block data of Triton type `src` to `dst` as torch casts."""
    return _as_numpy(_as_torch(numpy_data, src).to(_TORCH_DTYPES[dst]))


_TORCH_DTYPES: dict = {}


def patch_interpreter_casts():
    """Triton's interpreter converts to and from bfloat16 by bit surgery that truncates instead of
    rounding to nearest even, and casts ints and bools to bf16 by reinterpreting numpy integers
    (1 becomes a tiny subnormal); a compiled kernel rounds. Its conversions between the types
    torch has are done by torch instead, which rounds as a compiled kernel and eager do."""
    import torch
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_fuselens_casts", False):
        return
    _TORCH_DTYPES.update({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                          "fp64": torch.float64, "int1": torch.bool, "int8": torch.int8, "int16": torch.int16,
                          "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8})
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast(self, src, dst_type):
        s, d = src.dtype.scalar.name, dst_type.scalar.name
        if s in _TORCH_DTYPES and d in _TORCH_DTYPES:
            rounded = _round_op(src, s, _TORCH_DTYPES[d])
            if rounded is not None:
                return interpreter.TensorHandle(_as_numpy(rounded), dst_type.scalar)
            return interpreter.TensorHandle(_torch_cast(src.data, s, d), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def cast_fp(self, src, dst_type, rounding_mode):
        if rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            return cast(self, src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)
    builder.cast_impl, builder.create_fp_to_fp = cast, cast_fp
    builder._fuselens_casts = True


# the interpreted kernel's name and its tensor arguments' memory: (first address, end) of each storage
_ARGUMENT_MEMORY: list = ["a kernel", []]


def patch_interpreter_bounds():
    """Every load and store of an interpreted kernel checked against the memory of its tensor
    arguments: an active lane's address outside all of them raises IndexError naming the kernel
    (on a GPU the kernel would read another tensor's memory, or fault with "an illegal memory
    access" reported at a later call). The interpreter reads and writes host memory by address."""
    import numpy as np
    from triton.runtime import interpreter
    builder, grid = interpreter.InterpreterBuilder, interpreter.GridExecutor
    if getattr(builder, "_fuselens_bounds", False):
        return
    init_args, load, store = grid._init_args_hst, builder.create_masked_load, builder.create_masked_store

    def init(self, args_dev, kwargs):
        args, kwargs_hst = init_args(self, args_dev, kwargs)
        storages = [t.untyped_storage() for t in [*args, *kwargs_hst.values()] if hasattr(t, "untyped_storage")]
        _ARGUMENT_MEMORY[:] = [getattr(self.fn, "__name__", "a kernel"),
                               [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages]]
        return args, kwargs_hst

    def check(ptrs, mask, what):
        kernel, spans = _ARGUMENT_MEMORY
        address = np.asarray(ptrs.data, dtype=np.uint64)
        address = address[np.broadcast_to(mask.data, address.shape)]
        width = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(address.shape, dtype=bool)
        for first, end in spans:
            inside |= (address >= first) & (address + width <= end)
        if not inside.all():
            raise IndexError(f"{kernel}: a {what} {int((~inside).sum())} elements outside its tensor arguments' memory")

    def checked_load(self, ptrs, mask, other, *args):
        check(ptrs, mask, "load of")
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store of")
        return store(self, ptrs, value, mask, *args)
    grid._init_args_hst, builder.create_masked_load, builder.create_masked_store = init, checked_load, checked_store
    builder._fuselens_bounds = True


# the combine functions of fuselens kernels' reductions (codegen/triton_reductions.py), as numpy reductions
_NUMPY_REDUCTIONS = {"_max_combine": np.max, "_min_combine": np.min, "_prod_combine": np.prod}


def patch_interpreter_reductions():
    """Triton's interpreter runs tl.reduce with a combine function other than its own one
    element at a time in Python (100x slower than tl.max); fuselens's max, min and prod combine
    functions are numpy's max (NaN-propagating, as the combine function), min and prod."""
    from triton.runtime import interpreter
    ops = interpreter.ReduceOps
    if getattr(ops, "_fuselens_reductions", False):
        return
    apply_impl = ops.apply_impl

    def apply(self, input):
        fn = getattr(self.combine_fn, "fn", None)
        reduce = _NUMPY_REDUCTIONS.get(getattr(fn, "__name__", None))
        if reduce is None or self.axis is None or not getattr(fn, "__module__", "").startswith("fuselens_kernel_"):
            return apply_impl(self, input)
        value = input[0]
        data = value.handle.data
        return self.to_tensor(reduce(data, axis=self.axis, keepdims=self.keep_dims).astype(data.dtype), value.dtype)
    ops.apply_impl = apply
    ops._fuselens_reductions = True


def load_module(source: str):
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    with _lock:
        if key in _modules:
            return _modules[key]
        path = os.path.join(settings.cache_dir(), f"k{key}.py")
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
        if settings.INTERPRET:
            module.libdevice = _InterpretedLibdevice()
            for helper, torch_fn in _primitive_functions().items():  # the kernel's own helpers
                if hasattr(module, helper):
                    setattr(module, helper, _interpreted(torch_fn, helper))
            for half, (helper, _) in ROUND_HELPERS.items():
                if hasattr(module, helper):
                    setattr(module, helper, _interpreted_rounding(half))
            patch_interpreter_casts()
            patch_interpreter_reductions()
            patch_interpreter_math()
            patch_interpreter_bounds()
        _modules[key] = module
        return module


@dataclasses.dataclass(frozen=True)
class Config:
    XBLOCK: int
    RBLOCK: int | None = None
    num_warps: int = 4

    def kwargs(self):
        out = {"XBLOCK": self.XBLOCK, "num_warps": self.num_warps}
        if self.RBLOCK is not None:
            out["RBLOCK"] = self.RBLOCK
        return out


MAX_RTILE = 1024  # column tiles of chunked kernels without row reductions (codegen/triton.py masks by it)


# programs a persistent reduction's grid is kept at where its rows allow (2 per SM of an H100)
MIN_PROGRAMS = 256


def next_power_of_2(n):
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def configs(mode: str, xnumel: int, rnumel: int, interpret: bool, max_autotune: bool,
            chunk: int | None = None, itemsize: int = 4) -> list[Config]:
    """Candidate block sizes, best guess first. The interpreter runs one numpy op per block,
    so it gets the largest blocks. Chunked kernels (partials of column reductions) walk `chunk`
    rows per program in blocks of XBLOCK rows: XBLOCK divides the chunk (both powers of two)."""
    if mode == "template":  # a kernel of its own loops (codegen/attention.py): one program per grid row
        return [Config(1, None, 4)]
    if mode == "chunked_rows":  # whole rows per block, as persistent
        rblock = next_power_of_2(rnumel)
        if interpret:
            return [Config(max(1, min(chunk, 4096 // rblock)), rblock)]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64) if x * rblock <= 8192 and x <= chunk] or [1]
        xs = xs if max_autotune else xs[-1:]
        return [Config(x, rblock, 8 if x * rblock >= 2048 else 4) for x in xs]
    if mode == "chunked_tiles":  # [XBLOCK rows, RBLOCK columns] tiles, RBLOCK <= MAX_RTILE
        rmax = min(next_power_of_2(rnumel), MAX_RTILE)
        if interpret:
            return [Config(min(chunk, 16), min(rmax, 512))]
        # default mode: two shapes, timed (the choice is kept: TritonKernel.tuned). With the L2 flushed
        # between timings, 8x64 with 4 warps was the best or within 3% of the best of six shapes for a
        # ResNet's BatchNorm statistics and ReLU-with-BatchNorm gradients (64 to 1024 channels) on the
        # H100; GPT-2's bf16 tanh-GeLU backward with its bias partials (4096 x 3072) took 48 us as
        # 8x64 on an H200, 35 as 16x64 (bench/NOTES.md)
        pairs = [(8, 64), (16, 64)] + ([(32, 64), (64, 64), (16, 128), (32, 128), (4, 256), (8, 512), (16, 1024)]
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
        # default mode: one config, no autotuning (each candidate is one more compile in a cold
        # first call): 1024 elements, with 8 warps when the narrowest dtype is 4 bytes or more (4
        # elements a thread: one 16-byte load of fp32) and 2 below (16 elements). H100 sweeps (bench/NOTES.md):
        # fp32 gelu/sin+cos/relu 1-2% faster at 8 warps than at 4, equal to 2048 elements at 16; a
        # bf16 GeLU of 32M elements 50.2 us at 2 warps, 53.8 at 4, 58.3 at 8
        sizes = [1024, 512, 256, 128] if max_autotune else [1024]
        vector_warps = 8 if itemsize >= 4 else 2
        warps = sorted({2, 4, 8}, key=lambda w: w != vector_warps) if max_autotune else [vector_warps]
        return [Config(x, None, w) for x in sizes for w in warps if x <= max(next_power_of_2(xnumel), 128)] or \
            [Config(128)]
    if mode == "persistent":
        rblock = next_power_of_2(rnumel)
        if interpret:
            return [Config(max(1, min(next_power_of_2(xnumel), 4096 // rblock)), rblock)]
        xs = [x for x in (1, 2, 4, 8, 16, 32, 64) if x * rblock <= 8192 and x <= next_power_of_2(xnumel)] or [1]
        # default mode: the most rows a block holds (as fast as fewer for long rows, faster for short
        # ones in the H100 timings), short of leaving the GPU with fewer than MIN_PROGRAMS programs
        # (a bias gradient's second stage, 256 partials of 768 columns: 24 programs of 32 columns
        # took 15 us), timed against blocks of about 1024 elements, 8 a thread (BERT's layer norms
        # of 768 columns on an H200: 9.8-15.2 us as 8 rows of 8 warps, 8.3-13.8 as one row of 4);
        # looped reductions autotune too (column sums vary 4x by config)
        if not max_autotune:
            pick = [x for x in xs if -(-xnumel // x) >= MIN_PROGRAMS][-1:] or xs[:1]
            small = Config(max(1, 1024 // rblock), rblock, max(4, min(16, rblock // 256)))
            return [Config(x, rblock, 8 if x * rblock >= 2048 else 4) for x in pick] + \
                ([small] if small.XBLOCK < pick[0] else [])
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


_INDEX_SUFFIX = re.compile(r"_\d+$")


def canonical(name: str, source: str) -> tuple[str, str]:
    """(name, source) of the kernel as compiled: the name without its index in the graph
    (`fl_poi_fused_add_relu_7` -> `fl_poi_fused_add_relu`), comments (source lines) dropped."""
    base = _INDEX_SUFFIX.sub("", name)
    lines = [line.split("  # ", 1)[0].rstrip() if "  # " in line else line for line in source.split("\n")]
    return base, "\n".join(lines).replace(f"def {name}(", f"def {base}(", 1)


def _refuse(*args):
    return False


@dataclasses.dataclass(frozen=True)
class Param:
    """What launching reads of a kernel parameter (as Triton's JIT parameter has it)."""
    name: str
    is_constexpr: bool
    do_not_specialize: bool


_JIT_DEF = re.compile(r"^@triton\.jit(?:\(do_not_specialize=\[([^\]]*)\]\))?\ndef (\w+)\((.*)\):$", re.M)


def kernel_params(name: str, source: str) -> list[Param]:
    """The parameters of kernel `name`, read from its decorator and def line in the generated
    source (codegen/triton.py writes both): a process launching cubins from the cache never
    imports the kernel's module or builds Triton's JIT function (3 ms a kernel, a ResNet
    training graph's ~80 kernels 0.25 s)."""
    for m in _JIT_DEF.finditer(source):
        if m.group(2) == name:
            fixed = {n.strip().strip("'\"") for n in (m.group(1) or "").split(",")}
            params = [p.partition(":") for p in m.group(3).split(", ")]  # name[: tl.constexpr]
            return [Param(n, t.strip() == "tl.constexpr", n in fixed) for n, _, t in params]
    raise ValueError(f"no @triton.jit def {name}(...) in the kernel's source")


class TritonKernel:
    """A generated kernel as the wrapper calls it: `kernel.launch(*args) or kernel.run(*args,
    xnumel=..., rnumel=...)`, args being tensors first, then scalars. `launch` is the launch
    function run() last used for the sizes of the kernel's one call in its wrapper
    (`call_sizes`, which the wrapper sets), bound once there is one: it refuses (False) arguments
    it was not built for, and run() then finds or builds another. Called this way, a launch costs
    one attribute read and one call more than the launch function itself.

    On a GPU, fuselens compiles and launches the kernel itself (cuda.py): the first launch per
    (config, argument specialization) compiles a cubin with Triton's compiler stages (timed under
    `stats.triton_compile`) or reads it from fuselens's cache, then builds a launch function that
    later calls reuse while their arguments match it. In the interpreter, Triton's JIT runs it."""

    def __init__(self, name, source, mode, max_autotune=False, itemsize=4, pdl=False):
        self.name, self.source, self.mode, self.max_autotune = name, source, mode, max_autotune
        # what is compiled: the source without its position in the graph (the name's index) and
        # without source-line comments, so identical kernels (a ResNet's blocks, a kernel in
        # another graph or process) share one module, one cubin and its cache entry
        self.compiled_name, self.compiled_source = canonical(name, source)
        self.pdl = pdl  # the source waits for the previous kernel (gdc_wait): launch it with PDL
        self.itemsize = itemsize  # of the narrowest dtype the kernel loads or stores
        self.best: dict = {}  # (device, xnumel, rnumel) -> Config
        self._fn = None
        self.launch = _refuse
        self.call_sizes = None  # (xnumel,), (xnumel, rnumel) or (xnumel, rnumel, xchunk)
        self._launches: dict = {}  # (config, device, sizes, specialization, scalars) -> launch function

    @functools.cached_property
    def params(self) -> list[Param]:
        return kernel_params(self.compiled_name, self.compiled_source)

    @property
    def fn(self):
        if self._fn is None:
            self._fn = getattr(load_module(self.compiled_source), self.compiled_name)
        return self._fn

    def run(self, *args, xnumel, rnumel=None, xchunk=None):
        if xnumel == 0:
            return
        sizes = (xnumel,) if rnumel is None else (xnumel, rnumel) if xchunk is None else (xnumel, rnumel, xchunk)
        if sizes == self.call_sizes and self.launch(*args):
            return
        device = next(a.device for a in args if hasattr(a, "device"))
        key = (str(device), xnumel, rnumel)
        config = self.best.get(key)
        if config is None:
            candidates = configs(self.mode, xnumel, rnumel or 1, settings.INTERPRET, self.max_autotune, xchunk,
                                 self.itemsize)
            config = candidates[0] if len(candidates) == 1 else self.tuned(args, sizes, candidates)
            self.best[key] = config
        if settings.INTERPRET:
            with np.errstate(all="ignore"):  # the interpreter computes masked-off lanes too (x/0 is harmless)
                self.fn[(grid0(self.mode, sizes, config),)](*args, *sizes, **config.kwargs())
            return
        launch = self.launch_for(args, sizes, config)
        if sizes == self.call_sizes:
            self.launch = launch
        if not launch(*args):
            raise RuntimeError(f"{self.name}: a launch built for these arguments refused them")

    def specialize(self, args, sizes, config):
        """(Triton's specialization of these arguments, the key of their launch function)."""
        spec = cuda.specialize(self.params, args, sizes, config)
        scalars = tuple(a for a, p in zip(args, self.params) if isinstance(a, int) and not p.do_not_specialize)
        return spec, (config, torch_cuda_device(), sizes, tuple(spec[0].values()), tuple(spec[2]), scalars)

    def expected_launches(self, dtypes, scalars, sizes, device):
        """The launches the wrapper will make, before it makes them: (args, sizes, config) for every
        config the first launch may try (the one autotuning chose before, where it did), with
        stand-ins for the tensors (of these dtypes, 16-byte aligned as torch allocates). `scalars`:
        the seed (any int) and the size arguments; `device`: a CUDA device's index."""
        args = [_Aligned(d) for d in dtypes] + list(scalars)
        xnumel, rnumel, xchunk = (tuple(sizes) + (None, None))[:3]
        candidates = configs(self.mode, xnumel, rnumel or 1, settings.INTERPRET, self.max_autotune, xchunk,
                             self.itemsize)
        if len(candidates) > 1:
            chosen = remembered_choice(self.choice_key(tuple(sizes), candidates, device))
            candidates = [chosen] if chosen else candidates
        return [(args, tuple(sizes), c) for c in candidates]

    def compile_jobs(self, dtypes, scalars, sizes, device):
        """cubin_job()s for expected_launches on `device` (a torch.device): compiled together,
        before the first call (one program's kernels would otherwise compile one after another as
        the wrapper reaches them). No jobs where nothing is compiled (the interpreter, a CPU)."""
        if settings.INTERPRET or device.type != "cuda" or not sizes[0]:
            return []
        index = device.index if device.index is not None else torch_cuda_device()
        return [cubin_job(self.compiled_source, self.compiled_name, self.specialize(args, sz, c)[0], c, index)
                for args, sz, c in self.expected_launches(dtypes, scalars, sizes, index)]

    def launch_for(self, args, sizes, config):
        """The launch function for these arguments and config (compiled, or read from the cache, on a miss)."""
        spec, key = self.specialize(args, sizes, config)
        launch = self._launches.get(key)
        if launch is None:
            device = key[1]
            binary = load_binary(self.compiled_source, self.compiled_name, spec, config, device)
            launch = cuda.make_launch(binary, self.params, spec, args, sizes, grid0(self.mode, sizes, config),
                                      device, self.pdl)
            self._launches[key] = launch
        return launch

    def choice_key(self, sizes, candidates, device) -> str:
        """What autotuning's choice for these sizes depends on: the compiled kernel, its candidates,
        the GPU's model and Triton's version (its codegen)."""
        import torch
        import triton
        text = repr((cuda._digest(self.compiled_source), self.compiled_name, self.mode, tuple(sizes), candidates,
                     torch.cuda.get_device_name(device), triton.__version__))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def tuned(self, args, sizes, candidates):
        """The best of `candidates` for these sizes: as chosen before for this kernel's source (by
        another kernel of the same source, a model's layers, or an earlier process), else timed."""
        key = self.choice_key(sizes, candidates, torch_cuda_device())
        config = remembered_choice(key)
        if config is None or config not in candidates:
            config = self.autotune(args, sizes, candidates)
            remember_choice(key, config)
        return config

    def autotune(self, args, sizes, candidates):
        """Time each config once per shape on the GPU, on copies of the arguments where an output is
        written over an input (codegen/wrapper.py's `# in place`): each timed run would write it again."""
        device = torch_cuda_device()
        args = _timing_args(args)
        compile_concurrently([cubin_job(self.compiled_source, self.compiled_name,
                                        self.specialize(args, sizes, c)[0], c, device)
                              for c in candidates])
        timings, error = [], None
        for config in candidates:
            try:
                launch = self.launch_for(args, sizes, config)
            except Exception as e:  # a config that does not compile or fit (OutOfResources) is skipped
                error = e
                continue
            timings.append((gpu_time(lambda: launch(*args)), config))
        if not timings:
            raise RuntimeError(f"no block-size config of {self.name} runs: {type(error).__name__}: {error}") from error
        if os.environ.get("FUSELENS_AUTOTUNE_LOG"):
            print(f"autotune {self.name} {self.mode} {sizes}: " +
                  ", ".join(f"{c.XBLOCK}x{c.RBLOCK}/{c.num_warps}w {ms * 1e3:.1f}us" for ms, c in timings),
                  file=sys.stderr, flush=True)
        return min(timings, key=lambda tc: tc[0])[1]


def _timing_args(args):
    """`args` with a copy in place of each group of tensors at one address (an output written over
    an input: the copy is shared alike, in its layouts)."""
    import collections
    import torch
    ptrs = collections.Counter(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
    copies: dict = {}

    def copy(a):
        if not isinstance(a, torch.Tensor) or ptrs[a.data_ptr()] == 1:
            return a
        first = copies.get(a.data_ptr())
        if first is None:
            first = copies[a.data_ptr()] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype,
                                                               device=a.device).copy_(a)
        return first.as_strided(a.shape, a.stride())
    return [copy(a) for a in args]


# Autotuning's choices by TritonKernel.choice_key: in this process, and on disk under
# FUSELENS_CACHE_DIR/autotune as the cubins are, so a model's identical kernels are timed once and
# a later process times none (a warm process timed each candidate of each kernel again)
_choices: dict = {}


def _choice_path(key):
    return os.path.join(settings.cache_dir(), "autotune", key + ".json")


def remembered_choice(key) -> Config | None:
    if key not in _choices:
        try:
            with open(_choice_path(key)) as f:
                _choices[key] = Config(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None
    return _choices[key]


def remember_choice(key, config: Config):
    _choices[key] = config
    path = _choice_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dataclasses.asdict(config), f)
    os.replace(tmp, path)


class _Aligned:
    """A tensor argument as specialization sees it: its dtype and a 16-byte-aligned address."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        return 0


def gpu_time(fn, budget_ms=5.0):
    """Milliseconds a call of `fn` (launches on the current stream) takes with the L2 cache cold: the
    median of calls timed one by one with CUDA events, each after writing over a buffer twice the
    L2's size (as triton.testing.do_bench does), for about `budget_ms` of calls. Calls back to back
    find a small kernel's whole data in L2, as a model's step seldom does, and favoured tiles that are
    fast only then (ResNet-50's BatchNorm kernels: a 10% slower training step, bench/NOTES.md)."""
    import torch
    device = torch.cuda.current_device()
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.int8, device="cuda")

    def timed(n):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return sorted(start.elapsed_time(end) for start, end in events)

    fn()  # a first call pays for loading the kernel
    first = timed(1)[0]
    times = timed(max(3, min(50, int(budget_ms / max(first, 1e-3)))))
    return times[len(times) // 2]


_binaries: dict = {}  # cubin cache key -> {device: cuda.Binary}, shared by kernels of the same source


def cubin_dir():
    return os.path.join(settings.cache_dir(), "cubin")


def cubin_job(source, name, spec, config, device):
    """(cache key, what compile_job compiles: plain data, so a worker process can) for this
    specialization and config."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    arch = major * 10 + minor
    return cuda.cache_key(source, name, *spec, config.num_warps, arch), (source, name, spec, config.num_warps, arch)


def compile_job(job):
    """(cubin, metadata) of a cubin_job's second part, by Triton's stages."""
    source, name, spec, num_warps, arch = job
    return cuda.compile_cubin(getattr(load_module(source), name), *spec, num_warps, arch)


def load_binary(source, name, spec, config, device):
    """The kernel compiled for this specialization and config, loaded on `device`: from memory,
    from fuselens's cubin cache, or compiled by Triton's stages (timed as Triton's part)."""
    key, job = cubin_job(source, name, spec, config, device)
    loaded = _binaries.setdefault(key, {})
    if device not in loaded:
        pending = _compiling.get(key)
        if pending is not None:  # (compiled ahead in a worker: its cubin is in the cache once done)
            with stats.triton_compile():
                _wait(pending)

        def timed():
            with stats.triton_compile():
                return compile_job(job)
        cubin, meta = cuda.cached_cubin(cubin_dir(), key, timed)
        loaded[device] = cuda.Binary(cubin, meta, device)
    return loaded[device]


# Triton's stages run in worker processes: in threads, its Python front end (the AST to MLIR) held
# the GIL, so a graph's kernels compiled one front end at a time, and nothing else ran meanwhile.
# Workers are forked (they inherit the loaded modules, and start in milliseconds; they never touch
# CUDA: the target is explicit), one a core up to 32, on the first compile, and kept for the
# process's lifetime. A fork happens with `_lock` held by the forking thread (no other thread is
# then inside load_module, whose lock a worker needs); a child starts with no pool of its own.
# A worker that dies, or compiles not done WORKER_TIMEOUT seconds after they were waited for,
# leave their kernels to this process: each launch compiles its own, as one never compiled ahead.
_pool = None
_pool_lock = threading.Lock()
_compiling: dict = {}  # cache key -> Future of the worker compiling it
WORKER_TIMEOUT = 300


def _after_fork_in_child():
    global _pool, _lock, _pool_lock
    _pool, _lock, _pool_lock = None, threading.RLock(), threading.Lock()
    _compiling.clear()


os.register_at_fork(before=lambda: _lock.acquire(), after_in_parent=lambda: _lock.release(),
                    after_in_child=_after_fork_in_child)


def _compile_into_cache(directory, key, job, env):
    os.environ.update(env)  # Triton's settings as they were when the key was made
    cuda.cached_cubin(directory, key, lambda: compile_job(job))
    return os.getpid()


def _workers():
    global _pool
    with _pool_lock:
        if _pool is None:
            import atexit
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            _pool = ProcessPoolExecutor(min(os.cpu_count() or 1, 32), mp_context=multiprocessing.get_context("fork"))
            atexit.register(_stop_workers, _pool, os.getpid())
        return _pool


def _stop_workers(pool, pid):
    """At exit, while the modules are there (collected at interpreter teardown, the pool's cleanup
    printed an AttributeError from a module already gone); by the process that started it only (a
    forked child inherits the handler, not the pool's threads)."""
    if os.getpid() == pid:
        pool.shutdown(wait=True, cancel_futures=True)


def _wait(future, timeout=WORKER_TIMEOUT) -> None:
    """Until the worker is done with it, or gave up: a broken pool (a worker died) is replaced at
    the next compile."""
    global _pool
    from concurrent.futures import CancelledError, TimeoutError
    from concurrent.futures.process import BrokenProcessPool
    try:
        if isinstance(future.exception(timeout=timeout), BrokenProcessPool):
            with _pool_lock:
                _pool = None
    except (CancelledError, TimeoutError):
        pass


def start_compiles(jobs) -> list:
    """Start compiling the cubins of `jobs` (from cubin_job) that are in neither memory, fuselens's
    cache nor a worker already, into the cache; returns the futures of all that are compiling.
    A job that fails here fails again, with its error, when its config is launched."""
    from concurrent.futures import Future
    from triton._C.libtriton import get_cache_invalidating_env_vars
    directory = cubin_dir()
    env = dict(get_cache_invalidating_env_vars())
    futures = {}
    for key, job in jobs:
        if key in futures or key in _binaries or os.path.exists(os.path.join(directory, key + ".json")):
            continue
        future = _compiling.get(key)
        if future is None:
            try:
                future = _workers().submit(_compile_into_cache, directory, key, job, env)
            except Exception as e:  # (no worker could start: the launch compiles it in this process)
                future = Future()
                future.set_exception(e)
            _compiling[key] = future
            future.add_done_callback(lambda f, key=key: _compiling.pop(key, None))
        futures[key] = future
    return list(futures.values())


def compile_concurrently(jobs):
    """Compile the cubins of `jobs` (from cubin_job) concurrently, into the cache, and wait for them:
    autotuning then pays about one compile instead of one per candidate, and a program's first call
    none of its kernels' compiles."""
    futures = start_compiles(jobs)
    if futures:
        deadline = time.monotonic() + WORKER_TIMEOUT
        with stats.triton_compile():
            for future in futures:
                _wait(future, max(0.0, deadline - time.monotonic()))


def supports_pdl(device) -> bool:
    """Whether kernels for `device` are launched with programmatic dependent launch (PDL): each
    kernel's programs may be scheduled while the kernel before it on the stream finishes, and wait
    for it in `gdc_wait()` (Hopper and later; saves the launch gap between dependent kernels,
    ~1.3 us after a GEMM on an H100, bench/NOTES.md). FUSELENS_PDL=0 turns it off for programs
    built after it is set (a graph's first call, a new input layout). Needs a
    CUDA 12.3 driver or later (CUDA graphs record such launches from 12.3 on: reduce-overhead)."""
    import torch
    return (not settings.INTERPRET and device.type == "cuda" and os.environ.get("FUSELENS_PDL", "1") != "0"
            and torch.cuda.get_device_capability(device)[0] >= 9 and cuda.driver_version() >= 12030)


def torch_cuda_device():
    import torch
    return torch._C._cuda_getDevice()
