"""Python objects: attribute and item access, calls dispatched by what is called (inlined Python
functions, modules, builtins, methods of containers, pure functions folded on constants), and
the builtins with tensor-aware behaviour."""
from __future__ import annotations

import ast
import collections.abc
import copy
import dataclasses
import functools
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
from .source import FunctionSource, NoSourceError, function_source
from .values import (UNKNOWN, BoundUserMethod, ForeignData, LocalFunction, SymInt, TensorVar, Unknown,
                     contains_tensor, leaves)
from .frames import AbstractSeq
from .statements import MAX_UNROLL
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
        if hasattr(type(obj), "__fl_abstract_getattr__"):  # the editor's stand-ins (analyze.py)
            return obj.__fl_abstract_getattr__(self, attr, e, scope)
        assigned, v = self.effects.getattr(obj, attr)
        if assigned:
            return v
        if isinstance(obj, nn.Module):
            return self.module_attr(obj, attr, e, scope)
        if not isinstance(obj, type):
            # a property is code like any other: evaluated (natively it would read the real
            # objects, not the capture's models of them, and guard nothing)
            desc = inspect.getattr_static(type(obj), attr, None)
            if isinstance(desc, property) and isinstance(desc.fget, types.FunctionType) \
                    and not _no_source(desc.fget):
                return self.inline(desc.fget, [], {}, e, scope, self_value=obj)
        if self.effects.is_fresh(obj):
            return getattr(obj, attr)  # the capture's own object: what it holds, as is
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
        src = self.value_sources.get(obj)
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
            self.value_sources.set(v, f"{src}.{attr}")
        return v

    def module_attr(self, mod, attr, e, scope):
        if self.abstract or self.effects.is_fresh(mod):
            return getattr(mod, attr)
        src = self.value_sources.get(mod) or self.sources.constant(mod, type(mod).__name__)
        self.value_sources.set(mod, src)
        v = getattr(mod, attr)
        if attr == "training":
            self.sources.guard(f"{src}.training is {v}", f"{src}.training (train/eval mode)")
        elif isinstance(v, torch.Tensor):
            return self.input(v, f"{src}.{attr}")
        elif isinstance(v, (int, float, bool, str, type(None))):
            # hyper-parameters such as Dropout.p: constants, guarded by value
            self.sources.guard(f"{src}.{attr} == {v!r}", f"{src}.{attr} (module attribute)")
        elif isinstance(v, nn.Module):
            self.value_sources.set(v, f"{src}.{attr}")
            self.sources.guard_module(v, f"{src}.{attr}")
        elif type(v) in MUTABLE or isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v):
            return self.wrap_external(v, f"{src}.{attr}")
        elif hasattr(v, "__dict__") and not callable(v) and not isinstance(v, types.ModuleType):
            # an object the module holds (a config): found there on each call, guarded by its
            # type; what capture reads of it is guarded where it is read (getattr)
            self.sources.guard_value(f"{src}.{attr}", v)
            self.value_sources.set(v, f"{src}.{attr}")
        return v

    def getitem(self, obj, idx, e, scope):
        if isinstance(obj, TensorVar):
            if isinstance(idx, TensorVar) and idx.is_bool:
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            if isinstance(idx, tuple) and any(isinstance(i, TensorVar) and i.is_bool for i in idx):
                self.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
            return self.op(operator.getitem, [obj, idx], {}, e, scope)
        if isinstance(obj, (Unknown, AbstractSeq)) or isinstance(idx, Unknown):
            return obj.item() if isinstance(obj, AbstractSeq) else ForeignData.merge(obj) or UNKNOWN
        if isinstance(idx, SymInt):
            idx = self.specialize(idx, e, scope)
        if isinstance(obj, nn.Module):  # ModuleList / Sequential / ModuleDict
            v = obj[idx]
            if isinstance(v, nn.Module) and not self.abstract:
                src = self.value_sources.get(obj)
                if src is not None:
                    self.value_sources.set(v, f"{src}[{idx!r}]")
                    if isinstance(idx, slice):  # (a new container each time the guards read it:
                        # its modules are found by their positions in the one they came from)
                        for j, m in zip(range(len(obj))[idx], v):
                            self.value_sources.set(m, f"{src}[{j}]")
            return v
        if self.effects.is_fresh(obj):
            return self.call_special(obj, "__getitem__", [idx], e, scope)
        if isinstance(idx, TensorVar):
            self.brk(B.TENSOR_TO_PY, e, scope, detail="indexing a Python container with a tensor")
        self.effects.observe_item(obj, idx)
        return obj[idx]

    # -- objects of Python classes that the captured code makes ---------------------------------
    def new_object(self, cls, args, kwargs, e, scope):
        """`cls(...)` for a class of Python code (a dataclass, transformers' `ModelOutput` and
        caches): the object is allocated here and its `__init__` evaluated like any code. The
        capture owns it (side_effects.py): it may hold tensors of the graph, its changes are
        undone with a rolled-back statement, and it is rebuilt where it escapes."""
        if type(cls).__call__ is not type.__call__ or issubclass(cls, (nn.Module, BaseException)):
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"creating a `{cls.__qualname__}` object")
        if isinstance(cls.__new__, types.FunctionType):
            if issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(*args, **kwargs)  # a named tuple: its generated __new__ packs its arguments
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"`{cls.__qualname__}` has its own __new__")
        obj = cls.__new__(cls)
        self.effects.fresh(obj)
        init = cls.__init__
        if not isinstance(init, types.FunctionType):  # object.__init__, dict.__init__: C code
            self.effects.touch(obj)
            init(obj, *args, **kwargs)
        elif dataclass_generated_init(init, obj):
            self.dataclass_init(obj, args, kwargs, init, e, scope)
        else:
            self.inline(init, args, kwargs, e, scope, self_value=obj)
        return obj

    def iterate_object(self, v, node, scope):
        """The items of an object of a Python class: its own `__iter__` evaluated (a generator
        runs to its end), or the sequence protocol (`v[0]`, `v[1]`... until IndexError) where
        its class has none or takes `collections.abc.Sequence`'s. None: not iterable here."""
        it = inspect.getattr_static(type(v), "__iter__", None)
        if isinstance(it, types.FunctionType) and it is not collections.abc.Sequence.__iter__ \
                and not _no_source(it):
            return self.iterate(self.inline(it, [], {}, node, scope, self_value=v), node, scope)
        if (it is None or it is collections.abc.Sequence.__iter__) \
                and isinstance(inspect.getattr_static(type(v), "__getitem__", None), types.FunctionType):
            items = []
            for i in range(MAX_UNROLL + 1):
                try:
                    items.append(self.getitem(v, i, node, scope))
                except IndexError:
                    return items
            self.brk(B.UNROLLABLE_LOOP, node, scope, whole_stmt=True,
                     detail=f"more than {MAX_UNROLL} items of {type(v).__name__}")
        return None

    def dataclass_init(self, obj, args, kwargs, init, e, scope):
        """What the `__init__` that `@dataclass` generates (it has no source) does: each field
        from its argument, default or factory, through the class's own `__setattr__` unless
        frozen, then `__post_init__` with the InitVar arguments."""
        cls = type(obj)
        if not self.effects.is_fresh(obj):
            self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{cls.__qualname__}.__init__ on an object from outside")
        sig = inspect.signature(init)
        bound = sig.bind(obj, *args, **kwargs)  # a TypeError here is eager's too
        bound.apply_defaults()
        values = dict(list(bound.arguments.items())[1:])
        frozen = cls.__dataclass_params__.frozen
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, f in fields.items():
            if f.init:
                v = values[name]
                if v is sig.parameters[name].default and f.default_factory is not dataclasses.MISSING:
                    v = self.call(f.default_factory, [], {}, e, scope)
            elif f.default is not dataclasses.MISSING:
                v = f.default
            elif f.default_factory is not dataclasses.MISSING:
                v = self.call(f.default_factory, [], {}, e, scope)
            else:
                continue
            if frozen:
                self.effects.touch(obj)
                object.__setattr__(obj, name, v)
            else:
                self.set_attribute(obj, name, v, e, scope)
        if hasattr(cls, "__post_init__"):
            initvars = [v for k, v in values.items() if k not in fields]
            self.call(self.getattr(obj, "__post_init__", e, scope), initvars, {}, e, scope)

    def call_special(self, obj, name, args, e, scope):
        """`obj[k]`, `obj[k] = v`, `del obj[k]` on a fresh object: the class's own method
        evaluated, or its builtin base's run on it (a C method only stores or reads)."""
        method = getattr(type(obj), name)
        if isinstance(method, types.FunctionType):
            return self.inline(method, args, {}, e, scope, self_value=obj)
        self.effects.touch(obj)
        return method(obj, *args)

    def assign_attribute(self, obj, attr, v, e, scope):
        """`obj.attr = v`: on a fresh object, made here; on an object from outside (found at a
        source), its class's own `__setattr__` evaluated (a config's), a plain store logged and
        replayed by the transformed function (side_effects.py)."""
        if self.effects.is_fresh(obj):
            self.set_attribute(obj, attr, v, e, scope)
            return
        src = None if self.abstract else self.value_sources.get(obj)
        if src is not None or self.abstract:
            setter = type(obj).__setattr__
            if isinstance(setter, types.FunctionType) and not isinstance(obj, (nn.Module, type)) \
                    and not _no_source(setter):
                self.inline(setter, [attr, v], {}, e, scope, self_value=obj)
                return
            if S.plain_setattr(obj, attr):
                self.effects.setattr(obj, src, attr, v)
                return
        self.brk(B.UNSUPPORTED_STMT, e, scope, detail=f"attribute assignment `.{attr} = ...`",
                 whole_stmt=True)

    def set_attribute(self, obj, attr, v, e, scope):
        """`obj.attr = v` on a fresh object: through the class's own `__setattr__` or property
        setter (evaluated), else stored."""
        setter = type(obj).__setattr__
        if isinstance(setter, types.FunctionType):
            self.inline(setter, [attr, v], {}, e, scope, self_value=obj)
            return
        desc = inspect.getattr_static(type(obj), attr, None)
        if isinstance(desc, property) and isinstance(desc.fset, types.FunctionType):
            self.inline(desc.fset, [v], {}, e, scope, self_value=obj)
            return
        self.effects.touch(obj)
        setter(obj, attr, v)

    def call(self, fn, args, kwargs, e, scope):
        if self.foreign and (isinstance(fn, TensorMethod) or C.is_torch_callable(fn) or isinstance(fn, type)
                             and fn.__module__.startswith("torch")):
            self.foreign_reaches_torch([args, kwargs])
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
        if C.cache_wrapper(fn) is not None:
            return self.call(C.cache_wrapper(fn), args, kwargs, e, scope)
        if C.marked_constant(fn) and not self.abstract and all(foldable(v) and not isinstance(v, (
                TensorVar, SymInt)) for v in leaves([args, kwargs])):
            return fn(*args, **kwargs)
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
            if self.abstract and isinstance(fn, (types.FunctionType, types.MethodType)) \
                    and not contains_tensor([args, kwargs]):
                # the editor does not walk torch's own Python on plain values (`torch.compile`
                # itself): what it would find there is torch's, not the user's, and depends on state
                return UNKNOWN
            if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType) \
                    and not isinstance(fn.__self__, (TensorVar, torch.Tensor)) and not contains_tensor([args, kwargs]):
                # a method of one of torch's Python objects (`no_grad().clone()`, which a
                # `@torch.no_grad()` decorator calls): code like the user's
                return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
            if isinstance(fn, types.FunctionType) and not contains_tensor([args, kwargs]):
                # torch's own Python helpers on plain values (`F._canonical_mask(None, ...)`,
                # `F._none_or_dtype(None)`) are code like the user's: what they touch decides
                return self.inline(fn, args, kwargs, e, scope)
            return self.torch_call(fn, args, kwargs, e, scope)
        if isinstance(fn, types.MethodType) and isinstance(fn.__self__, nn.Module):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.MethodType) and not isinstance(fn.__func__, types.BuiltinFunctionType):
            return self.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        owner = _c_method_self(fn, args)
        if owner is not None and getattr(fn, "__name__", "") == "__setattr__" and len(args) >= 2 \
                and not self.effects.is_fresh(owner) and not isinstance(owner, (nn.Module, type)):
            # object.__setattr__, reached from a class's own __setattr__ (`super().__setattr__`):
            # the store itself, on an object from outside
            name, v = args[-2:]
            src = None if self.abstract else self.value_sources.get(owner)
            if src is None and not self.abstract:
                self.brk(B.UNSUPPORTED_STMT, e, scope, whole_stmt=True,
                         detail=f"attribute assignment `.{name} = ...` on an object of no known source")
            self.effects.setattr(owner, src, name, v)
            return None
        if owner is not None and getattr(fn, "__name__", "") == "__getattribute__" and len(args) >= 1 \
                and not self.effects.is_fresh(owner) and not isinstance(owner, (nn.Module, type)):
            return self.getattr(owner, args[-1], e, scope)  # `super().__getattribute__(name)`: a read
        if owner is not None and self.effects.is_fresh(owner):
            # object.__setattr__, OrderedDict.__setitem__, dict.keys... (often through super())
            # on an object the capture made: C code storing or reading references runs as is
            self.effects.touch(owner)
            return fn(*args, **kwargs)
        if isinstance(fn, types.BuiltinMethodType) and isinstance(fn.__self__, MUTABLE):
            return self.container_method(fn, args, kwargs, e, scope)
        if isinstance(fn, types.BuiltinMethodType) and type(fn.__self__) in _IMMUTABLE:
            return self.fold(fn, args, kwargs, e, scope)  # `name.startswith("x")`, `"{}".format(n)`
        if isinstance(fn, types.FunctionType) and _stdlib(fn) and not self.abstract and not any(
                contains_tensor(v) or type(v) in MUTABLE or isinstance(v, (Unknown, SymInt))
                for v in list(args) + list(kwargs.values())):
            r = fn(*args, **kwargs)  # the standard library on plain values (inspect, re...)
            if fn in (copy.copy, copy.deepcopy) and r is not args[0] and hasattr(r, "__dict__") \
                    and not isinstance(r, (torch.Tensor, nn.Module, type, types.FunctionType)):
                self.effects.fresh(r)  # a new object: the capture's own, as eager makes one each call
            return r
        if isinstance(fn, (types.FunctionType,)):
            return self.inline(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and issubclass(fn, (int, float, bool, str, tuple, list, dict, set,
                                                   range, slice, enumerate, zip, reversed)) \
                and not _runs_python(fn):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, (torch.dtype, torch.device)):
            self.brk(B.UNSUPPORTED_EXPR, e, scope)
        if isinstance(fn, functools_partial):
            return self.call(fn.func, list(fn.args) + list(args), {**fn.keywords, **kwargs}, e, scope)
        if C.is_pure_foldable(fn):
            return self.fold(fn, args, kwargs, e, scope)
        if isinstance(fn, type) and fn.__module__.startswith("torch"):
            # constructing torch objects (Size, dtype, device, a parameterless module...) with
            # constant args
            if not any(contains_tensor(a) for a in args):
                if self.abstract and any(isinstance(v, Unknown) for v in leaves([args, kwargs])):
                    return self.abstract_torch_object(fn, e, scope)
                r = fn(*args, **kwargs)
                if isinstance(r, nn.Module):
                    if any(True for _ in r.parameters()) or any(True for _ in r.buffers()):
                        self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=(
                            f"a new `{fn.__name__}` with parameters on each call (make it in __init__)"))
                    self.effects.fresh(r)  # the capture's own, as eager makes one on each call
                return r
        if isinstance(fn, type):
            return self.new_object(fn, args, kwargs, e, scope)
        if self.abstract and not contains_tensor([args, kwargs]):
            if not _c_callable(fn) or self.uncertain:
                return UNKNOWN  # on values the editor does not know (a library's object): silent
            # capture breaks here (it cannot see into C code): claimed where the result reaches
            # torch (ForeignData), not on NumPy work of its own
            self.foreign = True
            return ForeignData.merge(*leaves([args, kwargs]), extra=[B.make_break(
                B.UNKNOWN_CALL, self.loc(e, scope), stack=self.stack(scope), function=scope.fs.qualname,
                detail=f"call to {getattr(fn, '__qualname__', type(fn).__name__)}")])
        self.brk(B.UNKNOWN_CALL, e, scope,
                 detail=f"call to {getattr(fn, '__qualname__', type(fn).__name__)}")

    def foreign_reaches_torch(self, values):
        """Abstract domain: NumPy's data (ForeignData) among `values` reaches torch: the breaks
        of the calls that made it are claimed."""
        for v in leaves(values):
            for b in (v.breaks if isinstance(v, ForeignData) else ()):
                self.on_break(b)

    def abstract_torch_object(self, cls, e, scope):
        """Abstract domain: a torch class made from arguments the editor does not know. A module
        whose `__init__` makes parameters or buffers on every path, and a class with its own
        `__new__` (`nn.Parameter`), break where the concrete domain breaks on them."""
        if issubclass(cls, nn.Module):
            if _makes_state(cls):
                self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=(
                    f"a new `{cls.__name__}` with parameters on each call (make it in __init__)"))
        elif isinstance(cls.__new__, types.FunctionType):
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"`{cls.__qualname__}` has its own __new__")
        return UNKNOWN

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
        if fn in (tuple, list, enumerate, zip, reversed) and args:
            # they move items, not read them: the items come from capture's own iteration (a
            # tensor's rows, an object's `__iter__` evaluated), whatever they are
            n = len(args) if fn is zip else 1
            seqs = [self.iterate(a, e, scope) for a in args[:n]]
            if any(isinstance(q, AbstractSeq) for q in seqs):  # abstract: of unknown length
                one = [q.item() if isinstance(q, AbstractSeq) else UNKNOWN for q in seqs]
                return AbstractSeq((UNKNOWN, one[0]) if fn is enumerate else tuple(one) if fn is zip
                                   else one[0])
            r = fn(*seqs, *args[n:], **kwargs)
            return r if fn in (tuple, list) else list(r)
        if fn in (sum, any, all, sorted, set, frozenset) and args:  # they read items one by one
            args = [self.iterate(args[0], e, scope), *args[1:]]
            vals = list(args) + list(kwargs.values())
        if fn is dict and len(args) == 1 and not isinstance(args[0], dict):
            return dict(self.iterate(args[0], e, scope), **kwargs)  # pairs: `dict(obj.items())`
        if fn not in (isinstance, type, id, callable, hasattr, getattr):
            self.require_foldable(vals, e, scope)
            for v in vals:
                self.effects.observe(v)
        if any(isinstance(a, TensorVar) for a in vals) or fn is sum and contains_tensor(vals):
            if fn in (int, float, bool, complex):
                self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{fn.__name__}() of a tensor")
            if fn is len and len(args) == 1 and isinstance(args[0], TensorVar):
                if args[0].meta is None:
                    return UNKNOWN
                return self.sizes(args[0])[0]
            if fn is sorted and not any(isinstance(a, TensorVar) for a in args):
                return list(fn(*args, **kwargs))
            if fn is math.sqrt or fn in (abs, pow, max, min, round):
                m = {abs: torch.abs, pow: torch.pow}.get(fn)
                if m is not None:
                    return self.op(m, args, kwargs, e, scope)
            if fn is sum:
                acc = args[1] if len(args) > 1 else 0
                for x in self.iterate(args[0], e, scope):
                    acc = self.binop("Add", acc, x, e, scope)
                return acc
            if fn in C.SYNTAX_FUNCTIONS and not kwargs:
                return self.op(fn, list(args), {}, e, scope)
            if fn is operator.getitem and len(args) == 2 and not kwargs:
                return self.getitem(args[0], args[1], e, scope)
            self.brk(B.TENSOR_TO_PY, e, scope, detail=f"{getattr(fn, '__name__', fn)}() of a tensor")
        if fn in (map, filter) and args and isinstance(args[0], LocalFunction):
            # a function of the evaluated code (`filter(lambda x: ..., xs)`): called item by item
            f, columns = args[0], [self.iterate(a, e, scope) for a in args[1:]]
            if fn is map:
                return [self.call(f, list(t), {}, e, scope) for t in zip(*columns)]
            return [x for x in columns[0]
                    if self.truth(self.call(f, [x], {}, e, scope), e, scope, kind=B.DATA_IF)]
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
        if not self.abstract and not self.effects.is_fresh(mod):
            src = self.value_sources.get(mod)
            if src is None:
                src = self.sources.constant(mod, type(mod).__name__)
                self.value_sources.set(mod, src)
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


def _runs_python(cls) -> bool:
    """Making a `cls` runs Python code: its own `__new__` or `__init__`."""
    return isinstance(cls.__new__, types.FunctionType) or isinstance(cls.__init__, types.FunctionType)


def dataclass_generated_init(fn, obj) -> bool:
    """`fn` is the `__init__` that `@dataclass` wrote for the class of `obj` (it has no source)."""
    return isinstance(fn, types.FunctionType) and dataclasses.is_dataclass(type(obj)) \
        and not isinstance(obj, type) and fn.__qualname__ == f"{type(obj).__qualname__}.__init__" \
        and _no_source(fn)


def _no_source(fn) -> bool:
    try:
        function_source(fn)
    except NoSourceError:
        return True
    return False


def _c_method_self(fn, args):
    """The object a method written in C (`object.__setattr__`, `OrderedDict.__setitem__`,
    a bound `dict.keys`) is called on; None for anything else."""
    if isinstance(fn, (types.MethodWrapperType, types.BuiltinMethodType)):
        return getattr(fn, "__self__", None)
    if isinstance(fn, (types.WrapperDescriptorType, types.MethodDescriptorType)) and args:
        return args[0]
    return None


_STATE_MAKERS = ("register_parameter", "register_buffer")


@functools.lru_cache(maxsize=None)
def _makes_state(cls, depth=0) -> bool:
    """Making a `cls` (a torch module class) gives it a parameter or buffer whatever its
    arguments: its `__init__`, read from source, makes one (`Parameter(...)`, `register_buffer`,
    or `super().__init__(...)` of a class that does) on every path through it."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return depth < 8 and any(_makes_state(b, depth + 1) for b in cls.__bases__
                                 if issubclass(b, nn.Module) and b is not nn.Module)
    try:
        fs = function_source(init)
    except NoSourceError:
        return False

    def call_makes(c) -> bool:
        f = c.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in _STATE_MAKERS:  # a tensor made here (an argument passed on may be None)
            return len(c.args) > 1 and isinstance(c.args[1], ast.Call)
        if isinstance(f, ast.Name) and isinstance(fs.globals.get(f.id), type) \
                and issubclass(fs.globals[f.id], nn.Parameter):
            return True
        if name == "__init__" and isinstance(f.value, ast.Call) and getattr(f.value.func, "id", "") == "super":
            return depth < 8 and any(_makes_state(b, depth + 1) for b in cls.__bases__
                                     if issubclass(b, nn.Module) and b is not nn.Module)
        return False

    def every_path(stmts) -> bool:
        for st in stmts:
            if isinstance(st, ast.If):
                if every_path(st.body) and every_path(st.orelse):
                    return True
            elif isinstance(st, (ast.Return, ast.Raise)):
                return False
            elif not isinstance(st, (ast.For, ast.While, ast.Try, ast.With, ast.FunctionDef)) and any(
                    isinstance(n, ast.Call) and call_makes(n) for n in ast.walk(st)):
                return True
        return False
    return every_path(fs.node.body)


def _c_callable(fn) -> bool:
    """A function or bound method written in C (`np.power`, `np.sin`): reached at the end of
    `Evaluator.call` (not a container's or a constant's method), calling it is the concrete
    domain's UNKNOWN_CALL break whatever its arguments are."""
    return callable(fn) and not isinstance(fn, (type, types.FunctionType, types.MethodType))


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
    if isinstance(v, (collections.abc.KeysView, collections.abc.ValuesView, collections.abc.ItemsView)):
        return all(foldable(x) for x in v)  # a view of a dict: what it shows
    return type(v).__module__ in ("enum",) or isinstance(v, __import__("enum").Enum)


# builtins with tensor-aware behaviour
def _b_len(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, TensorVar):
        if v.meta is None:
            return UNKNOWN
        return ev.sizes(v)[0]
    if isinstance(v, (Unknown, AbstractSeq)) or hasattr(type(v), "__fl_abstract_iter__"):
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
    if hasattr(type(obj), "__fl_abstract_getattr__"):  # the editor's stand-ins: known, or unknown
        return True if not isinstance(ev.getattr(obj, name, e, scope), Unknown) else UNKNOWN
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
            if ev.abstract:  # a method the editor does not know the class of: nothing known
                return UNKNOWN
            ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() outside a method")
        args = [fs.closure["__class__"], scope.vars.get(params[0].arg)]
    if hasattr(type(args[0]), "__fl_abstract_super__"):  # a class the editor parsed (analyze.py)
        return args[0].__fl_abstract_super__(*args[1:])
    if ev.abstract and any(isinstance(a, Unknown) or hasattr(type(a), "__fl_abstract_getattr__")
                           for a in args):
        return UNKNOWN
    if any(isinstance(a, (TensorVar, Unknown)) for a in args):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="super() of a tensor")
    return super(*args)


def _b_setattr(ev, args, kwargs, e, scope):
    obj, name, v = args
    if ev.effects.is_fresh(obj):
        ev.set_attribute(obj, name, v, e, scope)
        return None
    if ev.abstract and (isinstance(obj, Unknown) or hasattr(type(obj), "__fl_abstract_getattr__")):
        return None  # an object the editor only stands in for
    ev.brk(B.UNSUPPORTED_STMT, e, scope, detail=f"setattr() on a {type(obj).__name__} object from outside",
           whole_stmt=True)


def _b_delattr(ev, args, kwargs, e, scope):
    obj, name = args
    if ev.effects.is_fresh(obj):
        deleter = type(obj).__delattr__
        if isinstance(deleter, types.FunctionType):
            return ev.inline(deleter, [name], {}, e, scope, self_value=obj)
        ev.effects.touch(obj)
        return deleter(obj, name)
    ev.brk(B.UNSUPPORTED_STMT, e, scope, detail=f"delattr() on a {type(obj).__name__} object from outside",
           whole_stmt=True)


def _b_callable(ev, args, kwargs, e, scope):
    (v,) = args
    if isinstance(v, (LocalFunction, BoundUserMethod, TensorMethod)):
        return True  # functions of the captured code, called by evaluating them
    if isinstance(v, Unknown):
        return UNKNOWN
    return callable(v)


def _b_iter(ev, args, kwargs, e, scope):
    if len(args) != 1:
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="iter() with a sentinel")
    items = ev.iterate(args[0], e, scope)
    return UNKNOWN if isinstance(items, AbstractSeq) else iter(items)


def _b_next(ev, args, kwargs, e, scope):
    """`next()` of an iterator capture made (`iter(...)`, a generator run to its end)."""
    if ev.abstract and not isinstance(args[0], type(iter([]))):
        return UNKNOWN
    if not isinstance(args[0], type(iter([]))):
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"next() of a {type(args[0]).__name__}")
    return next(*args)


def _b_reduce(ev, args, kwargs, e, scope):
    """`functools.reduce(fn, items[, initial])`: fn called item by item, as the C loop calls it."""
    if kwargs or not 2 <= len(args) <= 3:
        ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail="functools.reduce() with keyword arguments")
    fn, items = args[0], ev.iterate(args[1], e, scope)
    if isinstance(items, AbstractSeq):
        return UNKNOWN
    if len(args) == 2 and not items:
        raise TypeError("reduce() of empty iterable with no initial value")
    acc, rest = (args[2], items) if len(args) == 3 else (items[0], items[1:])
    for x in rest:
        acc = ev.call(fn, [acc, x], {}, e, scope)
    return acc


_BUILTIN_HANDLERS = {len: _b_len, range: _b_range, getattr: _b_getattr, hasattr: _b_hasattr,
                     min: _b_minmax(min), max: _b_minmax(max), type: _b_type, super: _b_super,
                     iter: _b_iter, next: _b_next, callable: _b_callable,
                     setattr: _b_setattr, delattr: _b_delattr, functools.reduce: _b_reduce}
