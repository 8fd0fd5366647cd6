"""One class per kind of value: what calling it, reading its attributes, indexing it, its truth
and iterating it mean to capture.

Constants stay plain Python values (values.py), so a value's kind is found from the value:
`kind_of(v)`, by its type where the type decides (a TensorVar, a module, a list: cached per
type) and by the value itself where it does not (a callable: `len` and `torch.add` share a
type, and which function it is decides what a call does). The Evaluator's `call`, `getattr`,
`getitem`, `truth` and `iterate` are one line each: `kind_of(v).<op>(ev, v, ...)`. A function
capture knows by identity (a builtin with tensor-aware behaviour, a query that torch.compile
answers at compile time, a logging call) is an entry of `builtins.KNOWN`, not a case of a chain.

Both domains go through the same kinds. The abstract domain's own values (`Unknown`, the
editor's stand-ins for classes it parsed) are kinds too, so the editor meets every rule capture
has; what differs between the domains (guards, inputs, what an opaque callee gives back, whether
library Python may run) is asked of `ev.domain` (domains.py)."""
from __future__ import annotations

import ast
import copy
import functools
import inspect
import itertools
import numbers
import operator
import re
import types
import weakref

import torch
import torch.nn as nn

from . import breaks as B
from . import calls as C
from . import environ, process_state
from .builtins import NOT_HANDLED, known_handler
from .frames import AbstractSeq
from .guards import SRC, arg
from .objects import _IMMUTABLE, _no_source, _runs_python, _stdlib
from .side_effects import MUTABLE, _is_key, _item
from .source import FunctionSource
from .values import (NUMPY_DTYPE, NUMPY_SCALARS, UNKNOWN, BoundUserMethod, ForeignData, GeneratorCall,
                     LocalFunction, SymInt, TensorVar, Unknown, contains_tensor, is_array_type, leaves)
from .tensors import TensorMethod

# the source of a slice of a module container (`self.layers[slice(None, 16, None)]`): its base, its slice
_SLICE_SOURCE = re.compile(r"(.+)\[(slice\(.*\))\]")


class Kind:
    """A Python object capture sees into (constants, containers, objects of user classes): its
    attributes are read (guarded where it came from outside), its items and truth are Python's,
    and calling it evaluates its class's `__call__` where that is Python (a loss object, a
    scheduler); anything else it cannot see into."""

    def call(self, ev, fn, args, kwargs, e, scope):
        method = inspect.getattr_static(type(fn), "__call__", None)
        if C.compile_disabled(method):
            ev.brk(B.COMPILE_DISABLED, e, scope, detail=f"call to a `{type(fn).__qualname__}` object")
        if isinstance(method, types.FunctionType) and not _no_source(method):
            return ev.inline(method, args, kwargs, e, scope, self_value=fn)
        return ev.domain.opaque_call(ev, fn, args, kwargs, e, scope)

    def getattr(self, ev, obj, attr, e, scope):
        assigned, v = ev.effects.getattr(obj, attr)
        if assigned:
            return v
        if not isinstance(obj, type):
            # a property is code like any other: evaluated (natively it would read the real
            # objects, not the capture's models of them, and guard nothing)
            desc = inspect.getattr_static(type(obj), attr, None)
            if isinstance(desc, property) and isinstance(desc.fget, types.FunctionType) \
                    and not _no_source(desc.fget):
                return ev.inline(desc.fget, [], {}, e, scope, self_value=obj)
            # so is any descriptor's Python `__get__` (a distribution's lazy_property), where it
            # decides: a data descriptor, or one the instance's own attribute does not shadow
            get = inspect.getattr_static(type(desc), "__get__", None)
            if isinstance(get, types.FunctionType) and not _no_source(get) and \
                    (inspect.getattr_static(type(desc), "__set__", None) is not None
                     or attr not in getattr(obj, "__dict__", {})):
                return ev.inline(get, [obj, type(obj)], {}, e, scope, self_value=desc)
        if ev.effects.is_fresh(obj):
            return getattr(obj, attr)  # the capture's own object: what it holds, as is
        v = getattr(obj, attr)
        src = ev.domain.source(ev, obj)
        if src is None and isinstance(obj, type):  # a class is a constant (by identity) wherever it came from
            src = ev.domain.constant(obj, obj.__name__)
        if src is not None and not isinstance(v, torch.Tensor) and not isinstance(obj, types.FunctionType):
            # (a class's too: `type(self).SCALE`, `Config.flag` changed between calls recompiles)
            ev.domain.guard_value(f"{src}.{attr}", v)
        if type(v) in MUTABLE:
            if src is None:  # found through an object of no source: that very object
                src = ev.domain.constant(obj, type(obj).__name__)
            return ev.domain.external(ev, v, f"{src}.{attr}")
        if isinstance(v, torch.Tensor):
            if src is None:  # found through an object of no source: the tensor itself
                return ev.input(v, ev.domain.constant(v, f"{type(obj).__name__}_{attr}"))
            return ev.input(v, f"{src}.{attr}")
        if src is not None and not isinstance(v, (int, float, str, bool, type(None), *NUMPY_SCALARS)):
            ev.value_sources.set(v, f"{src}.{attr}")
        return v

    def getitem(self, ev, obj, idx, e, scope):
        if isinstance(idx, Unknown) or TensorVar.only_assumed([idx]):
            return UNKNOWN
        if isinstance(idx, SymInt):
            idx = ev.specialize(idx, e, scope)
        if ev.effects.is_fresh(obj):
            return ev.call_special(obj, "__getitem__", [idx], e, scope)
        if isinstance(idx, TensorVar):
            ev.brk(B.TENSOR_TO_PY, e, scope, detail="indexing a Python container with a tensor")
        ev.effects.observe_item(obj, idx)
        # read natively, an item of a mapping's or sequence's state (a class's own Python
        # `__getitem__`, a dict or list subclass; not builtins' own containers, capture's own, nor
        # tuples, which do not change) is guarded where it was read, as an attribute is: the item
        # or its absence (a config mapping changed between calls had kept the first call's value)
        guarded = _is_key(idx) and type(obj).__module__ != "builtins" and not isinstance(obj, tuple) and (
            isinstance(obj, (dict, list)) or isinstance(inspect.getattr_static(type(obj), "__getitem__", None),
                                                         types.FunctionType))
        src = (ev.domain.source(ev, obj) or ev.domain.constant(obj, type(obj).__name__)) if guarded else None
        try:
            v = obj[idx]
        except KeyError:
            if guarded:
                ev.domain.guard(f"{idx!r} not in {SRC}", f"{src} has no item {idx!r}", src)
            raise
        if not (isinstance(v, torch.Tensor) or type(v) is tuple and any(isinstance(x, torch.Tensor) for x in v)):
            if guarded:
                ev.domain.guard_value(_item(src, idx), v)
                if type(v) in MUTABLE:
                    return ev.domain.external(ev, v, _item(src, idx))
            return v
        # an item of a container capture does not model (a dict subclass: an OrderedDict,
        # transformers' ModelOutput): a tensor in it is a graph input at the item's source, as an
        # attribute's is (taken as a constant, the first call's tensor was baked into the graph)
        if _is_key(idx):
            src = ev.domain.source(ev, obj)
            if src is None:  # found through an object of no source: that very object
                src = ev.domain.constant(obj, type(obj).__name__)
            return ev.wrap_external(v, _item(src, idx))
        if isinstance(v, torch.Tensor):  # at a key no source spells: the tensor itself, by identity
            return ev.input(v, ev.domain.constant(v, f"{type(obj).__name__}_item"))
        return v

    def truth(self, ev, v, node, scope, kind, whole_stmt):
        ev.effects.observe_len(v)  # a container's truth is its length's
        return bool(v)

    def iterate(self, ev, v, node, scope, whole_stmt):
        if isinstance(v, _ITERABLES) or _finite_repeat(v):
            return list(v)
        items = ev.iterate_object(v, node, scope)
        if items is not None:
            return items
        ev.brk(B.UNROLLABLE_LOOP, node, scope, detail=f"iteration over {type(v).__name__}", whole_stmt=True)


# what iterating gives, read as Python would (their items are values capture already has; the
# combinatoric iterators hold their inputs' items, taken when made)
_ITERABLES = (list, tuple, dict, range, str, set, frozenset, zip, enumerate, map, filter, type({}.items()),
              type({}.keys()), type({}.values()), reversed, type(iter([])), itertools.product,
              itertools.combinations, itertools.permutations)


def _finite_repeat(v) -> bool:
    """`itertools.repeat(x, n)` (torch's `_pair(k)`: `tuple(repeat(k, 2))`); `repeat(x)` is endless."""
    if type(v) is not itertools.repeat:
        return False
    try:
        v.__length_hint__()
    except TypeError:
        return False
    return True


class PythonModule(Kind):
    """A module of Python code (`math`, `transformers.utils`): its tensors and containers are
    inputs found at their sources; the rest is a constant of the program."""

    def getattr(self, ev, obj, attr, e, scope):
        assigned, v = ev.effects.getattr(obj, attr)
        if assigned:
            return v
        v = getattr(obj, attr)
        if isinstance(v, torch.Tensor) or type(v) in MUTABLE:
            return ev.wrap_external(v, f"{ev.domain.constant(obj, obj.__name__.split('.')[-1])}.{attr}")
        ev.process_reads.setdefault((obj.__name__, attr), v)
        return v


class Tensor(Kind):
    """A tensor of the graph (TensorVar): operations become graph nodes; its data never reaches
    Python unless its bounds decide (capture/bounds.py)."""

    def call(self, ev, fn, args, kwargs, e, scope):
        if ev.domain.abstract:
            # a tensor is not callable: the editor took a value it cannot resolve (an
            # un-annotated parameter, an attribute of one) for a tensor, and it is a module or
            # a function, which capture inlines: no break to claim
            return UnknownValue.call(self, ev, UNKNOWN, args, kwargs, e, scope)
        return super().call(ev, fn, args, kwargs, e, scope)

    def getattr(self, ev, obj, attr, e, scope):
        return ev.tensor_attr(obj, attr, e, scope)

    def getitem(self, ev, obj, idx, e, scope):
        if isinstance(idx, TensorVar) and idx.is_bool \
                or isinstance(idx, tuple) and any(isinstance(i, TensorVar) and i.is_bool for i in idx):
            ev.brk(B.DYNAMIC_SHAPE, e, scope, detail="boolean-mask indexing")
        return ev.op(operator.getitem, [obj, _number_indices(ev, idx, e, scope)], {}, e, scope)

    def truth(self, ev, v, node, scope, kind, whole_stmt):
        if v.known is not None and (v.meta is None or v.meta.numel() == 1):
            return v.known  # its bounds decide it (capture/bounds.py): no data reaches Python
        if v.assumed:  # the editor cannot tell it is a tensor: a number's truth breaks nothing
            return UNKNOWN
        ev.brk(kind, node, scope, detail=f"`{_short(node)}` is a tensor",
               whole_stmt=whole_stmt or kind is B.DATA_WHILE, cond=v)

    def iterate(self, ev, v, node, scope, whole_stmt):
        if v.meta is None:
            return AbstractSeq()
        if v.meta.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        n = ev.sizes(v)[0]  # guarded: the loop is unrolled for this many rows
        n = ev.specialize(n, node, scope) if isinstance(n, SymInt) else n
        return [ev.op(operator.getitem, [v, i], {}, node, scope) for i in range(n)]


def _number_indices(ev, idx, e, scope):
    """`idx` with the tensors eager reads as numbers (their `__index__`) read so: its slices'
    bounds, and a 0-dim integer tensor index (eager's select, a view at the position it holds,
    not advanced indexing). A tensor of Python numbers alone (TensorVar.number, DeBERTa's
    `torch.tensor(att_span)`) is its value; any other is data, read in Python."""
    def number(b, what):
        if not isinstance(b, TensorVar) or b.assumed:
            return b
        if b.number is None:
            ev.brk(B.TENSOR_TO_PY, e, scope, detail=f"{what}: eager reads its value")
        return b.number

    def one(s):
        if isinstance(s, slice):
            return slice(*(number(b, "a tensor as a slice bound") for b in (s.start, s.stop, s.step)))
        if isinstance(s, TensorVar) and s.meta is not None and s.meta.dim() == 0 \
                and s.meta.dtype not in (torch.bool, torch.uint8) and not s.meta.dtype.is_floating_point \
                and not s.meta.dtype.is_complex:
            return number(s, "a 0-dim integer tensor as an index")
        return s
    return tuple(one(s) for s in idx) if isinstance(idx, tuple) else one(idx)


class TensorMethodKind(Kind):
    """`t.add` read off a tensor of the graph, not called yet."""

    def call(self, ev, fn, args, kwargs, e, scope):
        ev.domain.torch_receives([args, kwargs])
        return ev.tensor_method(fn.t, fn.name, args, kwargs, e, scope)


class SymbolicInt(Kind):
    """A size that may change between calls: arithmetic stays symbolic; its truth is the relation
    `!= 0` (guarded as such); used as a Python value (an index), it is specialized (guarded on
    its exact value)."""

    def truth(self, ev, v, node, scope, kind, whole_stmt):
        return ev.sym_compare(operator.ne, v, 0, node, scope)


class UnknownValue(Kind):
    """Abstract domain: a value the editor does not know (Unknown, a sequence of unknown length):
    what is done with it is unknown too, and breaks nothing by itself."""

    def call(self, ev, fn, args, kwargs, e, scope):
        if any(isinstance(a, TensorVar) for a in args):
            r = TensorVar(None, None, None)  # probably a tensor function
            r.assumed = True
            return r
        return UNKNOWN

    def getattr(self, ev, obj, attr, e, scope):
        return UNKNOWN

    def getitem(self, ev, obj, idx, e, scope):
        return obj.item() if isinstance(obj, AbstractSeq) else ForeignData.merge(obj) or UNKNOWN

    def truth(self, ev, v, node, scope, kind, whole_stmt):
        return UNKNOWN

    def iterate(self, ev, v, node, scope, whole_stmt):
        return v if isinstance(v, AbstractSeq) else AbstractSeq(UNKNOWN)


class StandIn(Kind):
    """Abstract domain: the editor's stand-in for a class it parsed, an instance of one, or a
    library object it did not make (capture/analyze.py). It answers through its hooks
    `__fl_abstract_getattr__`, `__fl_abstract_call__` and `__fl_abstract_iter__`; what it has no
    hook for is unknown."""

    def call(self, ev, fn, args, kwargs, e, scope):
        hook = getattr(type(fn), "__fl_abstract_call__", None)
        return UNKNOWN if hook is None else hook(fn, ev, args, kwargs, e, scope)

    def getattr(self, ev, obj, attr, e, scope):
        hook = getattr(type(obj), "__fl_abstract_getattr__", None)
        return UNKNOWN if hook is None else hook(obj, ev, attr, e, scope)

    def iterate(self, ev, v, node, scope, whole_stmt):
        hook = getattr(type(v), "__fl_abstract_iter__", None)
        return AbstractSeq(UNKNOWN if hook is None else hook(v))


class Module(Kind):
    """An `nn.Module`: calling it inlines its `forward` (its identity and `.training` guarded);
    its parameters and buffers are graph inputs found at their sources; its hyper-parameters are
    constants guarded by value."""

    def call(self, ev, mod, args, kwargs, e, scope):
        return ev.call_module(mod, args, kwargs, e, scope)

    def getattr(self, ev, obj, attr, e, scope):
        assigned, v = ev.effects.getattr(obj, attr)
        return v if assigned else ev.module_attr(obj, attr, e, scope)

    def getitem(self, ev, obj, idx, e, scope):  # ModuleList / Sequential / ModuleDict
        if isinstance(idx, Unknown):
            return UNKNOWN
        if isinstance(idx, SymInt):
            idx = ev.specialize(idx, e, scope)
        v = obj[idx]
        if isinstance(v, torch.Tensor):  # a ParameterList's or ParameterDict's: a graph input
            src = ev.domain.source(ev, obj) or ev.domain.constant(obj, type(obj).__name__)
            return ev.wrap_external(v, f"{src}[{idx!r}]")
        if isinstance(v, nn.Module):
            src = ev.domain.source(ev, obj)
            if src is not None:
                ev.value_sources.set(v, f"{src}[{idx!r}]")
                if isinstance(idx, slice):  # (a new container each time the guards read it:
                    # its modules are found by their positions in the one they came from)
                    for j, m in zip(range(len(obj))[idx], v):
                        ev.value_sources.set(m, f"{src}[{j}]")
        return v

    def iterate(self, ev, v, node, scope, whole_stmt):
        if isinstance(v, (nn.ModuleList, nn.Sequential)):
            src = ev.domain.source(ev, v)
            items = list(v)
            if src is not None:
                sliced = _SLICE_SOURCE.fullmatch(src)
                if sliced:  # (its length without making the slice: a new ModuleList of its modules,
                    # 26 us a call for transformers' `self.layers[: config.num_hidden_layers]`)
                    ev.domain.guard(f"len(range(len({SRC}))[{sliced.group(2)}]) == {len(items)}",
                                    f"len({src})", sliced.group(1))
                else:
                    ev.domain.guard(f"len({SRC}) == {len(items)}", f"len({src})", src)
                for i, m in enumerate(items):
                    if ev.value_sources.get(m) is None:  # (a slice's modules have theirs)
                        ev.value_sources.set(m, f"{src}[{i}]")
            return items
        if isinstance(v, (nn.ModuleDict, nn.ParameterDict)):
            return list(v.keys())
        if isinstance(v, nn.ParameterList):  # its parameters, each a graph input at its position
            src = ev.domain.source(ev, v)
            if src is not None:  # (one of no source is a constant: its items are read through it)
                ev.domain.guard(f"len({SRC}) == {len(v)}", f"len({src})", src)
            return [self.getitem(ev, v, i, node, scope) for i in range(len(v))]
        return super().iterate(ev, v, node, scope, whole_stmt)


class Generator(Kind):
    """A generator function called, not run yet: iterating it runs its body to its end."""

    def iterate(self, ev, v, node, scope, whole_stmt):
        return ev.run_generator(v)


class PythonFunction(Kind):
    """Python code (a function, a `def` or `lambda` of the captured code, a method bound to its
    object): inlined, with its own globals and closure. The standard library's functions on
    plain values run natively (their result is a constant)."""

    def call(self, ev, fn, args, kwargs, e, scope):
        if C.compile_disabled(fn.fn if isinstance(fn, BoundUserMethod) else fn):
            ev.brk(B.COMPILE_DISABLED, e, scope, detail=f"call to {_name(fn)}")
        if isinstance(fn, BoundUserMethod):
            return ev.inline(fn.fn, args, kwargs, e, scope, self_value=fn.self_value)
        if isinstance(fn, types.MethodType):
            return ev.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if isinstance(fn, types.FunctionType) and _stdlib(fn) and ev.domain.runs_python and not any(
                contains_tensor(v) or type(v) in MUTABLE or isinstance(v, (Unknown, SymInt))
                for v in list(args) + list(kwargs.values())):
            r = process_state.run(ev, fn, args, kwargs, e, scope)  # the standard library on plain values
            if fn in (copy.copy, copy.deepcopy) and r is not args[0] and hasattr(r, "__dict__") \
                    and not isinstance(r, (torch.Tensor, nn.Module, type, types.FunctionType)):
                ev.effects.fresh(r)  # a new object: the capture's own, as eager makes one each call
            return r
        return ev.inline(fn, args, kwargs, e, scope)


class TorchFunction(Kind):
    """A function of torch (`torch.add`, `F.relu`, `Tensor.view`, an OpOverload): an op of the
    graph. torch's own Python on plain values is code like the user's, inlined."""

    def call(self, ev, fn, args, kwargs, e, scope):
        ev.domain.torch_receives([args, kwargs])
        plain = not contains_tensor([args, kwargs])
        if not ev.domain.runs_python and plain and isinstance(fn, (types.FunctionType, types.MethodType)):
            # the editor does not walk torch's own Python on plain values (`torch.compile`
            # itself): what it would find there is torch's, not the user's, and depends on state
            return UNKNOWN
        if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType) \
                and not isinstance(fn.__self__, (TensorVar, torch.Tensor)) \
                and (plain or not isinstance(fn.__self__, type)):
            # a method of one of torch's Python objects (`no_grad().clone()`, which a
            # `@torch.no_grad()` decorator calls; a distribution's `log_prob(x)`, a constraint's
            # `check(x)`): code like the user's, found on the object's class, not an op of the
            # module that defines it
            return ev.inline(fn.__func__, args, kwargs, e, scope, self_value=fn.__self__)
        if plain and isinstance(fn, types.FunctionType):
            # torch's own Python helpers on plain values (`F._canonical_mask(None, ...)`,
            # `F._none_or_dtype(None)`) are code like the user's: what they touch decides
            return ev.inline(fn, args, kwargs, e, scope)
        call = inspect.getattr_static(type(fn), "__call__", None)
        if not plain and isinstance(call, types.FunctionType) \
                and not isinstance(fn, (torch._ops.OperatorBase, torch._ops.OpOverloadPacket)):
            # an object of torch's Python called on tensors (a distribution's transform, `t.inv(y)`):
            # its `__call__` is code like the user's, no op
            return ev.inline(call, args, kwargs, e, scope, self_value=fn)
        return ev.torch_call(fn, args, kwargs, e, scope)


class KnownFunction(Kind):
    """A function whose call capture answers itself (builtins.KNOWN): `len`, `isinstance`,
    `torch.compiler.is_compiling`, `print`, a logger's methods... A handler that does not apply
    to these arguments hands the call on to what the function is otherwise."""

    def call(self, ev, fn, args, kwargs, e, scope):
        r = known_handler(fn)(ev, fn, args, kwargs, e, scope)
        if r is NOT_HANDLED:
            return _callable_kind(fn).call(ev, fn, args, kwargs, e, scope)
        return r


class CMethod(Kind):
    """A method written in C, bound (`d.keys`, `"x".join`) or not (`object.__setattr__`): on
    the capture's own objects and its models of containers it runs or is modelled; on a
    constant it folds."""

    def call(self, ev, fn, args, kwargs, e, scope):
        if not args and not kwargs and isinstance(fn, types.MethodWrapperType) \
                and fn == object.__init__.__get__(fn.__self__):
            return None  # `super().__init__()` reaching object's: it does nothing, on any object
        owner = _c_method_self(fn, args)
        name = getattr(fn, "__name__", "")
        if name == "__setattr__" and len(args) >= 2 and not ev.effects.is_fresh(owner) \
                and not isinstance(owner, (nn.Module, type)):
            # object.__setattr__, reached from a class's own __setattr__ (`super().__setattr__`):
            # the store itself, on an object from outside
            attr, v = args[-2:]
            src = ev.domain.source(ev, owner)
            if src is None:
                ev.brk(B.UNSUPPORTED_STMT, e, scope, whole_stmt=True,
                       detail=f"attribute assignment `.{attr} = ...` on an object of no known source")
            ev.effects.setattr(owner, src, attr, v)
            return None
        if name == "__getattribute__" and len(args) >= 1 and not ev.effects.is_fresh(owner) \
                and not isinstance(owner, (nn.Module, type)):
            return ev.getattr(owner, args[-1], e, scope)  # `super().__getattribute__(name)`: a read
        if ev.effects.is_fresh(owner):
            # object.__setattr__, OrderedDict.__setitem__, dict.keys... (often through super())
            # on an object the capture made: C code storing or reading references runs as is
            ev.effects.touch(owner)
            return fn(*args, **kwargs)
        if isinstance(fn, types.BuiltinMethodType) and isinstance(owner, MUTABLE):
            return ev.container_method(fn, args, kwargs, e, scope)
        if isinstance(fn, types.BuiltinMethodType) and (type(owner) in _IMMUTABLE or
                                                         isinstance(owner, NUMPY_SCALARS)):
            return ev.fold(fn, args, kwargs, e, scope)  # `name.startswith("x")`, `"{}".format(n)`, `v.item()`
        return (PURE if C.is_pure_foldable(fn) else OBJECT).call(ev, fn, args, kwargs, e, scope)


class PureFunction(Kind):
    """A function of Python's with no effects (`math.sqrt`, `operator.add`, `sorted`): folded
    on constants; on tensors, the graph op its syntax spells (objects.Objects.fold)."""

    def call(self, ev, fn, args, kwargs, e, scope):
        return ev.fold(fn, args, kwargs, e, scope)


class NumpyFunction(Kind):
    """A NumPy function (calls.is_numpy_function: `np.sqrt`, `np.prod`) on numbers, strings and
    NumPy scalars: computed now, as eager computes it, where it gives such a value (a NumPy
    scalar is a number: guarded by value, read by torch as values.torch_number). On an array, or
    giving one, it is NumPy work capture cannot see into."""

    def call(self, ev, fn, args, kwargs, e, scope):
        values = list(leaves([args, kwargs]))
        if not ev.domain.runs_python and not any(isinstance(v, (ForeignData, TensorVar)) for v in values):
            return UNKNOWN  # the editor computes no NumPy: on what it does not know, it says nothing
        if ev.domain.runs_python and all(isinstance(v, (*_NUMPY_DATA, SymInt, NUMPY_DTYPE)) for v in values):
            plain_args, plain_kwargs = ev.plain_constants((args, kwargs), e, scope)
            r = fn(*plain_args, **plain_kwargs)
            if all(isinstance(v, _NUMPY_DATA) for v in leaves(r)):
                return r
        return OBJECT.call(ev, fn, args, kwargs, e, scope)


_NUMPY_DATA = (numbers.Number, str, bytes, type(None), type, *NUMPY_SCALARS)


class ArrayData(Kind):
    """A NumPy array (values.is_array_type; capture makes none: NumPy's calls giving one break):
    data guarded by its type alone, so what is read of it (an item, its truth, its items) is read
    in Python: a constant of the first call's data would outlive it (BigBird's random blocks)."""

    def getitem(self, ev, obj, idx, e, scope):
        return self._read(ev, obj, "an item", e, scope)

    def truth(self, ev, v, node, scope, kind, whole_stmt):
        return self._read(ev, v, "the truth", node, scope, whole_stmt)

    def iterate(self, ev, v, node, scope, whole_stmt):
        return self._read(ev, v, "the items", node, scope, True)

    @staticmethod
    def _read(ev, v, what, e, scope, whole_stmt=False):
        return ev.domain.unknowable(ev, B.UNSUPPORTED_EXPR, e, scope, whole_stmt=whole_stmt,
                                    detail=f"{what} of a {type(v).__name__} (NumPy's data) read")


class WeakReference(Kind):
    """A `weakref.ref` from outside (nn.LSTM's `_flat_weight_refs`): calling it gives its
    referent, found there on each call: a tensor is a graph input at that source (the same
    tensor as another input where it is one: guarded so), an object found at another source
    guarded to be the one there (torch's `Transform.inv` before 2.12: a transform's inverse, made
    each call), anything else guarded by identity."""

    def call(self, ev, ref, args, kwargs, e, scope):
        if args or kwargs or not ev.domain.runs_python:
            return super().call(ev, ref, args, kwargs, e, scope)
        v = ref()
        src = f"{ev.domain.source(ev, ref) or ev.domain.constant(ref, 'weakref')}()"
        if isinstance(v, torch.Tensor) or type(v) in MUTABLE:
            return ev.wrap_external(v, src)
        found = ev.domain.source(ev, v) if v is not None else None
        if found is not None:
            ev.domain.guard(f"{SRC} is {arg(1)}", f"{src} is {found}", src, found)
        else:
            ev.domain.guard(f"{SRC} is {ev.domain.constant(v, type(v).__name__)}" if v is not None
                            else f"{SRC} is None", f"{src} is the same object", src)
        return v


class Environment(Kind):
    """`os.environ` (environ.py): what capture reads of it is guarded by value; its methods are
    EnvironMethods, whose calls are those guarded reads."""

    def getattr(self, ev, env, attr, e, scope):
        return environ.method(env, attr)

    def getitem(self, ev, env, key, e, scope):
        return environ.read(ev, env, "__getitem__", [key], {}, e, scope)

    def truth(self, ev, env, node, scope, kind, whole_stmt):
        n = environ.read(ev, env, "__len__", [], {}, node, scope)
        return n if isinstance(n, Unknown) else n > 0

    def iterate(self, ev, env, node, scope, whole_stmt):
        keys = environ.read(ev, env, "keys", [], {}, node, scope)
        return AbstractSeq(UNKNOWN) if isinstance(keys, Unknown) else list(keys)


class EnvironmentMethod(Kind):
    """`os.environ.get` and the environment's other methods (environ.EnvironMethod), called."""

    def call(self, ev, m, args, kwargs, e, scope):
        return environ.read(ev, m.env, m.name, args, kwargs, e, scope)


class Getter(Kind):
    """`operator.itemgetter(k)` or `attrgetter(name)`, called: the items or attributes read as the
    syntax reads them (of a tensor too: `itemgetter(0)(t)` is `t[0]`)."""

    def call(self, ev, fn, args, kwargs, e, scope):
        (obj,) = args
        names = fn.__reduce__()[1]
        if isinstance(fn, operator.itemgetter):
            got = [ev.getitem(obj, k, e, scope) for k in names]
        else:
            got = [functools.reduce(lambda o, a: ev.getattr(o, a, e, scope), n.split("."), obj) for n in names]
        return got[0] if len(got) == 1 else tuple(got)


class Partial(Kind):
    def call(self, ev, fn, args, kwargs, e, scope):
        return ev.call(fn.func, list(fn.args) + list(args), {**fn.keywords, **kwargs}, e, scope)


class Scripted(Kind):
    """A TorchScript function (`@torch.jit.script`): its Python original is inlined, as
    torch.compile inlines it (`_torchdynamo_inline`, which torch.jit.script sets). Called as an
    op, TorchScript's executor ran on capture's stand-ins, and after eager runs of it on a GPU
    (a profiled, fused graph) its results there no longer said where eager's are (DeBERTa's
    relative positions); inlined, its ops are fused with their neighbours too."""

    def call(self, ev, fn, args, kwargs, e, scope):
        return ev.call(fn._torchdynamo_inline, args, kwargs, e, scope)


class Class(Kind):
    """A class, called: a builtin type folds on constants, a torch class is made with constant
    arguments (a module without state is the capture's own object), and an object of a Python
    class is allocated and its `__init__` evaluated (objects.Objects.new_object)."""

    def call(self, ev, cls, args, kwargs, e, scope):
        if issubclass(cls, (int, float, bool, str, tuple, list, dict, set, range, slice, enumerate, zip,
                            reversed)) and not _runs_python(cls) or C.is_pure_foldable(cls):
            mutable = issubclass(cls, (list, dict, set))
            if cls.__module__ == "builtins" or not (mutable or contains_tensor([args, kwargs])) \
                    or issubclass(cls, tuple):
                return ev.fold(cls, args, kwargs, e, scope)
            # a subclass of list or dict (an OrderedDict filled item by item, a ModelOutput-like
            # dict with attribute access): the capture's own object, made by its C `__init__`,
            # whose writes and return are the capture's (folded, it held graph values unseen)
            return ev.new_object(cls, args, kwargs, e, scope)
        if cls.__module__.startswith("torch") and not contains_tensor([args, kwargs]):
            # torch objects (Size, dtype, device, a module without parameters) from constants
            ev.domain.torch_receives([args, kwargs])
            if any(isinstance(v, Unknown) for v in leaves([args, kwargs])):
                return ev.abstract_torch_object(cls, e, scope)
            r = cls(*args, **kwargs)
            if isinstance(r, nn.Module) and (any(True for _ in r.parameters()) or any(True for _ in r.buffers())):
                ev.brk(B.UNSUPPORTED_EXPR, e, scope, detail=(
                    f"a new `{cls.__name__}` with parameters on each call (make it in __init__)"))
            if hasattr(r, "__dict__") and not isinstance(r, torch.Tensor):
                # an object of a Python class (a module without state, a distribution's transform):
                # the capture's own, as eager makes one on each call (a tensor is none: the state a
                # Python object's rebuild copies is not its data)
                ev.effects.fresh(r)
            return r
        return ev.new_object(cls, args, kwargs, e, scope)


OBJECT, PYTHON_MODULE, TENSOR, TENSOR_METHOD, SYMINT, UNKNOWN_VALUE, STAND_IN, MODULE, GENERATOR, ARRAY_DATA = (
    Kind(), PythonModule(), Tensor(), TensorMethodKind(), SymbolicInt(), UnknownValue(), StandIn(), Module(),
    Generator(), ArrayData())
WEAK_REFERENCE = WeakReference()
PYTHON_FUNCTION, TORCH_FUNCTION, KNOWN_FUNCTION, C_METHOD, PURE, PARTIAL, CLASS, GETTER, NUMPY_FUNCTION = (
    PythonFunction(), TorchFunction(), KnownFunction(), CMethod(), PureFunction(), Partial(), Class(), Getter(),
    NumpyFunction())
ENVIRONMENT, ENVIRONMENT_METHOD, SCRIPTED = Environment(), EnvironmentMethod(), Scripted()

_HOOKS = ("__fl_abstract_getattr__", "__fl_abstract_call__", "__fl_abstract_iter__")
_C_METHODS = (types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType)
_BY_TYPE: dict = {}  # type -> the kind of its values, or _BY_VALUE where the value decides
_BY_VALUE = object()


def kind_of(v) -> Kind:
    t = type(v)
    k = _BY_TYPE.get(t)
    if k is None:
        k = _BY_TYPE[t] = _type_kind(t) or _BY_VALUE
    return _known_or_callable_kind(v) if k is _BY_VALUE else k  # (a callable: which one it is decides)


def _type_kind(t) -> Kind | None:
    """The kind every value of type `t` has; None where the value decides (callables)."""
    if issubclass(t, TensorVar):
        return TENSOR
    if issubclass(t, SymInt):
        return SYMINT
    if issubclass(t, (Unknown, AbstractSeq)):
        return UNKNOWN_VALUE
    if issubclass(t, TensorMethod):
        return TENSOR_METHOD
    if any(hasattr(t, h) for h in _HOOKS):
        return STAND_IN
    if issubclass(t, nn.Module):
        return MODULE
    if issubclass(t, environ.ENVIRONMENTS):
        return ENVIRONMENT
    if issubclass(t, environ.EnvironMethod):
        return ENVIRONMENT_METHOD
    if issubclass(t, GeneratorCall):
        return GENERATOR
    if issubclass(t, (LocalFunction, FunctionSource, BoundUserMethod)):
        return PYTHON_FUNCTION
    if issubclass(t, types.ModuleType):
        return PYTHON_MODULE
    if t is weakref.ref:  # (callable: before the callables below)
        return WEAK_REFERENCE
    if issubclass(t, (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType) + _C_METHODS) \
            or any("__call__" in vars(c) for c in t.__mro__[:-1]):
        # a callable (its instances are: `operator.itemgetter(0)`, `torch.no_grad()`, an OpOverload)
        return None
    if is_array_type(t):
        return ARRAY_DATA
    return OBJECT


def _known_or_callable_kind(fn) -> Kind:
    return KNOWN_FUNCTION if known_handler(fn) is not None else _callable_kind(fn)


def _callable_kind(fn) -> Kind:
    """What a callable capture does not know by identity is (the order matters: a torch
    function may be any of the types below)."""
    if isinstance(fn, torch.jit.ScriptFunction) and isinstance(getattr(fn, "_torchdynamo_inline", None), types.FunctionType):
        return SCRIPTED
    if C.is_torch_callable(fn):
        return TORCH_FUNCTION
    if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        return PYTHON_FUNCTION
    if isinstance(fn, _C_METHODS) or isinstance(fn, (types.BuiltinMethodType, types.MethodType)) \
            and not isinstance(fn.__self__, (types.ModuleType, type(None))):
        # (a compiled method bound to its object, Cython's too (`np.random.permutation` on the
        # global RandomState): code capture cannot read, on the object's state)
        return C_METHOD
    if isinstance(fn, types.FunctionType):
        return PYTHON_FUNCTION
    if isinstance(fn, type):
        return CLASS
    if isinstance(fn, functools.partial):
        return PARTIAL
    if isinstance(fn, (operator.itemgetter, operator.attrgetter)):
        return GETTER
    if C.is_pure_foldable(fn):
        return PURE
    if C.is_numpy_function(fn):
        return NUMPY_FUNCTION
    return OBJECT


def _c_method_self(fn, args):
    """The object a method written in C (`object.__setattr__`, `OrderedDict.__setitem__`,
    a bound `dict.keys`) is called on."""
    if isinstance(fn, (types.MethodWrapperType, types.BuiltinMethodType, types.MethodType)):
        return fn.__self__
    return args[0] if args else None


def _name(fn) -> str:
    fn = getattr(fn, "fn", fn) if isinstance(fn, BoundUserMethod) else fn
    return getattr(fn, "__qualname__", None) or getattr(fn, "qualname", None) or type(fn).__name__


def _short(node, limit=60) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."

