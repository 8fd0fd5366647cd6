"""The program cache: what the backend made of a captured graph, kept on disk for later processes.

A graph's compile (primitive graph, joint graph and partition, lowering, scheduling, codegen) is
the same in every process that captures the same graph for the same inputs, so its result is
stored under a hash of everything that decides it: the graph (each node's target, arguments and
metadata: shapes, strides, dtypes, requires_grad, source locations), the inputs' layouts,
devices and requires_grad, the dynamic dims, the grad mode, autocast and default dtype, the
mode, and the compiler itself (fuselens's source, torch's, triton's and Python's versions, the
GPU's compute capability, the environment variables codegen reads). A hit makes the programs
again from their sources (the wrapper's code marshalled, the kernels' source: backend/driver.py
`load_program`); Triton's
compile of the kernels is cached apart, by codegen/launcher.py and cuda.py.

The entries live beside the kernel cache: `$FUSELENS_CACHE_DIR/programs` (default
`<tmp>/fuselens-<uid>/programs`); FUSELENS_PROGRAM_CACHE=0 turns the cache off. An entry is one
file written whole (a temporary file, then a rename), so concurrent processes see an entry
complete or not at all; one that cannot be read, checked (a checksum of its contents) or loaded
is ignored with a debug message on `fuselens.runtime`, and the graph compiles (and is stored
again). A graph whose contents have no stable name (a lambda, an object that cannot be pickled)
is compiled and not stored.
"""
from __future__ import annotations

import contextlib
import copyreg
import functools
import hashlib
import io
import logging
import marshal
import os
import pickle
import sys
import threading
import types

import torch
import torch.fx as fx

from .. import settings

FORMAT = b"fuselens-program-1\n"
_log = logging.getLogger("fuselens.runtime")


def directory(folder="programs") -> str:
    path = os.path.join(settings.cache_dir(), folder)
    os.makedirs(path, exist_ok=True)
    return path


class Unstable(Exception):
    """Part of the graph has no name that another process would give it too."""


def _environment() -> tuple:
    """The FUSELENS_ variables that change what is compiled, as they are now (lowering reads
    FUSELENS_CONV_LAYOUT at each compile: a snapshot of the first key's would outlive a change)."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FUSELENS_")
                        and k not in ("FUSELENS_CACHE_DIR", "FUSELENS_LOG", "FUSELENS_PROGRAM_CACHE",
                                     "FUSELENS_CAPTURE_CACHE")))


@functools.cache
def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def qualified_name(fn) -> tuple[str, str] | None:
    """(module, name) that finds `fn` again in another process (`getattr` down the name from the
    module), or None (a lambda, a bound method). The name is its qualified name, or else the
    module's attribute that it is: `torch.addmm` (qualified `_VariableFunctionsClass.addmm`),
    `F.max_pool2d` (made inside torch's `boolean_dispatch`, renamed). A method descriptor
    (`Tensor.view`) is found from its class's module; an ATen operator (`aten::add.Tensor`, what
    in-place calls are functionalized to) from `torch.ops`."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return "torch.ops", str(fn).replace("::", ".")
    owner = getattr(fn, "__objclass__", None)
    module = getattr(owner if owner is not None else fn, "__module__", None) or ""
    mod = sys.modules.get(module)
    qualname = getattr(fn, "__qualname__", None)
    if mod is None or not isinstance(qualname, str):
        return None
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is fn:
        return module, qualname
    name = getattr(fn, "__name__", None)
    return (module, name) if isinstance(name, str) and getattr(mod, name, None) is fn else None


def _operator(name: str):
    """torch.ops.<namespace>.<op>[.<overload>] by its name (`aten.add.Tensor`)."""
    obj = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles ATen operators (which have no pickle support) by name, without registering that
    for the whole process (copyreg)."""
    dispatch_table = copyreg.dispatch_table.copy()
    for _cls in (torch._ops.OpOverload, torch._ops.OpOverloadPacket):
        dispatch_table[_cls] = lambda op: (_operator, (str(op),))


def _pickle(obj) -> bytes:
    f = io.BytesIO()
    _Pickler(f, protocol=4).dump(obj)
    return f.getvalue()


def _function(fn):
    """A Python function by the name that finds it again, and its code."""
    name = qualified_name(fn)
    if name is None:
        raise Unstable(f"function {fn.__qualname__}")
    return ("function", *name, hashlib.sha256(marshal.dumps(fn.__code__)).hexdigest(),
            _canonical(fn.__defaults__), _canonical(fn.__kwdefaults__))


def _canonical(v):
    """`v` as plain data that is equal in two processes exactly where `v` is."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return (type(v).__name__, repr(v))
    if isinstance(v, fx.Node):
        return ("node", v.name)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_canonical(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((_canonical(k), _canonical(x)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted((_canonical(x) for x in v), key=repr)))
    if isinstance(v, torch.Tensor) and v.device.type == "meta":  # a node's value: its layout is what counts
        return ("tensor", str(tuple(v.shape)), str(v.stride()), str(v.dtype), v.requires_grad, v.storage_offset())
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format, slice, type(...))):
        return (type(v).__name__, repr(v))
    if isinstance(v, torch.SymInt):  # its hint: a dynamic dim is in the key on its own
        return ("symint", str(v))
    if isinstance(v, types.FunctionType):
        return _function(v)
    try:  # by name (builtins, classes, op overloads) or by state (OnCopies, a real tensor)
        return ("pickle", _pickle(v))
    except Exception as e:
        raise Unstable(f"{type(v).__name__} ({e})") from None


def key(gm: fx.GraphModule, inputs, mode, dynamic_dims) -> str | None:
    """The cache key of compiling `gm` for these inputs in the current grad/autocast state, or None
    where the cache is off or the graph has no stable key (logged)."""
    if not settings.program_cache_enabled():
        return None
    try:
        nodes = tuple((n.op, n.name, _canonical(n.target), _canonical(n.args), _canonical(dict(n.kwargs)),
                       _canonical(dict(sorted(n.meta.items())))) for n in gm.graph.nodes)
        layouts = tuple(
            ("tensor", tuple(t.shape), t.stride(), str(t.dtype), str(t.device), t.requires_grad,
             _capability(t.device)) if isinstance(t, torch.Tensor) else _canonical(t) for t in inputs)
        state = (torch.is_grad_enabled(), str(torch.get_default_dtype()), mode, _canonical(dynamic_dims),
                 tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda")),
                 torch.is_autocast_cache_enabled())
        data = pickle.dumps((nodes, layouts, state, _environment()), protocol=4)
    except Unstable as e:
        _log.debug("program cache: graph not stored (%s has no stable name)", e)
        return None
    return hashlib.sha256(FORMAT + settings.compiler_version().encode() + data).hexdigest()


def load(k: str, kind: type, folder="programs"):
    """The entry stored under `k` (an instance of `kind`), or None: absent, or unreadable (logged).
    `folder`: which of the caches kept beside the kernels' (`captures`: runtime/capture_cache.py)."""
    try:
        with open(os.path.join(directory(folder), k), "rb") as f:
            blob = f.read()
    except OSError:  # absent (or no cache directory can be made)
        return None
    try:
        head, digest, payload = blob[:len(FORMAT)], blob[len(FORMAT):len(FORMAT) + 32], blob[len(FORMAT) + 32:]
        if head != FORMAT or hashlib.sha256(payload).digest() != digest:
            raise ValueError("not an entry of this format, or its checksum differs")
        entry = pickle.loads(payload)
        if not isinstance(entry, kind):
            raise TypeError(f"a {type(entry).__name__}, not a {kind.__name__}")
        return entry
    except Exception as e:  # corrupt, or made by a compiler whose objects no longer load
        _log.debug("%s cache: entry %s ignored (%s: %s)", folder, k, type(e).__name__, e)
        return None


def store(k: str, entry, folder="programs") -> None:
    """Write the entry under `k` whole (or not at all): a failure costs the next process a compile."""
    try:
        payload = _pickle(entry)
    except Exception as e:  # a constant of the program that cannot be pickled
        _log.debug("%s cache: entry %s not stored (%s: %s)", folder, k, type(e).__name__, e)
        return
    tmp = None
    try:
        path = os.path.join(directory(folder), k)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(FORMAT + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as e:
        _log.debug("%s cache: entry %s not stored (%s)", folder, k, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
