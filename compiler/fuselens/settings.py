"""What the environment decides for the whole compiler: whether kernels run in Triton's
interpreter, the cache directory, whether compiled programs are kept on disk, and the compiler's
version (the key of everything kept there).

Imports nothing but the standard library at import time: the language server reads the cache
directory from it before it may import torch (server/fuselens_lsp/initialize_cache.py).

FUSELENS_INTERPRET=1 runs every kernel in Triton's interpreter (CPU tensors included, unless
FUSELENS_CPU_BACKEND says otherwise: `CPU_BACKEND` below). Triton
decides interpreted vs compiled for its own library functions (`tl.rand`, ...) when it is first
imported, so importing this module sets TRITON_INTERPRET=1 (fuselens/__init__.py imports it before
torch, which may import triton); importing triton yourself earlier in that process requires
TRITON_INTERPRET=1 to be set already.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import sys
import tempfile

INTERPRET = os.environ.get("FUSELENS_INTERPRET", "") not in ("", "0")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

# what runs the kernels of graphs on CPU tensors: "cpp" (generated C++ built by the system compiler,
# codegen/cpp.py), "interpret" (the Triton kernels in Triton's interpreter) or "eager" (the graph as
# plain PyTorch). FUSELENS_CPU_BACKEND chooses; by default the interpreter under FUSELENS_INTERPRET=1, else C++.
CPU_BACKEND = os.environ.get("FUSELENS_CPU_BACKEND") or ("interpret" if INTERPRET else "cpp")
if CPU_BACKEND not in ("cpp", "interpret", "eager"):
    raise ValueError(f"FUSELENS_CPU_BACKEND={CPU_BACKEND!r}: expected cpp, interpret or eager")
if CPU_BACKEND == "interpret" and not INTERPRET:
    raise ValueError("FUSELENS_CPU_BACKEND=interpret needs FUSELENS_INTERPRET=1 (Triton's interpreter is set up at import)")


def triton_kernels(device) -> bool:
    """Whether graphs on `device` run as Triton kernels (CUDA, and CPUs under the interpreter):
    where a gather is a load in its consumer's kernel (lower/rules.py `_gathered`); beside the
    C++ kernels it is ATen's call."""
    return device.type == "cuda" or (device.type == "cpu" and CPU_BACKEND == "interpret")


def gathers_in_kernels(device, *shapes) -> bool:
    """Whether a gather (an embedding or a `gather`) of these static shapes on `device` is loads in
    its consumer's kernel, reading its positions there (lower/rules.py `_gathered`), not an extern
    call."""
    return triton_kernels(device) and all(isinstance(n, int) for shape in shapes for n in shape)


def cache_dir(create: bool = True) -> str:
    """Where fuselens keeps what it compiled (kernels, cubins, autotuning, programs, captures) and
    the language server its answers: FUSELENS_CACHE_DIR, else `<tmp>/fuselens-<user>`."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")  # (Windows)
    path = os.environ.get("FUSELENS_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"fuselens-{user}")
    if create:
        os.makedirs(path, exist_ok=True)
    return path


def program_cache_enabled() -> bool:
    """FUSELENS_PROGRAM_CACHE=0: nothing compiled is read from or written to disk (programs,
    captures, autocast's answers)."""
    return os.environ.get("FUSELENS_PROGRAM_CACHE", "1") != "0"


def native_guards() -> bool:
    """FUSELENS_NATIVE_GUARDS=0: every guard is checked in Python (runtime/native_guards.py checks
    an entry's tensor guards and its guards over modules in C++)."""
    return os.environ.get("FUSELENS_NATIVE_GUARDS", "1") != "0"


def ddp_split() -> bool:
    """FUSELENS_DDP_SPLIT=0: a graph captured inside DistributedDataParallel's forward stays one
    graph instead of one piece per gradient bucket (runtime/ddp_buckets.py; bench/distributed.py
    compares the two)."""
    return os.environ.get("FUSELENS_DDP_SPLIT", "1") != "0"


@functools.cache
def compiler_version() -> str:
    """The compiler's hash: fuselens's own source and the versions of what it runs on (torch,
    triton, Python, the interpreter flag). What is kept on disk is kept under it."""
    import torch  # (not at import: see the module's text)
    import triton
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr((torch.__version__, triton.__version__, sys.version, INTERPRET)).encode())
    return h.hexdigest()[:24]
