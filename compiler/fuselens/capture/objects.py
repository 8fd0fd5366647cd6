"""Python objects: attribute and item access, calls dispatched by what is called (inlined Python
functions, modules, builtins, methods of containers, pure functions folded on constants), and
the builtins with tensor-aware behaviour."""
from __future__ import annotations

import copy
import inspect
import math
import operator
import sys
import types
from functools import partial as functools_partial

import torch
import torch.nn as nn

from . import breaks as B
from . import calls as C
from . import side_effects as S
from .side_effects import MUTABLE
from .source import FunctionSource
from .values import (UNKNOWN, BoundUserMethod, LocalFunction, SymInt, TensorVar, Unknown,
                     contains_tensor, leaves)
from .frames import AbstractSeq
from .tensors import TensorMethod


class Objects:
    """Mixin of `Evaluator` (evaluator.py)."""

    def getattr(self, obj, attr, e, scope):
        if isinstance(obj, Unknown):
            return UNKNOWN
        if isinstance(obj, TensorVar):
            return self.tensor_attr(obj, attr, e, scope)
        if isinstance(obj, AbstractSeq):
            return UNKNOWN
        assigned, v = self.effects.getattr(obj, attr)
        if assigned:
            return v
        if isinstance(obj, nn.Module):
            return self.module_attr(obj, attr, e, scope)
        try:
            v = getattr(obj, attr)
        except AttributeError:
            raise
        if isinstance(obj, types.ModuleType):
            if self.abstract:
                return v
            if isinstance(v, torch.Tensor) or type(v) in MUTABLE:
                src = self.sources.attr_source(obj, attr)
                return self.wrap_external(v, src)
            return v
        src = self.value_sources.get(id(obj))
        if src is not None and not self.abstract and not isinstance(v, torch.Tensor) \
                and not isinstance(obj, (type, types.FunctionType)):
            self.sources.guard_value(f"{src}.{attr}", v)
        if type(v) in MUTABLE and not self.abstract:
            if src is None:  # found through an object of no source: that very object
                src = self.sources.constant(obj, type(obj).__name__)
            return self.wrap_external(v, f"{src}.{attr}")
        if isinstance(v, torch.Tensor):
            if src is None:
                if self.abstract:
                    return TensorVar(None, None, None)
                src = self.sources.constant(v, f"{type(obj).__name__}_{attr}")
                return self.input(v, src)
            return self.input(v, f"{src}.{attr}")
        if src is not None and not isinstance(v, (int, float, str, bool, type(None))):
            self.value_sources[id(v)] = f"{src}.{attr}"
        return v

    def module_attr(self, mod, attr, e, scope):
        if self.abstract:
            return getattr(mod, attr)
        src = self.value_sources.get(id(mod)) or self.sources.constant(mod, type(mod).__name__)
        self.value_sources[id(mod)] = src
        v = getattr(mod, attr)
        if attr == "training":
            self.sources.guard(f"{src}.training is {v}", f"{src}.training (train/eval mode)")
        elif isinstance(v, torch.Tensor):
            return self.input(v, f"{src}.{attr}")
        elif isinstance(v, (int, float, bool, str, type(None))):
            # hyper-parameters such as Dropout.p: constants, guarded by value
            self.sources.guard(f"{src}.{attr} == {v!r}", f"{src}.{attr} (module attribute)")
        elif isinstance(v, nn.Module):
            self.value_sources[id(v)] = f"{src}.{attr}"
            self.sources.guard_module(v, f"{src}.{attr}")
        elif type(v) in MUTABLE or isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v):
            return self.wrap_external(v, f"{src}.{attr}")
        return v

    def getitem(self, obj, idx, e, scope):
        if isinstance(obj, TensorVar):
            if isinstance(idx, TensorVar) and idx.is_bool:
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            if isinstance(idx, tuple) and any(isinstance(i, TensorVar) and i.is_bool for i in idx):
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            return self.op(operator.getitem, [obj, idx], {}, e, scope)
        if isinstance(obj, (Unknown, AbstractSeq)) or isinstance(idx, Unknown):
            return obj.item() if isinstance(obj, AbstractSeq) else UNKNOWN
        if isinstance(idx, SymInt):
            idx = self.specialize(idx, e, scope)
        if isinstance(obj, nn.Module):  # ModuleList / Sequential / ModuleDict
            v = obj[idx]
            if isinstance(v, nn.Module) and not self.abstract:
                src = self.value_sources.get(id(obj))
                if src is not None:
                    self.value_sources[id(v)] = f"{src}[{idx!r}]"
            return v
        if isinstance(idx, TensorVar):
            self.brk(B.TENSOR_TO_PY, e, scope, detail="indexing a Python container with a tensor")
        self.effects.observe_item(obj, idx)
        return obj[idx]

    def call(self, fn, args, kwargs, e, scope):
        if isinstance(fn, TensorMethod):
            return self.tensor_method(fn.t, fn.name, args, kwargs, e, scope)
        if isinstance(fn, Unknown):
            if any(isinstance(a, TensorVar) for a in args):
                return TensorVar(None, None, None)  # abstract: probably a tensor function
            return UNKNOWN
        if isinstance(fn, (LocalFunction, FunctionSource)):
            return self.inline(fn, args, kwargs, e, scope)
        if hasattr(type(fn), "__fl_abstract_call__"):  # the editor's stand-ins (analyze.py)
            return fn.__fl_abstract_call__(self, args, kwargs, e, scope)
        if isinstance(fn, BoundUserMethod):
            return self.inline(fn.fn, args, kwargs, e, scope, self_value=fn.self_value)
        if C.compile_time_answer(fn) is not None:
            return C.compile_time_answer(fn)
        if C.is_usage_log(fn):
            return None
        if C.is_torch_function_query(fn) and all(
                isinstance(v, TensorVar) or v is None or foldable(v) for v in leaves([args, kwargs])):
            return False
        if fn is torch._assert and not contains_tensor(args):  # a check on plain values
            if not args[0]:
                raise AssertionError(args[1] if len(args) > 1 else "")
            return None
        if fn is print:
            self.brk(B.PRINT, e, scope)
        if C.is_logging_call(fn):
            self.brk(B.LOGGING, e, scope, detail=f"call to {getattr(fn, '__qualname__', fn)}")
        if isinstance(fn, nn.Module):
            return self.call_module(fn, args, kwargs, e, scope)
        if fn is isinstance:
            return self.isinstance_(args, e, scope)
        if fn in (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.autocast):
            return fn(*args, **kwargs)  # context managers, entered by `with`
        if fn in _BUILTIN_HANDLERS:
            return _BUILTIN_HANDLERS[fn](self, args, kwargs, e, scope)
        if C.is_torch_callable(fn):
            if isinstance(fn, types.FunctionType) and not contains_tensor([args, kwargs]):
                # torch's own Python helpers on plain values (`F._canonical_mask(None, ...)`,
                # `F._none_or_dtype(None)`) are code like the user's: what they touch decides
                return self.inline(fn, args, kwargs, e, scope)
            return self.torch_call(fn, args, kwargs, e, scope)
        if isinstance(fn, types.MethodType) and isinstance(fn.__self__, nn.Module):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.MethodType) and not isinstance(fn.__func__, types.BuiltinFunctionType):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.BuiltinMethodType) and isinstance(fn.__self__, MUTABLE):
            return self.container_method(fn, args, kwargs, e, scope)
        if isinstance(fn, types.BuiltinMethodType) and type(fn.__self__) in _IMMUTABLE:
            return self.fold(fn, args, kwargs, e, scope)  # `name.startswith("x")`, `"{}".format(n)`
        if isinstance(fn, types.FunctionType) and _stdlib(fn) and not self.abstract and not any(
                contains_tensor(v) or type(v) in MUTABLE or isinstance(v, (Unknown, SymInt))
                for v in list(args) + list(kwargs.values())):
            return fn(*args, **kwargs)  # the standard library on plain values (inspect, re...)
        if isinstance(fn, (types.FunctionType,)):
            return self.inline(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and issubclass(fn, (int, float, bool, str, tuple, list, dict, set,
                                                   range, slice, enumerate, zip, reversed)):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, (torch.dtype, torch.device)):
            self.brk(B.UNSUPPORTED_EXPR, e, scope)
        if isinstance(fn, functools_partial):
            return self.call(fn.func, list(fn.args) + list(args), {**fn.keywords, **kwargs}, e, scope)
        if C.is_pure_foldable(fn):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and fn.__module__.startswith("torch"):
            # constructing torch objects (Size, dtype, device...) with constant args
            if not any(contains_tensor(a) for a in args):
                return fn(*args, **kwargs)
        if isinstance(fn, type):  # a class with Python source: the object runs in Python
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"creating a `{fn.__qualname__}` object")
        self.brk(B.UNKNOWN_CALL, e, scope,
                 detail=f"call to {getattr(fn, '__qualname__', type(fn).__name__)}")

    def container_method(self, fn, args, kwargs, e, scope):
        """list.append, dict.get...: on the capture's containers (its own, or models of the
        real ones, side_effects.py), mutations logged."""
        obj, name = fn.__self__, fn.__name__
        if args and isinstance(args[0], SymInt) and isinstance(obj, list) and name in _INDEXED:
            args = [self.specialize(args[0], e, scope)] + list(args[1:])  # a position
        if type(obj) in MUTABLE:
            if name == "get" and args and args[0] in obj:
                self.effects.observe_item(obj, args[0])
            elif name not in _BLIND_WRITES and not (name == "__setitem__" and isinstance(obj, dict)):
                self.effects.observe(obj)
            return self.effects.call(obj, name, args, kwargs)
        # a subclass (OrderedDict, defaultdict...) from outside, not modelled: run on a copy,
        # and a call that would change it runs in Python
        dup = copy.copy(obj)
        before = S.contents(dup)
        r = getattr(dup, name)(*args, **kwargs)
        if S.changed(dup, before):
            self.brk(B.UNKNOWN_CALL, e, scope,
                     detail=f"{type(obj).__name__}.{fn.__name__}() changes an object from outside")
        return r

    def require_foldable(self, vals, e, scope):
        """Folding is sound only for values guarded by value: an opaque object (a NumPy array,
        say) is guarded by its type alone, so computing with it must happen in Python."""
        for v in vals:
            if not foldable(v) and not self.abstract:
                self.brk(B.UNSUPPORTED_EXPR, e, scope,
                         detail=f"operation on a {type(v).__name__} object")

    def fold(self, fn, args, kwargs, e, scope):
        """A pure Python function: evaluated now if its arguments are known."""
        vals = list(args) + list(kwargs.values())
        if any(isinstance(a, Unknown) for a in vals):
            return UNKNOWN
        if fn not in (isinstance, type, id, callable, hasattr, getattr):
            self.require_foldable(vals, e, scope)
            for v in vals:
                self.effects.observe(v)
        if any(isinstance(a, TensorVar) for a in vals) or fn is sum and contains_tensor(vals):
            if fn in (int, float, bool, complex):
                self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() of a tensor")
            if fn in (tuple, list) and len(args) == 1:
                return fn(self.iterate(args[0], e, scope))
            if fn is len and len(args) == 1 and isinstance(args[0], TensorVar):
                if args[0].meta is None:
                    return UNKNOWN
                return self.sizes(args[0])[0]
            if fn in (enumerate, zip, reversed, sorted) and not any(isinstance(a, TensorVar) for a in args):
                return list(fn(*args, **kwargs))
            if fn in (enumerate, zip, reversed):
                return list(fn(*[self.iterate(a, e, scope) if isinstance(a, TensorVar) else a for a in args]))
            if fn is math.sqrt or fn in (abs, pow, max, min, round):
                m = {abs: torch.abs, pow: torch.pow}.get(fn)
                if m is not None:
                    return self.op(m, args, kwargs, e, scope)
            if fn in (tuple, list) or fn in (enumerate, zip):
                return fn(*args)
            if fn is sum:
                acc = args[1] if len(args) > 1 else 0
                for x in self.iterate(args[0], e, scope):
                    acc = self.binop("Add", acc, x, e, scope)
                return acc
            self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{getattr(fn, '__name__', fn)}() of a tensor")
        args = [self.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args]
        containers = [(a, S.contents(a)) for a in args if type(a) in MUTABLE]
        r = fn(*args, **kwargs)
        for a, before in containers:
            if S.changed(a, before):  # operator.setitem, operator.iadd...: Python makes it
                S.restore(a, before)
                self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{getattr(fn, '__name__', fn)}() "
                         "changes its argument")
        if isinstance(r, (zip, map, filter, enumerate, reversed)) or type(r).__name__.endswith("iterator"):
            return list(r)
        return r

    def isinstance_(self, args, e, scope):
        obj, cls = args
        if isinstance(obj, TensorVar):
            types_ = cls if isinstance(cls, tuple) else (cls,)
            if any(isinstance(c, type) and issubclass(torch.Tensor, c) for c in types_):
                return True
            if nn.Parameter in types_ and obj.source is not None and not self.abstract:
                return isinstance(self.sources.resolve(obj.source), nn.Parameter)
            return False
        if isinstance(obj, (Unknown, AbstractSeq)):
            return UNKNOWN
        return isinstance(obj, cls)

    def call_module(self, mod, args, kwargs, e, scope):
        if mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "_backward_hooks", None):
            self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{type(mod).__name__} has hooks")
        if not self.abstract:
            src = self.value_sources.get(id(mod))
            if src is None:
                src = self.sources.constant(mod, type(mod).__name__)
                self.value_sources[id(mod)] = src
            # identity and .training, however the module was reached (a global, a list item)
            self.sources.guard_module(mod, src)
        fwd = type(mod).forward
        return self.inline(fwd, args, kwargs, e, scope, self_value=mod)


# container methods whose effect and result do not depend on the contents: a model only
# written this way needs no guard on them (a global log keeps one cache entry)
_BLIND_WRITES = {"append", "extend", "insert", "add", "update", "clear", "discard"}


_INDEXED = {"pop", "insert", "__getitem__", "__setitem__", "__delitem__"}  # list methods: arg 0


FOLDABLE_ATOMS = (int, float, complex, bool, str, bytes, type(None), range, slice, torch.dtype,
                   torch.device, torch.memory_format, torch.layout, type, types.FunctionType,
                   types.BuiltinFunctionType, types.ModuleType, nn.Module, TensorVar, SymInt,
                   Unknown, LocalFunction, BoundUserMethod, type(Ellipsis), types.MethodType,
                   BaseException,  # an exception capture raised and a captured handler took
                   inspect.Parameter)


# values whose methods compute a new value and change nothing: called on constants, they fold
_IMMUTABLE = (str, bytes, int, float, complex, bool, tuple, frozenset, range, type(None))


def _stdlib(fn) -> bool:
    """A function of Python's standard library (its module is one of `sys.stdlib_module_names`)."""
    return (getattr(fn, "__module__", None) or "").split(".")[0] in sys.stdlib_module_names


def user_mapping(v) -> bool:
    """An object of a user class that answers `in` itself (transformers' AttentionInterface)."""
    cls = type(v)
    return cls.__module__ not in ("builtins", "torch") and hasattr(cls, "__contains__") \
        and not isinstance(v, (TensorVar, Unknown, nn.Module))


def foldable(v) -> bool:
    if isinstance(v, FOLDABLE_ATOMS):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):  # torch.Size too
        return all(foldable(x) for x in v)
    if isinstance(v, (dict, types.MappingProxyType)):
        return all(foldable(k) and foldable(x) for k, x in v.items())
    return type(v).__module__ in ("enum",) or isinstance(v, __import__("enum").Enum)


# builtins with tensor-aware behaviour
def _b_len(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.meta is None:
            return UNKNOWN
        return ev.sizes(v)[0]
    if isinstance(v, (Unknown, AbstractSeq)):
        return UNKNOWN
    ev.effects.observe_len(v)
    return len(v)


def _b_range(ev, args, kwargs, e, scope):
    if any(isinstance(a, Unknown) for a in args):
        return UNKNOWN
    if any(isinstance(a, TensorVar) for a in args):
        ev.brk(B.TENSOR_TO_PY, e, scope, detail="range() of a tensor")
    return range(*[ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in args])


def _b_getattr(ev, args, kwargs, e, scope):
    obj, name = args[0], args[1]
    try:
        return ev.getattr(obj, name, e, scope)
    except AttributeError:
        if len(args) > 2:
            return args[2]
        raise


def _b_hasattr(ev, args, kwargs, e, scope):
    obj, name = args
    if isinstance(obj, Unknown):
        return UNKNOWN
    if isinstance(obj, TensorVar):
        return hasattr(torch.Tensor, name) or name in C.META_ATTRS
    return ev.effects.getattr(obj, name)[0] or hasattr(obj, name)


def _b_minmax(fn):
    def h(ev, args, kwargs, e, scope):
        items = ev.iterate(args[0], e, scope) if len(args) == 1 else list(args)
        if any(isinstance(a, TensorVar) for a in items):
            ev.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() compares tensors in Python")
        if any(isinstance(a, Unknown) for a in items):
            return UNKNOWN
        items = [ev.specialize(a, e, scope) if isinstance(a, SymInt) else a for a in items]
        return fn(items, **kwargs)
    return h


def _b_type(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.source is not None and not ev.abstract:
            return type(ev.sources.resolve(v.source))
        return torch.Tensor
    if isinstance(v, Unknown):
        return UNKNOWN
    return type(v)


def _b_super(ev, args, kwargs, e, scope):
    """`super()` in an inlined method: the class from its `__class__` cell, the instance from its
    first parameter (what Python's zero-argument form reads from the frame)."""
    if not args:
        fs = scope.fs
        params = fs.params.posonlyargs + fs.params.args
        if "__class__" not in fs.closure or not params:
            ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() outside a method")
        args = [fs.closure["__class__"], scope.vars.get(params[0].arg)]
    if any(isinstance(a, (TensorVar, Unknown)) for a in args):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() of a tensor")
    return super(*args)


def _b_iter_next(ev, args, kwargs, e, scope):
    ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="iter()/next()")


_BUILTIN_HANDLERS = {len: _b_len, range: _b_range, getattr: _b_getattr, hasattr: _b_hasattr,
                     min: _b_minmax(min), max: _b_minmax(max), type: _b_type, super: _b_super,
                     next: _b_iter_next}
