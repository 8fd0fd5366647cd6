"""fuselens's own compile and launch of its generated kernels on NVIDIA GPUs.

Compile: Triton's compiler stages (ttir -> ttgir -> llir -> ptx -> cubin) for an explicit target
(torch's device capability), not `triton.compile`: that one keys its cache on `triton_key()`
(a hash of Triton's own files and library, ~0.4 s once per process) and a JIT launch starts
Triton's CUDA driver (a gcc build of its C helpers, and in triton <= 3.6 one more gcc build of a
launcher per argument signature). Cubins are cached on disk under FUSELENS_CACHE_DIR/cubin,
keyed by kernel source, argument specialization, config, Triton version, arch and Triton's
cache-invalidating environment variables, so a later process skips Triton entirely.

Launch: the CUDA driver API through ctypes. Each (kernel, config, argument specialization,
scalar values) gets a generated Python function holding one preallocated parameter buffer and an
array of pointers into it: a launch checks the pointers' alignment and the scalars the kernel was
specialized on, writes the parameters with one `pack_into` and calls `cuLaunchKernelEx` once, with
a launch config built ahead (on Hopper and later with programmatic dependent launch: the kernel
starts while the one before it finishes, and waits for it with `gdc_wait()`).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import struct
import threading
import types

CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CACHE_FORMAT = 1  # bump when what is stored next to a cubin changes

TL_TYPES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float64": "fp64",
            "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64",
            "torch.uint8": "u8", "torch.bool": "i1"}
# struct codes of kernel parameters (native alignment, as the kernel's parameter buffer expects)
PACK = {"i32": "i", "i64": "q", "u64": "Q", "fp32": "f"}


class OutOfResources(RuntimeError):
    """A config that needs more shared memory or registers than the device has (autotuning skips it)."""


def int_type(v: int) -> str:
    return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64" if -2 ** 63 <= v < 2 ** 63 else "u64"


def specialize(params, args, sizes, config):
    """Triton's (signature, constexprs, attrs) for one launch, by Triton's JIT rules: pointers
    16-byte aligned and integers divisible by 16 are marked so, integers equal to 1 become
    constants; a parameter declared do_not_specialize (the seed) is always i64, so a fresh seed
    per call never compiles a new variant. `params`: the kernel's (launcher.kernel_params)."""
    signature, constexprs, attrs = {}, {}, {}
    values = list(args) + list(sizes) + [config.XBLOCK] + ([] if config.RBLOCK is None else [config.RBLOCK])
    assert len(values) == len(params), f"{len(values)} arguments for {len(params)} parameters"
    for i, (p, v) in enumerate(zip(params, values)):
        if p.is_constexpr or (isinstance(v, int) and v == 1 and not p.do_not_specialize):
            signature[p.name], constexprs[(i,)] = "constexpr", v
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        elif isinstance(v, int):
            signature[p.name] = "i64" if p.do_not_specialize else int_type(v)
            if v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "*" + TL_TYPES[str(v.dtype)]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


# ---- compiling: Triton's stages, fuselens's cache

def cache_key(source, name, signature, constexprs, attrs, num_warps, arch) -> str:
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    text = repr((CACHE_FORMAT, triton.__version__, arch, _digest(source), name, sorted(signature.items()),
                 sorted(constexprs.items()), sorted(attrs.items()), num_warps,
                 sorted(get_cache_invalidating_env_vars().items())))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=4096)
def _digest(source: str) -> str:
    """A kernel source's hash, once per source: a warm process keys each kernel's launches twice
    (compiles started at load, then the launch), a ResNet-50 training step's 724 times."""
    return hashlib.sha256(source.encode()).hexdigest()


def compile_cubin(fn, signature, constexprs, attrs, num_warps, arch):
    """Run Triton's compiler stages; returns (cubin, metadata)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # FMA contraction on, as Triton's JIT compiled these kernels (explicit: 3.9 warns its default changes)
    options = backend.parse_options({"num_warps": num_warps, "enable_fp_fusion": True})
    src = ASTSource(fn, signature, constexprs, attrs)
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    metadata = {"target": target, **options.__dict__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "ptx":
            entry = re.search(r"\.entry\s+\w+\s*\(([^)]*)\)", module)
            metadata["n_params"] = entry.group(1).count(".param")
    meta = {"name": metadata["name"], "shared": metadata["shared"], "num_warps": metadata["num_warps"],
            "n_params": metadata["n_params"]}
    # fuselens passes no scratch memory (Triton kernels need it only for features ours do not use)
    for need in ("global_scratch_size", "profile_scratch_size", "tmem_size"):
        if metadata.get(need):
            raise RuntimeError(f"kernel {meta['name']} needs {need}={metadata[need]}, which fuselens does not provide")
    if metadata.get("num_ctas", 1) != 1 or metadata.get("launch_cooperative_grid") or metadata.get("launch_pdl"):
        raise RuntimeError(f"kernel {meta['name']}: clusters, cooperative launches and Triton's own PDL option "
                           "are not supported (fuselens sets PDL itself)")
    return module, meta


def cached_cubin(directory, key, compile_fn):
    """The cubin and metadata stored under `key`, compiled by `compile_fn()` and stored on a miss."""
    path = os.path.join(directory, key)
    try:
        with open(path + ".json") as f:
            meta = json.load(f)
        with open(path + ".cubin", "rb") as f:
            return f.read(), meta
    except (OSError, ValueError):
        pass
    cubin, meta = compile_fn()
    os.makedirs(directory, exist_ok=True)
    for ext, data, mode in ((".cubin", cubin, "wb"), (".json", json.dumps(meta), "w")):  # json last: marks complete
        tmp = f"{path}{ext}.{os.getpid()}.{threading.get_ident()}.tmp"  # autotuning compiles in threads
        with open(tmp, mode) as f:
            f.write(data)
        os.replace(tmp, path + ext)
    return cubin, meta


# ---- the CUDA driver through ctypes

class CudaError(RuntimeError):
    pass


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("pad2", ctypes.c_char * 4),
                ("rest", ctypes.c_uint64 * 7)]  # 8-byte aligned, as the union (it holds pointers)


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_lib = None
_contexts: dict = {}  # device ordinal -> its primary context (retained once)


def lib():
    global _lib
    if _lib is None:
        import torch
        torch.cuda.init()  # the driver and the device's primary context, as torch sets them up
        cuda = ctypes.CDLL("libcuda.so.1")
        vp, pvp, i, pi = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_int)
        for name, argtypes in (("cuModuleLoadData", [pvp, vp]), ("cuModuleGetFunction", [pvp, vp, ctypes.c_char_p]),
                               ("cuFuncGetAttribute", [pi, i, vp]), ("cuFuncSetAttribute", [vp, i, i]),
                               ("cuDeviceGetAttribute", [pi, i, i]), ("cuDeviceGet", [pi, i]),
                               ("cuDevicePrimaryCtxRetain", [pvp, i]), ("cuCtxGetCurrent", [pvp]),
                               ("cuCtxSetCurrent", [vp]), ("cuGetErrorName", [i, ctypes.POINTER(ctypes.c_char_p)]),
                               ("cuDriverGetVersion", [pi]), ("cuStreamCreate", [pvp, ctypes.c_uint])):
            getattr(cuda, name).argtypes = argtypes
        # no argtypes for the launch: ctypes converts prebuilt c_void_p objects and small ints fastest
        _lib = cuda
    return _lib


def driver_version() -> int:
    """The CUDA driver's version, 1000 * major + 10 * minor (12030 for 12.3)."""
    version = ctypes.c_int()
    check(lib().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


def new_stream(device: int) -> int:
    """A new CUDA stream on `device` (non-blocking; never destroyed, so its handle is never reused)."""
    stream = ctypes.c_void_p()
    check(make_context_current(device), "cuCtxSetCurrent")
    check(lib().cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")  # 1: CU_STREAM_NON_BLOCKING
    return stream.value


def check(err, what):
    if err:
        name = ctypes.c_char_p()
        _lib.cuGetErrorName(err, ctypes.byref(name))
        raise CudaError(f"CUDA error {err} ({(name.value or b'?').decode()}) in {what}")


def make_context_current(device: int) -> int:
    """Make the device's primary context (the one torch uses) current on this thread, for threads
    that have not called CUDA yet (autograd runs the backward on its own thread). Returns a CUresult."""
    ctx = _contexts.get(device)
    if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        check(_lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        check(_lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        ctx = _contexts[device] = ctx
    return _lib.cuCtxSetCurrent(ctx)


class Binary:
    """A cubin loaded on one device: its function handle and launch constants."""

    def __init__(self, cubin: bytes, meta: dict, device: int):
        cuda = lib()
        name = meta["name"]
        current = ctypes.c_void_p()
        check(cuda.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if not current.value:
            check(make_context_current(device), "cuCtxSetCurrent")
        module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        check(cuda.cuModuleLoadData(ctypes.byref(module), cubin), f"cuModuleLoadData({name})")
        check(cuda.cuModuleGetFunction(ctypes.byref(self.function), module, name.encode()),
              f"cuModuleGetFunction({name})")
        self.name, self.shared, self.n_params = name, meta["shared"], meta["n_params"]
        self.threads = 32 * meta["num_warps"]
        value = ctypes.c_int()
        check(cuda.cuFuncGetAttribute(ctypes.byref(value), CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.function),
              f"cuFuncGetAttribute({name})")
        if value.value < self.threads:
            raise OutOfResources(f"{name}: {self.threads} threads, at most {value.value} with its registers")
        if self.shared > 48 * 1024:  # dynamic shared memory over 48 KB must be opted into
            check(cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                                            device), "cuDeviceGetAttribute")
            if self.shared > value.value:
                raise OutOfResources(f"{name}: {self.shared} bytes of shared memory, at most {value.value}")
            check(cuda.cuFuncSetAttribute(self.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.shared),
                  f"cuFuncSetAttribute({name})")


def launch_config(binary: Binary, grid: int, pdl: bool) -> LaunchConfig:
    """The launch's CUlaunchConfig (its stream is set per call). `pdl`: programmatic stream
    serialization, for kernels that begin with `gdc_wait()`."""
    config = LaunchConfig(grid, 1, 1, binary.threads, 1, 1, binary.shared)
    if pdl:
        config.attrs = ctypes.pointer(LaunchAttribute(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1))
        config.numAttrs = 1
    return config


def make_launch(binary: Binary, params, spec, args, sizes, grid: int, device: int, pdl=False):
    """A function `launch(*args) -> bool` for this binary and arguments like `args` (`sizes`
    appended; `spec` from `specialize`): False, launching nothing, when an argument no longer
    matches what the launch was built for (a pointer the binary assumes aligned is not, another
    value of an integer other than the seed) or torch's current device differs; else it launches
    on torch's current stream. Integers are compared by value (the wrapper passes constants), so
    the buffer takes them from the function's constants; only pointers, the seed and floats are
    written per call. `pdl`: launched with programmatic dependent launch (see launch_config)."""
    import torch
    signature, _, attrs = spec
    values = list(args) + list(sizes)
    # the function's text names its constants (k{i}), given by its globals: launches of one
    # structure share one compile of their text (a ResNet training graph's 362 launches, 37 texts)
    fmt, fields, checks, ptrs, aligned, consts = "@", [], [], [], [], {}
    for i, (p, v) in enumerate(zip(params, values)):
        ty, arg = signature[p.name], f"a{i}" if i < len(args) else None
        if ty[0] == "*":
            fmt += "Q"
            fields.append(f"p{i}")
            ptrs.append(i)
            if (i,) in attrs:
                aligned.append(f"p{i}")
            continue
        per_call = arg is not None and (p.do_not_specialize or ty == "fp32")  # written from the call
        if not per_call:
            consts[f"k{i}"] = v
        if ty != "constexpr":
            fmt += PACK[ty]
            fields.append(arg if per_call else f"k{i}")
        if arg is not None and not per_call:
            checks.append(f"{arg} != k{i}")
    n_extra = binary.n_params - (len(fmt) - 1)
    if n_extra < 0:
        raise RuntimeError(f"{binary.name}: {binary.n_params} kernel parameters for {len(fmt) - 1} arguments")
    fmt += "Q" * n_extra  # Triton's scratch pointers (global, profile): null, as the kernel needs none
    fields += ["0"] * n_extra
    size, offsets = 0, []
    for code in fmt[1:]:
        width = struct.calcsize(code)
        size = -(-size // width) * width
        offsets.append(size)
        size += width
    buf = ctypes.create_string_buffer(max(size, 8))
    param_ptrs = (ctypes.c_void_p * max(len(offsets), 1))(*[ctypes.addressof(buf) + o for o in offsets])
    if aligned:
        checks.insert(0, f"({' | '.join(aligned)}) & 15")
    checks.append("get_device() != device")
    config = launch_config(binary, grid, pdl)
    lock = threading.Lock()
    namespace = {"function": binary.function, "params": param_ptrs, "buf": buf, "pack": struct.Struct(fmt).pack_into,
                 "config": config, "config_ptr": ctypes.c_void_p(ctypes.addressof(config)),
                 "cu_launch": lib().cuLaunchKernelEx, "acquire": lock.acquire, "release": lock.release,
                 "get_device": torch._C._cuda_getDevice, "get_stream": torch._C._cuda_getCurrentRawStream,
                 "make_context_current": make_context_current, "check": check, "device": device,
                 "what": f"cuLaunchKernelEx({binary.name})", **consts}
    code = _launch_code(len(args), tuple(ptrs), tuple(checks), tuple(fields))
    return types.FunctionType(code.replace(co_filename=f"<fuselens launch {binary.name}>"), namespace, "launch")


@functools.cache
def _launch_code(n_args, ptrs, checks, fields):
    """The code of a launch function of this structure (make_launch gives its globals)."""
    call = "cu_launch(config_ptr, function, params, None)"
    lines = [f"def launch({', '.join(f'a{i}' for i in range(n_args))}):",
             *[f"    p{i} = a{i}.data_ptr()" for i in ptrs],
             f"    if {' or '.join(checks)}:",
             "        return False",
             # one parameter buffer and launch config per launch function (acquire/release: a
             # `with` costs 0.3 us more a launch)
             "    acquire()",
             "    try:",
             "        config.hStream = get_stream(device)",
             f"        pack(buf, 0, {', '.join(fields)})",
             f"        err = {call}",
             f"        if err == {CUDA_ERROR_INVALID_CONTEXT}:  # a thread that has not used CUDA yet",
             f"            err = make_context_current(device) or {call}",
             "    finally:",
             "        release()",
             "    if err:",
             "        check(err, what)",
             "    return True"]
    module = compile("\n".join(lines), "<fuselens launch>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))
