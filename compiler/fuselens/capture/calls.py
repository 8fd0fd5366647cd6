"""What the evaluator knows about callables: which are tensor ops, which break the graph,
which are pure Python functions it may fold on constants."""
from __future__ import annotations

import builtins
import logging
import math
import operator
import sys
import types
import warnings

import torch

from . import breaks as B

# Tensor methods that read data into Python: method name -> break kind.
DATA_READS = {"item": B.ITEM, "tolist": B.TOLIST, "numpy": B.NUMPY}

# Tensor attributes/methods that return Python values about the tensor's metadata.
META_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                "element_size", "get_device", "is_floating_point", "is_complex", "data_ptr"}
META_ATTRS = {"shape", "dtype", "device", "ndim", "requires_grad", "layout", "is_leaf"}

# Pure functions folded when every argument is a known constant.
_PURE_BUILTINS = {
    abs, all, any, bool, callable, chr, divmod, enumerate, float, format, frozenset, hash, int,
    isinstance, issubclass, len, list, max, min, ord, pow, range, repr, reversed, round, set,
    slice, sorted, str, sum, tuple, type, zip, dict, getattr, hasattr, iter, next, map, filter,
    id,
}
_PURE_MODULES = {"math", "operator", "_operator", "functools", "itertools", "builtins", "string"}


_PURE_BUILTIN_IDS = {id(f) for f in _PURE_BUILTINS}  # (by identity: an unhashable callable is no error)


def is_pure_foldable(fn) -> bool:
    if id(fn) in _PURE_BUILTIN_IDS:
        return True
    if isinstance(fn, types.BuiltinMethodType) and id(fn.__self__) in _PURE_BUILTIN_IDS:
        return True  # a class method of a pure type: `dict.fromkeys`, `int.from_bytes`, `float.fromhex`
    mod = getattr(fn, "__module__", None)
    if mod in _PURE_MODULES:
        return True
    return isinstance(fn, types.BuiltinFunctionType) and any(getattr(fn, "__self__", None) is m for m in (math, operator))  # `in` would call ndarray.__eq__


def is_numpy_function(fn) -> bool:
    """A ufunc (`np.sqrt`) or an array function of NumPy's API (`np.prod`, `np.clip`): each a
    computation on its arguments alone, but those writing files (`np.save`)."""
    t = type(fn)
    return t.__module__ == "numpy" and t.__name__ in ("ufunc", "_ArrayFunctionDispatcher") and \
        getattr(getattr(fn, "_implementation", None), "__module__", "") not in _NUMPY_IO


_NUMPY_IO = ("numpy.lib._npyio_impl",)


def is_torch_callable(fn) -> bool:
    """A function or builtin of the torch namespace (an op for the graph), not a Module."""
    if isinstance(fn, type):
        return False
    if isinstance(getattr(fn, "__self__", None), torch.nn.Module):
        return False  # a module's own method (ModuleDict.items, ...): inlined, not an op
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if getattr(fn, "__fl_source__", None) is not None:
        return False  # a continuation fuselens generated (for a frame of torch's own modules too)
    mod = getattr(fn, "__module__", None) or ""
    if mod == "torch" or mod.startswith("torch.") or mod.startswith("torch._C"):
        # a Python function of torch's is an op only where the graph can name it, as its code
        # will (`torch.nn.functional.relu`); a lambda or local function (OpInfo's `op=lambda`)
        # is Python to inline
        return not isinstance(fn, types.FunctionType) or _named(fn) and not inlined_composite(fn) \
            and not _module_method(fn)
    self_ = getattr(fn, "__self__", None)
    if isinstance(self_, types.ModuleType) and self_.__name__.startswith("torch"):
        return True
    qual = getattr(fn, "__qualname__", "")
    return qual.startswith("TensorBase.") or qual.startswith("Tensor.")


def inlined_composite(fn) -> bool:
    """A Python function of `torch.nn.functional` that no decomposition handles
    (`multi_head_attention_forward`, `normalize`, the losses written in Python): its body of torch
    ops is captured, as torch.compile inlines it, so they fuse and differentiate as ops; as one
    extern call it ran unfused and its backward re-ran it under torch's autograd."""
    from ..ops.decompositions import DECOMPOSITIONS  # (ops imports capture's siblings only)
    return fn.__module__ == "torch.nn.functional" and fn not in DECOMPOSITIONS


def _module_method(fn) -> bool:
    """A method of one of torch's nn.Module classes called through its class
    (`nn.LayerNorm.forward(self, x)`, as SqueezeBERT does): Python to inline, as a module's call."""
    owner = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return isinstance(owner, type) and issubclass(owner, torch.nn.Module)


def _named(fn) -> bool:
    """`fn` is reached from its module by its name or qualified name (Tensor's Python methods)."""
    mod = sys.modules.get(fn.__module__)
    if mod is None:
        return False
    if getattr(mod, fn.__name__, None) is fn or fn.__qualname__.startswith(("Tensor.", "TensorBase.")):
        return True
    obj = mod
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def is_logging_call(fn) -> bool:
    if fn is warnings.warn or fn is warnings.warn_explicit:
        return True
    self_ = getattr(fn, "__self__", None)
    if isinstance(self_, (logging.Logger, logging.LoggerAdapter)):
        return True
    return getattr(fn, "__module__", None) == "logging" and not isinstance(fn, type)


# questions about torch's global state, answered by running them (each changes nothing; grad mode,
# autocast and the default dtype are guarded; no dispatch mode is active inside compiled code)
# (autocast's are the evaluator's: tensors.AUTOCAST_QUERIES)
STATE_QUERIES = {torch.get_default_dtype, torch.is_grad_enabled, torch._C._len_torch_dispatch_stack,
                 torch.is_inference_mode_enabled}


def marked_constant(fn) -> bool:
    """`fn`'s result is a constant of the process: `torch._dynamo.assume_constant_result` marked
    it (transformers marks its install probes so), and torch.compile calls it at trace time."""
    return getattr(fn, "_dynamo_marked_constant", False) is True


def compile_disabled(fn) -> bool:
    """`torch.compiler.disable` (or `torch._dynamo.disable`, `skip`) marked `fn` (a method: its
    function), so it runs eagerly behind a graph break, as torch.compile runs it. The editor's
    functions carry the mark as parsed from their decorators (analyze.py)."""
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):  # a FunctionSource the editor parsed
        return getattr(fn, "compile_disabled", False) is True
    return fn.__dict__.get("_torchdynamo_disable") is True


def fsdp_unit(mod) -> bool:
    """A module FSDP2's `fully_shard` manages: its hooks are collectives and parameter swaps,
    which run in Python around its forward compiled on its own (runtime/distributed.py)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (imported where a module is sharded)
    return fsdp is not None and isinstance(mod, fsdp.FSDPModule)


def loaded_dynamo():
    """`torch._dynamo` once something imported it, else None. Importing it takes ~2 s, more than
    the rest of capture after torch (the editor waits for it before its first diagnostics), and
    capture only recognises a few of its functions: a value that is one exists only after the
    import, so those are looked up here, when needed, instead of at import. None too while
    another thread is still importing it (the module is in sys.modules before its names are: the
    editor's analysis of a quick fix read `torch._dynamo.disable` then and failed)."""
    dyn = sys.modules.get("torch._dynamo")
    return None if dyn is None or getattr(getattr(dyn, "__spec__", None), "_initializing", False) else dyn


def disable_decorators() -> set:
    """The decorators that make that mark, as the editor resolves them from a file's source."""
    dyn = loaded_dynamo()
    return {torch.compiler.disable} | ({dyn.disable} if dyn is not None else set())


# `has_torch_function(args)`: does an argument override torch functions? (builtins.py)
TORCH_FUNCTION_QUERIES = {torch._C._has_torch_function, torch._C._has_torch_function_unary,
                          torch._C._has_torch_function_variadic}

# TorchScript's, the JIT tracer's and torch.export's "am I being scripted/traced/exported?":
# False under torch.compile, as compile-time answers (builtins.py)
NOT_TRACING = {torch.jit.is_scripting, torch.jit.is_tracing, torch._C._get_tracing_state}
if hasattr(torch.compiler, "is_exporting"):
    NOT_TRACING.add(torch.compiler.is_exporting)


IS_COMPILING = {torch.compiler.is_compiling}
try:  # an older spelling users still write (and torch._dynamo.is_compiling: dynamo_is_compiling)
    IS_COMPILING.add(torch.compiler.is_dynamo_compiling)
except AttributeError:
    pass


def dynamo_is_compiling() -> set:
    """`torch._dynamo.is_compiling` once torch._dynamo is imported (see loaded_dynamo)."""
    fn = getattr(loaded_dynamo(), "is_compiling", None)
    return {fn} if fn is not None else set()

# Operators of the `ast` nodes, as Python functions (on tensors they become graph ops).
BINOPS = {
    "Add": operator.add, "Sub": operator.sub, "Mult": operator.mul, "Div": operator.truediv,
    "FloorDiv": operator.floordiv, "Mod": operator.mod, "Pow": operator.pow,
    "MatMult": operator.matmul, "BitAnd": operator.and_, "BitOr": operator.or_,
    "BitXor": operator.xor, "LShift": operator.lshift, "RShift": operator.rshift,
}
INPLACE_BINOPS = {
    "Add": "add_", "Sub": "sub_", "Mult": "mul_", "Div": "div_", "Pow": "pow_",
    "BitAnd": "bitwise_and_", "BitOr": "bitwise_or_", "BitXor": "bitwise_xor_",
    "FloorDiv": "floor_divide_", "Mod": "remainder_",
}
UNARYOPS = {"USub": operator.neg, "UAdd": operator.pos, "Invert": operator.invert,
            "Not": operator.not_}
CMPOPS = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le,
          "Gt": operator.gt, "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
          "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b}

# the operator functions of Python's syntax on tensors (`functools.reduce(operator.mul, ts)`,
# `compare(draw, p)` with `compare = operator.lt`): recorded as the syntax is
SYNTAX_FUNCTIONS = set(BINOPS.values()) | {CMPOPS[k] for k in ("Eq", "NotEq", "Lt", "LtE", "Gt", "GtE")} | {
    operator.neg, operator.pos, operator.invert}

BUILTINS = builtins
