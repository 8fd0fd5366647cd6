"""Functions capture knows by identity: each one's call, answered in one place (kinds.py's
KnownFunction dispatches here).

- builtins whose behaviour depends on what capture models (`len` of a tensor is its size,
  `isinstance` of a graph tensor, `super()` in an inlined method, `getattr` through properties);
- questions torch.compile answers at compile time (`torch.compiler.is_compiling()`: libraries
  take their compile-friendly paths by them), telemetry, `has_torch_function`;
- calls that are a break by what they do (`print`, logging).

A handler returns its call's value, or NOT_HANDLED where these arguments are not its case (the
call then goes on as the function's kind says: `torch._assert` on a tensor is an op)."""
from __future__ import annotations

import ast
import functools
import operator
import os
import types

import torch
import torch.nn as nn
import torch.utils.checkpoint

from . import breaks as B
from . import calls as C
from . import environ, scans
from . import side_effects as S
from ..ops.autograd_function import FunctionGradient, Untraceable, trace_backward
from .frames import AbstractSeq, BreakSignal
from .graph import _map
from .guards import SRC
from .objects import foldable
from .tensors import TensorMethod
from .values import (NOT_HANDLED, UNKNOWN, BoundUserMethod, GeneratorItems, LocalFunction, SymInt, TensorVar, Unknown,
                     contains_tensor, is_array_type, leaves)


def _len(ev, fn, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.meta is None:
            return UNKNOWN
        return ev.sizes(v)[0]
    if isinstance(v, (Unknown, AbstractSeq)) or hasattr(type(v), "__fl_abstract_iter__"):
        return UNKNOWN
    if isinstance(v, environ.ENVIRONMENTS):
        return environ.read(ev, v, "__len__", [], {}, e, scope)
    if is_array_type(type(v)):  # (kinds.ArrayData: read in Python)
        return ev.domain.unknowable(ev, B.UNSUPPORTED_EXPR, e, scope, detail=f"len() of a {type(v).__name__}")
    ev.effects.observe_len(v)
    return len(v)


def _range(ev, fn, args, kwargs, e, scope):
    if any(isinstance(a, Unknown) for a in args) or TensorVar.only_assumed(args):
        return UNKNOWN
    if any(isinstance(a, TensorVar) for a in args):
        ev.brk(B.TENSOR_TO_PY, e, scope, detail="range() of a tensor")
    return range(*[ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args])


def _getattr(ev, fn, args, kwargs, e, scope):
    obj, name = args[0], args[1]
    try:
        return ev.getattr(obj, name, e, scope)
    except AttributeError:
        if len(args) > 2:
            return args[2]
        raise


def _hasattr(ev, fn, args, kwargs, e, scope):
    obj, name = args
    if isinstance(obj, Unknown):
        return UNKNOWN
    if isinstance(obj, TensorVar):
        return hasattr(torch.Tensor, name) or name in C.META_ATTRS
    if hasattr(type(obj), "__fl_abstract_getattr__"):  # the editor's stand-ins: known, or unknown
        return True if not isinstance(ev.getattr(obj, name, e, scope), Unknown) else UNKNOWN
    return ev.effects.getattr(obj, name)[0] or hasattr(obj, name)


def _minmax(ev, fn, args, kwargs, e, scope):
    items = ev.iterate(args[0], e, scope) if len(args) == 1 else list(args)
    if any(isinstance(a, TensorVar) for a in items):
        ev.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() compares tensors in Python")
    if any(isinstance(a, Unknown) for a in items):
        return UNKNOWN
    if not kwargs and items and any(isinstance(a, SymInt) for a in items):
        # the first largest (smallest) item, as Python's: each comparison guarded as a relation
        better = operator.gt if fn is max else operator.lt
        best = items[0]
        for a in items[1:]:
            if ev.sym_compare(better, a, best, e, scope) if isinstance(a, SymInt) or isinstance(best, SymInt) \
                    else better(a, best):
                best = a
        return best
    items = [ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in items]
    return fn(items, **kwargs)


def _int(ev, fn, args, kwargs, e, scope):
    """`int(n)` of a dynamic size is the size itself, still symbolic (transformers' `int(seq_len)`)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], SymInt):
        return args[0]
    return NOT_HANDLED


def _type(ev, fn, args, kwargs, e, scope):
    if len(args) != 1:
        return NOT_HANDLED  # type(name, bases, dict): a class made
    (v,) = args
    if isinstance(v, TensorVar):
        example = None if v.source is None else ev.domain.example(v.source)
        return torch.Tensor if example is None else type(example)
    if isinstance(v, Unknown):
        return UNKNOWN
    return type(v)


def _isinstance(ev, fn, args, kwargs, e, scope):
    obj, cls = args
    if isinstance(obj, TensorVar):
        types_ = cls if isinstance(cls, tuple) else (cls,)
        if any(isinstance(c, type) and issubclass(torch.Tensor, c) for c in types_):
            return True
        if nn.Parameter in types_ and obj.source is not None:
            return isinstance(ev.domain.example(obj.source), nn.Parameter)
        return False
    if isinstance(obj, (Unknown, AbstractSeq)):
        return UNKNOWN
    return isinstance(obj, cls)


def _super(ev, fn, args, kwargs, e, scope):
    """`super()` in an inlined method: the class from its `__class__` cell, the instance from its
    first parameter (what Python's zero-argument form reads from the frame)."""
    if not args:
        fs = scope.fs
        params = fs.params.posonlyargs + fs.params.args
        if "__class__" not in fs.closure or not params:
            # (the editor: a method it does not know the class of)
            return ev.domain.unknowable(ev, B.UNSUPPORTED_EXPR, e, scope, detail="super() outside a method")
        args = [fs.closure["__class__"], scope.vars.get(params[0].arg)]
    if hasattr(type(args[0]), "__fl_abstract_super__"):  # a class the editor parsed (analyze.py)
        return args[0].__fl_abstract_super__(*args[1:])
    if any(isinstance(a, Unknown) or hasattr(type(a), "__fl_abstract_getattr__") for a in args):
        return UNKNOWN  # (the editor's: what it does not know, or stands in for)
    if any(isinstance(a, TensorVar) for a in args):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() of a tensor")
    return super(*args)


def _setattr(ev, fn, args, kwargs, e, scope):
    obj, name, v = args
    if ev.effects.is_fresh(obj):
        ev.set_attribute(obj, name, v, e, scope)
        return None
    if isinstance(obj, Unknown) or hasattr(type(obj), "__fl_abstract_getattr__"):
        return None  # an object the editor only stands in for
    ev.brk(B.UNSUPPORTED_STMT, e, scope, detail=f"setattr() on a {type(obj).__name__} object from outside",
           whole_stmt=True)


def _delattr(ev, fn, args, kwargs, e, scope):
    obj, name = args
    if ev.effects.is_fresh(obj):
        deleter = type(obj).__delattr__
        if isinstance(deleter, types.FunctionType):
            return ev.inline(deleter, [name], {}, e, scope, self_value=obj)
        ev.effects.touch(obj)
        return deleter(obj, name)
    ev.brk(B.UNSUPPORTED_STMT, e, scope, detail=f"delattr() on a {type(obj).__name__} object from outside",
           whole_stmt=True)


def _callable(ev, fn, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, (LocalFunction, BoundUserMethod, TensorMethod)):
        return True  # functions of the captured code, called by evaluating them
    if isinstance(v, Unknown):
        return UNKNOWN
    return callable(v)


def _iter(ev, fn, args, kwargs, e, scope):
    if len(args) != 1:
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="iter() with a sentinel")
    items = ev.iterate(args[0], e, scope)
    if isinstance(items, AbstractSeq):
        return UNKNOWN
    it = iter(items)
    ev.effects.fresh(it)  # (capture's own: `next` takes its items; at a break, its rest is made again)
    return it


def _next(ev, fn, args, kwargs, e, scope):
    """`next()` of an iterator capture made (`iter(...)`, a generator run to its end), or of a
    generator expression written as its argument (`next(i for i in ... if ...)`: its first item)."""
    if isinstance(args[0], GeneratorItems) and not kwargs and isinstance(e, ast.Call) and e.args \
            and isinstance(e.args[0], ast.GeneratorExp) and (args[0] or len(args) == 2):
        return args[0][0] if args[0] else args[1]
    it = args[0]
    if type(it) is not S.LIST_ITERATOR or not ev.effects.is_fresh(it):
        # (one from outside, a resume's too, is Python's to advance, on every call)
        return ev.domain.unknowable(ev, B.UNSUPPORTED_EXPR, e, scope, detail=f"next() of a {type(it).__name__}")
    _, seq, *position = it.__reduce__()
    if not position or position[0] >= len(seq[0]):  # (at its end, not exhausted: a rolled-back
        if len(args) == 2:                           # statement puts it back where it was)
            return args[1]
        raise StopIteration
    ev.effects.touch(it)
    return next(it)


def _reduce(ev, fn, args, kwargs, e, scope):
    """`functools.reduce(fn, items[, initial])`: fn called item by item, as the C loop calls it."""
    if kwargs or not 2 <= len(args) <= 3:
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="functools.reduce() with keyword arguments")
    f, items = args[0], ev.iterate(args[1], e, scope)
    if isinstance(items, AbstractSeq):
        return UNKNOWN
    if len(args) == 2 and not items:
        raise TypeError("reduce() of empty iterable with no initial value")
    acc, rest = (args[2], items) if len(args) == 3 else (items[0], items[1:])
    for x in rest:
        acc = ev.call(f, [acc, x], {}, e, scope)
    return acc


def _getenv(ev, fn, args, kwargs, e, scope):
    """`os.getenv(key, default)`: `os.environ.get` (`os.getenvb`: `os.environb.get`), guarded."""
    env = os.environb if fn is getattr(os, "getenvb", None) else os.environ
    return environ.read(ev, env, "get", args, kwargs, e, scope)


def _print(ev, fn, args, kwargs, e, scope):
    ev.brk(B.PRINT, e, scope)


def _logging(ev, fn, args, kwargs, e, scope):
    ev.brk(B.LOGGING, e, scope, detail=f"call to {getattr(fn, '__qualname__', fn)}")


def _native(ev, fn, args, kwargs, e, scope):
    """Context managers of torch's modes, entered by `with` (statements.py)."""
    return fn(*args, **kwargs)


def _autocast(ev, fn, args, kwargs, e, scope):
    """`torch.autocast(...)` made as eager makes it where the walk is: without a dtype of its own
    it takes the one autocast has there (an enclosing block's), which torch's state, never set by
    capture, does not hold."""
    saved = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda")}
    try:
        for d in saved:
            torch.set_autocast_dtype(d, ev.autocast_state(d)[1])
        return fn(*args, **kwargs)
    finally:
        for d, dtype in saved.items():
            torch.set_autocast_dtype(d, dtype)


def _set_grad_enabled(ev, fn, args, kwargs, e, scope):
    """`torch.set_grad_enabled(mode)` sets grad mode when made, not when entered. As a `with`'s
    context expression, grad mode is the evaluator's state from `__enter__` (statements.py): the
    object is made here with the process's grad mode left as it was. Called on its own, it sets
    grad mode for the code after it, in the caller too: a break, Python sets it, and what follows
    is captured in that mode (every capture guards grad mode)."""
    if ev.with_expr is not e:
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="torch.set_grad_enabled() outside a `with` sets grad mode")
    prev = torch.is_grad_enabled()
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._set_grad_enabled(prev)


def _usage_log(ev, fn, args, kwargs, e, scope):
    """torch's API-usage telemetry (`torch._C._log_api_usage_once`, which torchvision calls in
    its ops): nothing a program can observe; torch.compile drops it too."""
    return None


def _torch_function_query(ev, fn, args, kwargs, e, scope):
    """`has_torch_function(args)`: capture's tensors are plain tensors (guarded by type), so the
    answer is False, as under torch.compile; torch's answer for a plain tensor not yet in the graph
    (an item of a container left by a graph break) is False too."""
    if all(isinstance(v, TensorVar) or v is None or foldable(v) or type(v) in (torch.Tensor, nn.Parameter)
           for v in leaves([args, kwargs])):
        return False
    return NOT_HANDLED


def _assert(ev, fn, args, kwargs, e, scope):
    """`torch._assert(cond, msg)` on plain values is a check now; on a tensor, an op."""
    if contains_tensor(args):
        return NOT_HANDLED
    if not args[0]:
        raise AssertionError(args[1] if len(args) > 1 else "")
    return None


_FUNCTION_APPLY = torch.autograd.Function.apply.__func__
_DEFAULT_SETUP_CONTEXT = torch.autograd.function._SingleLevelFunction.setup_context


def _is_function_apply(fn) -> bool:
    """`MyFunction.apply` of a custom `torch.autograd.Function`."""
    return isinstance(fn, types.MethodType) and getattr(fn, "__func__", None) is _FUNCTION_APPLY \
        and isinstance(fn.__self__, type) and issubclass(fn.__self__, torch.autograd.Function)


def _autograd_function_apply(ev, fn, args, kwargs, e, scope):
    """`MyFunction.apply(...)`: its `forward` (with its context object, in no-grad mode, as `apply`
    runs it), captured. Where autograd records the call (grad mode on, a tensor argument that
    requires grad), eager's gradient is the user's `backward`: traced once into a graph of its own
    and made the VJP of the forward's result (ops/autograd_function.py), so forward and backward
    each run once a step, as eager's. Where it cannot be (several outputs with gradients, a
    backward that is not straight-line torch code), the call runs eagerly behind a break."""
    cls = fn.__self__
    tensors = [v for v in leaves([args, kwargs]) if isinstance(v, TensorVar)]
    if any(t.meta is None for t in tensors):
        return UNKNOWN  # (the editor: whether autograd records the call is not known)
    recorded = ev.grad_enabled and any(t.meta.requires_grad for t in tensors)
    ctx = torch.autograd.function.FunctionCtx()
    ctx.needs_input_grad = tuple(isinstance(a, TensorVar) and a.meta.requires_grad for a in args)
    ev.effects.fresh(ctx)
    prev = ev.grad_enabled
    ev.grad_enabled = False
    try:
        with torch.no_grad():
            if cls.setup_context is _DEFAULT_SETUP_CONTEXT:
                out = ev.call(cls.forward, [ctx, *args], kwargs, e, scope)
            else:
                out = ev.call(cls.forward, list(args), kwargs, e, scope)
                ev.call(cls.setup_context, [ctx, tuple(args), out], {}, e, scope)
    except BreakSignal:
        # (a resume would continue the forward outside its no-grad mode): the call runs in Python
        ev.brk(B.AUTOGRAD_FUNCTION, e, scope, whole_stmt=True,
               detail=f"{cls.__qualname__}.forward breaks the graph")
    finally:
        ev.grad_enabled = prev
    if not recorded:
        return out
    try:
        fg, differentiable, inputs, saved = _function_gradient(cls, ctx, args, kwargs, out)
    except Untraceable as why:
        ev.brk(B.AUTOGRAD_FUNCTION, e, scope, whole_stmt=True, detail=f"{cls.__qualname__}.apply: {why}")
    y = ev.op(fg, [out if differentiable is None else out[differentiable], *inputs, *saved], {}, e, scope)
    return y if differentiable is None else type(out)(y if i == differentiable else o for i, o in enumerate(out))


def _function_gradient(cls, ctx, args, kwargs, out):
    """(FunctionGradient, the index of the differentiable output among several or None for one
    tensor, the forward's tensor arguments, the tensors its backward reads) of a call whose forward
    gave `out` and filled `ctx`; Untraceable where the graph cannot hold it."""
    if kwargs:
        raise Untraceable("keyword arguments (apply takes positional ones)")
    if getattr(ctx, "dirty_tensors", None):
        raise Untraceable("its forward marks tensors dirty (written in place)")
    grads, differentiable = (lambda g: (g,)), None
    if not isinstance(out, TensorVar):
        outs = out if type(out) in (tuple, list) else ()
        marked = [id(t) for t in getattr(ctx, "non_differentiable", None) or ()]
        free = [i for i, o in enumerate(outs) if isinstance(o, TensorVar) and o.meta.dtype.is_floating_point
                and id(o) not in marked]
        if not outs or len(free) != 1 or not all(isinstance(o, TensorVar) for o in outs):
            raise Untraceable("its forward returns other than one tensor that can have a gradient")
        differentiable = free[0]

        def grads(g):  # the others' gradients: zeros, as autograd passes for them
            return tuple(g if i == differentiable else g.new_zeros(tuple(o.meta.shape), dtype=o.meta.dtype)
                         for i, o in enumerate(outs))
    to_save = tuple(getattr(ctx, "to_save", None) or ())
    attrs = {k: v for k, v in vars(ctx).items() if k not in ("to_save", "needs_input_grad")}
    saved, index = [], {}
    for v in leaves([to_save, attrs]):
        if isinstance(v, TensorVar) and id(v) not in index:
            index[id(v)] = len(saved)
            saved.append(v)

    def make_ctx(proxies):
        sub = lambda v: _map(v, lambda x: proxies[index[id(x)]] if isinstance(x, TensorVar) else x)  # noqa: E731
        stand_in = types.SimpleNamespace(**{k: sub(v) for k, v in attrs.items()})
        stand_in.saved_tensors = stand_in.saved_variables = sub(to_save)
        stand_in.needs_input_grad = ctx.needs_input_grad
        return stand_in
    grad = (out if differentiable is None else out[differentiable]).meta
    backward = trace_backward(cls.backward, make_ctx, [v.meta for v in saved], grad, cls.__name__, grads)
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, TensorVar))
    fg = FunctionGradient(cls.__name__, backward, positions, len(saved))
    return fg, differentiable, [args[i] for i in positions], saved


def _checkpoint(ev, fn, args, kwargs, e, scope):
    """`torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=...)`: `function(*args)`,
    captured. Where autograd records, its ops are marked as one region (`GraphBuilder.recompute`)
    that the backward recomputes instead of the forward saving its values (autograd/partition.py):
    eager's memory behaviour. A break inside the function makes the call run in Python, as eager's."""
    tensors = [v for v in leaves([args, kwargs]) if isinstance(v, TensorVar)]
    options = {"context_fn", "determinism_check", "debug", "early_stop", "preserve_rng_state"}
    reentrant = kwargs.get("use_reentrant")
    if not isinstance(reentrant, bool) or reentrant and set(kwargs) - {"use_reentrant", "preserve_rng_state"} \
            or any(t.meta is None for t in tensors) or not args \
            or set(kwargs) & options - {"preserve_rng_state"}:
        return NOT_HANDLED  # (eager's warning or error, or options capture does not model)
    rest = {k: v for k, v in kwargs.items() if k != "use_reentrant" and k not in options}
    if ev.abstract or not (ev.grad_enabled and any(t.meta.requires_grad for t in tensors)):
        return ev.call(args[0], list(args[1:]), rest, e, scope)
    g = ev.g
    outer, g.regions = g.recompute, g.regions + 1
    g.recompute = g.regions
    try:
        return ev.call(args[0], list(args[1:]), rest, e, scope)
    except BreakSignal:
        ev.brk(B.UNSUPPORTED_OP, e, scope, whole_stmt=True,
               detail="a graph break inside torch.utils.checkpoint's function: the call runs in Python")
    finally:
        g.recompute = outer


def _compile_time(answer):
    def h(ev, fn, args, kwargs, e, scope):
        return answer
    return h


def _cached(ev, fn, args, kwargs, e, scope):
    """A `functools.lru_cache`/`cache` wrapper: the function it wraps is evaluated (a cache
    changes when a function runs, not what it returns)."""
    return ev.call(fn.__wrapped__, args, kwargs, e, scope)


def _marked_constant(ev, fn, args, kwargs, e, scope):
    """`torch._dynamo.assume_constant_result` marked it (transformers marks its install probes
    so): a constant of the process on constant arguments, called now as torch.compile does."""
    if ev.domain.runs_python and all(foldable(v) and not isinstance(v, (TensorVar, SymInt))
                               for v in leaves([args, kwargs])):
        return ev.run_natively(fn, args, kwargs)
    return NOT_HANDLED


_MODULE_CASTS = {nn.Module.to: None, nn.Module.float: torch.float32, nn.Module.double: torch.float64,
                 nn.Module.half: torch.float16, nn.Module.bfloat16: torch.bfloat16, nn.Module.cpu: "cpu"}


def _module_cast(ev, fn, args, kwargs, e, scope):
    """`module.to(dtype)`, `.float()`, `.cpu()` in a forward (a router's
    `self.classifier.to(self.dtype)`, a no-op after the first call): where it changes none of
    the module's parameters and buffers it is the module itself, their dtypes and devices
    guarded; one it would change (eager converts the model's own weights mid-call) runs in Python."""
    mod, cast = fn.__self__, _MODULE_CASTS[fn.__func__]
    if not ev.domain.runs_python:
        return mod  # (the editor does not know the weights' dtypes: no break to claim)
    if not all(foldable(v) for v in leaves([args, kwargs])):
        return NOT_HANDLED  # (`.to(other_tensor)`: its dtype and device, Python's to read)
    if fn.__func__ is nn.Module.to:
        try:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except TypeError:
            return NOT_HANDLED  # (eager's error, raised by the inlined code)
        if memory_format is not None or dtype is not None and not dtype.is_floating_point:
            return NOT_HANDLED  # (a complex or integer dtype: eager's warning or error, as it gives it)
    elif args or kwargs:
        return NOT_HANDLED
    else:
        device, dtype = (torch.device(cast), None) if cast == "cpu" else (None, cast)
    now = _tensor_kinds(mod)  # (a floating dtype converts floating-point and complex tensors)
    if any(device is not None and dev != device or dtype is not None and (dt.is_floating_point or dt.is_complex)
           and dt != dtype for dt, dev in now):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"`.{fn.__name__}()` converts the module's parameters "
                                                     "(convert the model once, before calling it)")
    src = ev.domain.source(ev, mod) or ev.domain.constant(mod, type(mod).__name__)
    ev.domain.guard(f"{ev.domain.constant(_tensor_kinds, 'tensor_kinds')}({SRC}) == "
                    f"{ev.domain.constant(now, 'tensor_kinds_now')}",
                    f"{src}'s parameters and buffers keep their dtypes and devices", src)
    return mod


def _tensor_kinds(mod) -> tuple:
    return tuple((t.dtype, t.device) for t in [*mod.parameters(), *mod.buffers()])


KNOWN = {len: _len, range: _range, int: _int, getattr: _getattr, hasattr: _hasattr, min: _minmax, max: _minmax,
         type: _type, isinstance: _isinstance, super: _super, iter: _iter, next: _next, callable: _callable,
         setattr: _setattr, delattr: _delattr, functools.reduce: _reduce, print: _print,
         torch.no_grad: _native, torch.enable_grad: _native, torch.set_grad_enabled: _set_grad_enabled,
         torch.autocast: _autocast, torch._C._log_api_usage_once: _usage_log, torch._assert: _assert,
         torch.utils.checkpoint.checkpoint: _checkpoint, os.getenv: _getenv}
if hasattr(os, "getenvb"):
    KNOWN[os.getenvb] = _getenv
if scans.ASSOCIATIVE_SCAN is not None:
    KNOWN[scans.ASSOCIATIVE_SCAN] = scans.associative_scan
KNOWN.update({f: _torch_function_query for f in C.TORCH_FUNCTION_QUERIES})
KNOWN.update({f: _compile_time(True) for f in C.IS_COMPILING})
KNOWN.update({f: _compile_time(False) for f in C.NOT_TRACING})
_BY_ID = {id(f): (f, h) for f, h in KNOWN.items()}
_dynamo_known = False


def _know_dynamo() -> bool:
    """Adds torch._dynamo's functions once something has imported it (calls.loaded_dynamo);
    whether it added them now."""
    global _dynamo_known
    if _dynamo_known or C.loaded_dynamo() is None:
        return False
    _dynamo_known = True
    _BY_ID.update({id(f): (f, _compile_time(True)) for f in C.dynamo_is_compiling()})
    return True


def known_handler(fn):
    """The handler of a function capture knows (None for any other): by identity (an
    unhashable callable is no error), or by what marks it (a cache wrapper, a marked constant,
    a logging call)."""
    hit = _BY_ID.get(id(fn))
    if hit is None and _know_dynamo():
        hit = _BY_ID.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    if isinstance(fn, functools._lru_cache_wrapper):
        return _cached
    if C.marked_constant(fn):
        return _marked_constant
    if C.is_logging_call(fn):
        return _logging
    if _is_function_apply(fn):
        return _autograd_function_apply
    if isinstance(fn, types.MethodType) and isinstance(fn.__self__, nn.Module) and fn.__func__ in _MODULE_CASTS:
        return _module_cast
    return None
