"""fuselens: a PyTorch compiler written from scratch (capture with graph breaks, ahead-of-time
autograd, fusion, Triton codegen). Public API: compile, explain, inspect."""
from __future__ import annotations

# first: it sets TRITON_INTERPRET under FUSELENS_INTERPRET=1, before torch may import triton
from . import settings  # noqa: F401

import types  # noqa: E402

import torch.nn as nn  # noqa: E402

from . import log  # noqa: E402,F401  (FUSELENS_LOG)
from .capture.breaks import GraphBreak, GraphBreakError
from .capture.source import NoSourceError, function_source
from .errors import FuselensWarning, InternalError
from .explain import Explanation, format_break
from .inspect import inspect  # noqa: F401  (the function; its types are fuselens.inspect's)
from .runtime.compiled import (CompiledFunction, CompiledModule, CompiledWrapper, collecting, compiled_module,
                               compiled_of)
from .runtime.distributed import call_with_forward, is_ddp

__all__ = ["compile", "compile_in_place", "explain", "inspect", "GraphBreak", "GraphBreakError", "Explanation",
           "FuselensWarning", "InternalError", "NoSourceError", "CompiledModule"]

_MODES = ("default", "reduce-overhead", "max-autotune")


def compile(fn_or_module=None, *, mode="default", fullgraph=False, dynamic=None):
    """Compile a function or an nn.Module; usable as `@compile` or `@compile(mode=...)`.
    A module gives a `CompiledModule` that shares its parameters and buffers and runs its
    forward compiled; the module itself stays eager (`compile_in_place` compiles it instead)."""
    _check_mode(mode)
    if fn_or_module is None:
        return lambda f: compile(f, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(fn_or_module, (CompiledFunction, CompiledModule)):
        return fn_or_module
    if isinstance(fn_or_module, nn.Module):
        return compiled_module(fn_or_module, lambda forward: CompiledFunction(
            forward, mode=mode, fullgraph=fullgraph, dynamic=dynamic))
    if isinstance(fn_or_module, types.MethodType):  # a bound method: compile its function
        return CompiledFunction(fn_or_module.__func__, mode=mode, fullgraph=fullgraph,
                                dynamic=dynamic).__get__(fn_or_module.__self__)
    if not callable(fn_or_module):
        raise TypeError(f"fuselens.compile expects a function or an nn.Module, got "
                        f"{type(fn_or_module).__name__}")
    return CompiledFunction(fn_or_module, mode=mode, fullgraph=fullgraph, dynamic=dynamic)


def compile_in_place(module: nn.Module, *, mode="default", fullgraph=False, dynamic=None) -> nn.Module:
    """Compile `module`'s forward in place (as `nn.Module.compile()` does) and return the module:
    its calls run compiled, its parameters, state_dict and train/eval mode are untouched."""
    _check_mode(mode)
    if not isinstance(module, nn.Module):
        raise TypeError(f"fuselens.compile_in_place expects an nn.Module, got {type(module).__name__}; "
                        "use fuselens.compile for a function")
    if is_ddp(module):  # DDP's forward stays (runtime/distributed.py): the module it wraps is compiled
        compile_in_place(module.module, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
        return module
    cf = CompiledFunction(type(module).forward, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    module.forward = cf.__get__(module)
    module._fuselens_compiled = cf
    return module


def _check_mode(mode):
    if mode not in _MODES:
        raise ValueError(f"fuselens.compile: unknown mode {mode!r}; use one of {', '.join(_MODES)}")


def explain(fn, *args, **kwargs) -> Explanation:
    """Run `fn(*args, **kwargs)` once while capturing; report graphs, breaks and guards. Given
    what `fuselens.compile` returned, already called, and no arguments: report what its calls so
    far compiled, each entry's graphs and breaks, why each recompile happened, the dims made
    dynamic, and whether the recompile limit sent it to eager (a function of no arguments not
    yet called is run, as any other)."""
    cf = compiled_of(fn) if not args and not kwargs else None
    log = cf.all_entries() if cf is not None else []
    if log or (cf is not None and cf.disabled):
        return Explanation([g for e in log for g in e.graphs], [e.graph_break for e in log if e.graph_break is not None],
                           [g for e in log for g in e.guards], log, disabled=cf.disabled)
    if isinstance(fn, types.MethodType):  # a bound method (compiled or not)
        fn, args = fn.__func__, (fn.__self__,) + args
    cf = compiled_of(fn)
    target = fn
    if cf is not None:
        target = cf.original
        if isinstance(fn, CompiledModule):
            args = (fn._orig_mod,) + args
        elif isinstance(fn, nn.Module):
            args = (fn,) + args
    elif isinstance(fn, nn.Module):
        target = type(fn).forward
        args = (fn,) + args
    function_source(target)  # a clear NoSourceError for functions without source
    fresh = CompiledFunction(target)
    with collecting() as log:
        if isinstance(fn, CompiledWrapper):  # DDP's forward or FSDP2's hooks around it
            call_with_forward(fn._orig_mod, fn.__dict__["_fuselens_wrapped"], fresh, args[1:], kwargs)
        else:
            fresh(*args, **kwargs)
    if fresh.disabled:
        raise InternalError(f"fuselens.explain: {fresh.disabled}")
    graphs = [g for e in log for g in e.graphs]
    breaks = [e.graph_break for e in log if e.graph_break is not None]
    guards = [g for e in log for g in e.guards]
    return Explanation(graphs, breaks, guards, list(log))

