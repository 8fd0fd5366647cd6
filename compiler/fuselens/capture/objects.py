"""Python objects, as the kinds (kinds.py) use them: a module's attributes and its call, objects of
Python classes the captured code makes (`new_object`, dataclasses' generated `__init__`), attribute
stores, containers' methods on the capture's models, and folding pure functions on constants."""
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

import torch
import torch.nn as nn

from . import breaks as B
from . import calls as C
from . import environ
from . import side_effects as S
from .guards import SRC, arg
from .side_effects import MUTABLE
from .source import NoSourceError, function_source
from .values import (NUMPY_SCALARS, UNKNOWN, BoundUserMethod, LocalFunction, SymInt, TensorVar,
                     Unknown, contains_tensor, leaves)
from .frames import AbstractSeq, BreakSignal
from .statements import MAX_UNROLL


# what a module attribute holds that is code (guarded by identity), not an object whose reads are guarded
_CODE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, type, types.ModuleType)


class Objects:
    """Mixin of `Evaluator` (evaluator.py)."""

    def module_attr(self, mod, attr, e, scope):
        if self.effects.is_fresh(mod):
            return getattr(mod, attr)
        src = self.domain.source(self, mod) or self.domain.constant(mod, type(mod).__name__)
        self.value_sources.set(mod, src)
        v = getattr(mod, attr)
        if attr == "training":
            self.domain.guard(f"{SRC}.training is {v}", f"{src}.training (train/eval mode)", src)
        elif isinstance(v, torch.Tensor):
            return self.input(v, f"{src}.{attr}")
        elif type(v) in MUTABLE or isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v):
            return self.wrap_external(v, f"{src}.{attr}")
        elif isinstance(v, nn.Module):
            self.value_sources.set(v, f"{src}.{attr}")
            self.domain.guard_module(v, f"{src}.{attr}")
        elif isinstance(v, _CODE) and attr not in mod.__dict__:
            pass  # its class's own code (a method), not guarded, as its forward is not
        elif hasattr(v, "__dict__") and not isinstance(v, _CODE) and \
                self.value_sources.get(v) not in (None, f"{src}.{attr}"):
            # an object found before through another source (transformers' config, held by every
            # layer): that object there too, what is read of it read and guarded at its first
            # source once (each layer's `config._attn_implementation`, a Python __getattribute__
            # of ~1 us, had been read by every layer's source on every call)
            self.domain.guard(f"{SRC} is {arg(1)}", f"{src}.{attr} is {self.value_sources.get(v)}",
                              f"{src}.{attr}", self.value_sources.get(v))
        else:
            # whatever else it holds is a constant of the capture, guarded by what it is
            # (guards.py guard_value): a hyper-parameter by type and value, code, classes and
            # enum members by identity, a tuple item by item
            self.domain.guard_value(f"{src}.{attr}", v)
            if hasattr(v, "__dict__") and not isinstance(v, _CODE):
                # an object it holds (a config, a callable object), guarded by its type: found
                # there on each call, what capture reads of it is guarded where it is read (getattr)
                self.value_sources.set(v, f"{src}.{attr}")
            elif isinstance(v, types.MethodType) and self.value_sources.get(v.__self__) is None:
                self.value_sources.set(v.__self__, f"{src}.{attr}.__self__")  # (a method's object, alike)
        return v

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
        if C.compile_disabled(cls.__init__):  # (`torch.compiler.disable` on the class)
            self.brk(B.COMPILE_DISABLED, e, scope, detail=f"creating a `{cls.__qualname__}` object")
        if cls.__new__ is not object.__new__ and cls.__init__ is object.__init__:
            return self.made_by_c_new(cls, args, kwargs, e, scope)
        try:
            obj = cls.__new__(cls)
        except TypeError:  # a C `__new__` that needs the arguments too (`weakref.ref(obj)`)
            return self.made_by_c_new(cls, args, kwargs, e, scope)
        self.effects.fresh(obj)
        init = cls.__init__
        if not isinstance(init, types.FunctionType):  # object.__init__, dict.__init__: C code
            self.effects.touch(obj)
            init(obj, *args, **kwargs)
        elif dataclass_generated_init(init, obj):
            self.dataclass_init(obj, args, kwargs, init, e, scope)
        else:
            try:
                self.inline(init, args, kwargs, e, scope, self_value=obj)
            except BreakSignal as b:
                if b.pending_call is e:  # a break inside `__init__`: the call's result is `obj`
                    b.pending_constructed = obj
                raise
        return obj

    def made_by_c_new(self, cls, args, kwargs, e, scope):
        """`cls(...)` for a class whose C `__new__` makes the object from the arguments (a NumPy
        scalar type: `np.float32(0.5)`; allocated without them it would be another value): made
        now from constants where it is a value (foldable), a break otherwise."""
        if not self.domain.runs_python or any(isinstance(v, Unknown) for v in leaves([args, kwargs])):
            return UNKNOWN
        args, kwargs = self.plain_constants((args, kwargs), e, scope)
        self.require_foldable(list(args) + list(kwargs.values()), e, scope)
        r = cls(*args, **kwargs)
        if not foldable(r):
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"creating a `{cls.__qualname__}` object")
        return r

    def plain_constants(self, v, e, scope):
        """`v` (arguments of a call run natively) with each dynamic size specialized (guarded on
        its value) and each modelled container's contents guarded (side_effects.py)."""
        if isinstance(v, SymInt):
            return self.specialize(v, e, scope)
        if isinstance(v, (list, tuple, dict)):
            self.effects.observe(v)
            if isinstance(v, dict):
                return {k: self.plain_constants(x, e, scope) for k, x in v.items()}
            items = [self.plain_constants(x, e, scope) for x in v]
            return items if isinstance(v, list) else tuple(items) if type(v) is not torch.Size else torch.Size(items)
        return v

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
            self.in_try += 1  # the protocol takes an IndexError its `__getitem__` raises (statements.py)
            try:
                for i in range(MAX_UNROLL + 1):
                    try:
                        items.append(self.getitem(v, i, node, scope))
                    except (IndexError, StopIteration):
                        return items
            finally:
                self.in_try -= 1
            self.brk(B.UNROLLABLE_LOOP, node, scope, whole_stmt=True,
                     detail=f"more than {MAX_UNROLL} items of {type(v).__name__}")
        return None

    def dataclass_init(self, obj, args, kwargs, init, e, scope):
        """What the `__init__` that `@dataclass` generates (it has no source) does: each field
        from its argument, default or factory, through the class's own `__setattr__` unless
        frozen, then `__post_init__` with the InitVar arguments."""
        cls = dataclass_generated_init(init, obj)  # (its fields, not a subclass's)
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
        if isinstance(obj, nn.Module) and isinstance(v, nn.Module) and obj._modules.get(attr) is v \
                and not self.effects.getattr(obj, attr)[0]:
            return  # `self.router = self.router.to(dtype)` given the module itself: a store of what is there
        src = self.domain.source(self, obj)
        if src is not None:
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
            if not foldable(v):
                self.domain.unknowable(self, B.UNSUPPORTED_EXPR, e, scope,
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
        if fn is dict and len(args) == 1 and isinstance(args[0], environ.ENVIRONMENTS):
            return dict(environ.read(self, args[0], "copy", [], {}, e, scope), **kwargs)
        if fn is dict and len(args) == 1 and not isinstance(args[0], dict):
            return dict(self.iterate(args[0], e, scope), **kwargs)  # pairs: `dict(obj.items())`
        if fn not in (isinstance, type, id, callable, hasattr, getattr):
            self.require_foldable(vals, e, scope)
            for v in vals:
                self.effects.observe(v)
        if any(isinstance(a, TensorVar) for a in vals) or fn is sum and contains_tensor(vals):
            if fn in (int, float, bool, complex):
                if TensorVar.only_assumed(vals):
                    return UNKNOWN  # of what may be a number (TensorVar.assumed)
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
            if TensorVar.only_assumed(vals):
                return UNKNOWN
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

    def call_module(self, mod, args, kwargs, e, scope):
        if getattr(mod, "_backward_hooks", None) or getattr(mod, "_backward_pre_hooks", None) \
                or getattr(mod, "_forward_hooks_always_called", None) or _global_module_hooks():
            self.brk(B.UNKNOWN_CALL, e, scope, detail=f"{type(mod).__name__} has backward or global hooks")
        if C.fsdp_unit(mod):  # one unit's graphs of its own, between FSDP2's hooks
            self.brk(B.UNKNOWN_CALL, e, scope, whole_stmt=True, compiled_call=e,
                     detail=f"{type(mod).__name__} is an FSDP2 unit: its hooks (all-gather, reshard) run in "
                     "Python, its forward compiled on its own")
        if not self.effects.is_fresh(mod):
            src = self.domain.source(self, mod)
            if src is None:
                src = self.domain.constant(mod, type(mod).__name__)
                self.value_sources.set(mod, src)
            # identity and .training, however the module was reached (a global, a list item)
            self.domain.guard_module(mod, src)
        fwd = type(mod).forward
        if C.compile_disabled(fwd):
            self.brk(B.COMPILE_DISABLED, e, scope, detail=f"call to {type(mod).__name__}.forward")
        if not (mod._forward_pre_hooks or mod._forward_hooks):
            return self.inline(fwd, args, kwargs, e, scope, self_value=mod)
        return self._call_hooked(mod, fwd, args, kwargs, e, scope)

    def _call_hooked(self, mod, fwd, args, kwargs, e, scope):
        """A module call with forward pre-hooks and hooks (guarded: guards.guard_module), in
        `nn.Module._call_impl`'s order: each pre-hook may replace the arguments, each hook the
        result. The hooks are code like any other."""
        args = tuple(args)
        for hook_id, hook in list(mod._forward_pre_hooks.items()):
            if hook_id in mod._forward_pre_hooks_with_kwargs:
                r = self.call(hook, [mod, args, kwargs], {}, e, scope)
                if r is not None:
                    if not (isinstance(r, tuple) and len(r) == 2):
                        raise RuntimeError("forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                           f"but got {r}.")
                    args, kwargs = r
            else:
                r = self.call(hook, [mod, args], {}, e, scope)
                if r is not None:
                    args = r if isinstance(r, tuple) else (r,)
        result = self.inline(fwd, list(args), kwargs, e, scope, self_value=mod)
        for hook_id, hook in list(mod._forward_hooks.items()):
            with_kwargs = hook_id in mod._forward_hooks_with_kwargs
            r = self.call(hook, [mod, args, kwargs, result] if with_kwargs else [mod, args, result], {}, e, scope)
            if r is not None:
                result = r
        return result


def _global_module_hooks() -> bool:
    """Hooks registered for every module (`nn.modules.module.register_module_forward_hook`...)."""
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or getattr(m, "_global_backward_pre_hooks", None) or getattr(m, "_global_forward_hooks_always_called", None))


# container methods whose effect and result do not depend on the contents: a model only
# written this way needs no guard on them (a global log keeps one cache entry)
_BLIND_WRITES = {"append", "extend", "insert", "add", "update", "clear", "discard"}


_INDEXED = {"pop", "insert", "__getitem__", "__setitem__", "__delitem__"}  # list methods: arg 0


FOLDABLE_ATOMS = (int, float, complex, bool, str, bytes, type(None), range, slice, torch.dtype,
                   torch.device, torch.memory_format, torch.layout, type, types.FunctionType,
                   types.BuiltinFunctionType, types.ModuleType, nn.Module, TensorVar, SymInt,
                   Unknown, LocalFunction, BoundUserMethod, type(Ellipsis), types.MethodType,
                   BaseException,  # an exception capture raised and a captured handler took
                   inspect.Parameter, *NUMPY_SCALARS)


# values whose methods compute a new value and change nothing: called on constants, they fold
_IMMUTABLE = (str, bytes, int, float, complex, bool, tuple, frozenset, range, type(None))


def _runs_python(cls) -> bool:
    """Making a `cls` runs Python code: its own `__new__` or `__init__`."""
    return isinstance(cls.__new__, types.FunctionType) or isinstance(cls.__init__, types.FunctionType)


def dataclass_generated_init(fn, obj):
    """The class of `obj`'s MRO for which `@dataclass` wrote `fn` as its `__init__` (it has no
    source): `obj`'s own, or a base's that a subclass without its own `@dataclass` inherits
    (transformers' `class CwmModelOutputWithPast(BaseModelOutputWithPast): pass`); None if not."""
    if not isinstance(fn, types.FunctionType) or isinstance(obj, type):
        return None
    owner = next((c for c in type(obj).__mro__ if fn.__qualname__ == f"{c.__qualname__}.__init__"), None)
    return owner if owner is not None and dataclasses.is_dataclass(owner) and _no_source(fn) else None


def _no_source(fn) -> bool:
    try:
        function_source(fn)
    except NoSourceError:
        return True
    return False


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
