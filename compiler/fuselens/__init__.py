"""fuselens: a PyTorch compiler written from scratch (capture with graph breaks, ahead-of-time
autograd, fusion, Triton codegen). Public API: compile, explain, inspect."""
from __future__ import annotations

import os

if os.environ.get("FUSELENS_INTERPRET", "") not in ("", "0"):
    # Triton picks interpreted or compiled library functions when first imported (and
    # importing torch's own modules below may import it): decide before anything does.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import types  # noqa: E402

import torch.nn as nn  # noqa: E402

from . import log  # noqa: E402,F401  (FUSELENS_LOG)
from .capture.breaks import GraphBreak, GraphBreakError
from .capture.source import NoSourceError, function_source
from .explain import Explanation, format_break
from .runtime.compiled import CompiledFunction, collecting
from .runtime.errors import FuselensWarning, InternalError

__all__ = ["compile", "explain", "inspect", "GraphBreak", "GraphBreakError", "Explanation",
           "FuselensWarning", "InternalError", "NoSourceError"]

_MODES = ("default", "reduce-overhead", "max-autotune")


def compile(fn_or_module=None, *, mode="default", fullgraph=False, dynamic=None):
    """Compile a function or an nn.Module; usable as `@compile` or `@compile(mode=...)`.
    A module is returned as itself with its forward compiled (parameters, state_dict and
    train/eval are untouched)."""
    if mode not in _MODES:
        raise ValueError(f"fuselens.compile: unknown mode {mode!r}; use one of {', '.join(_MODES)}")
    if fn_or_module is None:
        return lambda f: compile(f, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(fn_or_module, CompiledFunction):
        return fn_or_module
    if isinstance(fn_or_module, nn.Module):
        mod = fn_or_module
        cf = CompiledFunction(type(mod).forward, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
        mod.forward = cf.__get__(mod)
        mod._fuselens_compiled = cf
        return mod
    if isinstance(fn_or_module, types.MethodType):  # a bound method: compile its function
        return CompiledFunction(fn_or_module.__func__, mode=mode, fullgraph=fullgraph,
                                dynamic=dynamic).__get__(fn_or_module.__self__)
    if not callable(fn_or_module):
        raise TypeError(f"fuselens.compile expects a function or an nn.Module, got "
                        f"{type(fn_or_module).__name__}")
    return CompiledFunction(fn_or_module, mode=mode, fullgraph=fullgraph, dynamic=dynamic)


def _compiled_of(obj) -> CompiledFunction | None:
    if isinstance(obj, CompiledFunction):
        return obj
    if isinstance(obj, nn.Module):
        return getattr(obj, "_fuselens_compiled", None)
    bound = getattr(obj, "__func__", None)
    return bound if isinstance(bound, CompiledFunction) else None


def explain(fn, *args, **kwargs) -> Explanation:
    """Run `fn(*args, **kwargs)` once while capturing; report graphs, breaks and guards."""
    if isinstance(fn, types.MethodType):  # a bound method (compiled or not)
        fn, args = fn.__func__, (fn.__self__,) + args
    cf = _compiled_of(fn)
    target = fn
    if cf is not None:
        target = cf.original
        if isinstance(fn, nn.Module):
            args = (fn,) + args
    elif isinstance(fn, nn.Module):
        target = type(fn).forward
        args = (fn,) + args
    function_source(target)  # a clear NoSourceError for functions without source
    fresh = CompiledFunction(target)
    with collecting() as log:
        fresh(*args, **kwargs)
    if fresh.disabled:
        raise InternalError(f"fuselens.explain: {fresh.disabled}")
    graphs = [g for e in log for g in e.graphs]
    breaks = [e.graph_break for e in log if e.graph_break is not None]
    guards = [g for e in log for g in e.guards]
    return Explanation(graphs, breaks, guards, list(log))


from .inspect import inspect  # noqa: E402  (the function; its types are fuselens.inspect's)
