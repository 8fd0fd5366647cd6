"""Python side effects of captured code, replayed exactly once.

Capture never mutates a real object. A list, dict or set reached from outside the function
(an argument, a global, an attribute, a closure) is *modelled*: the evaluator works on a copy
(one per real object, so aliasing is kept) whose items are wrapped like any external value.
Every mutation of a container during capture (a method that changed it, an item assignment,
a `del`) is logged with the container's previous contents:

- the log of mutations of modelled containers is replayed by the transformed function on
  the real objects, in order, right after the graph call that precedes them (their
  arguments materialized there: graph outputs, sizes of this call, constants);
- the previous contents undo the mutations of a statement that is rolled back out of the
  graph (it then runs in Python and makes them itself), for the function's own containers
  too.

An attribute assignment on an object from outside (`self.count += 1`, `obj.cache = t`) is
logged the same way: capture reads the assigned value back, the transformed function assigns.

A container the function creates needs no replay: where it escapes (stored into a modelled
container, returned, passed across a break) it is materialized with its contents. So is an
object of a Python class the function creates (`ModelOutput(...)`, a cache, a dataclass): it is
*fresh*, owned by the capture, changed in place during capture (each change snapshotted, so a
rolled-back statement undoes it) and rebuilt with `rebuild` where it escapes."""
from __future__ import annotations

import copy
import functools
import inspect
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch.nn as nn

from .guards import SRC, arg
from .values import TensorVar, Unknown

MUTABLE = (list, dict, set)


@dataclass(eq=False)
class Mutation:
    obj: object        # the container that changed (a model or one of the function's own)
    name: str          # the method: `append`, `__setitem__`, `__delitem__`...
    args: tuple
    kwargs: dict
    before: object     # its contents before, to undo


class SideEffects:
    def __init__(self, sources=None):
        self.sources = sources                  # capture.Sources (None: abstract domain)
        self._models: dict[int, tuple] = {}    # id(real) -> (real, model)
        self._sources: dict[int, tuple] = {}   # id(model) -> (model, source, real object)
        self.log: list[Mutation] = []
        self._observed: set[int] = set()
        self._attrs: dict[int, dict] = {}      # id(object) -> attributes assigned in capture
        self._fresh: dict[int, object] = {}    # id(object) -> object made by the captured code

    def observe(self, v) -> None:
        """The capture reads the contents of `v`: if `v` is a model, what was read must hold
        on the next call, so the real object's contents on entry are guarded (an argument's
        are already; a global log only appended to needs none, and keeps one cache entry)."""
        if self.sources is None or id(v) in self._observed:
            return
        src = self.source(v)
        if src is None:
            return
        self._observed.add(id(v))
        self.sources.guard_argument(src, self.real(v), {})

    def observe_len(self, v) -> None:
        """The capture reads `len(v)` (blind writes change it alike on every call)."""
        src = self.source(v)
        if self.sources is None or src is None or id(v) in self._observed:
            return
        real = self.real(v)
        self.sources.guard(f"type({SRC}) is {type(real).__name__} and len({SRC}) == {len(real)}",
                           f"{src}: {type(real).__name__} of length {len(real)}", src)

    def observe_item(self, v, key) -> None:
        """The capture reads `v[key]`: while `v` is as on entry, only that item is guarded
        (a large global table read at one key keeps one guard)."""
        src = self.source(v)
        if self.sources is None or src is None or id(v) in self._observed:
            return
        real = self.real(v)
        present = key in real if isinstance(real, dict) else \
            type(key) is int and 0 <= key < len(real) if isinstance(real, list) else False
        if not present or any(m.obj is v for m in self.log) or not _is_key(key):
            self.observe(v)
            return
        self.sources.guard(f"type({SRC}) is {type(real).__name__}", f"{src} is a {type(real).__name__}", src)
        self.sources.guard_argument(f"{src}[{key!r}]", real[key], {})

    # -- models ------------------------------------------------------------------------------
    def model(self, real, src, wrap_item):
        """The capture's copy of the external container `real` (found at `src`), its items
        wrapped by `wrap_item(value, source)`; the same copy each time `real` is reached."""
        hit = self._models.get(id(real))
        if hit is not None:
            first = self.source(hit[1])
            if self.sources is not None and first is not None and src is not None and src != first:
                # one object by two names: mutations through either reach both
                self.sources.guard(f"{SRC} is {arg(1)}", f"{src} is the same object as {first}", src, first)
            return hit[1]
        m = type(real)()
        self._models[id(real)] = (real, m)  # before the items: a container may hold itself
        self._sources[id(m)] = (m, src, real)
        if isinstance(real, list):
            m.extend(wrap_item(x, _item(src, i)) for i, x in enumerate(real))
        elif isinstance(real, dict):
            for k, x in real.items():
                m[k] = wrap_item(x, _item(src, k))
        else:
            m.update(real)
        return m

    def source(self, obj) -> str | None:
        """Where the real object of model `obj` is found (None: not a model)."""
        hit = self._sources.get(id(obj))
        return hit[1] if hit is not None and hit[0] is obj else None

    def real(self, obj):
        """The real object of model `obj` (None: not a model)."""
        hit = self._sources.get(id(obj))
        return hit[2] if hit is not None and hit[0] is obj else None

    # -- mutations ---------------------------------------------------------------------------
    def call(self, obj, name: str, args, kwargs):
        """`obj.name(*args, **kwargs)` on one of the capture's containers, logged if it
        changed `obj`."""
        before = contents(obj)
        r = getattr(obj, name)(*args, **kwargs)
        if changed(obj, before):
            self.log.append(Mutation(obj, name, tuple(_stored_or_copy(obj, before, a) for a in args),
                                     {k: _stored_or_copy(obj, before, a) for k, a in kwargs.items()},
                                     before))
        return r

    def setattr(self, obj, src, attr: str, v) -> None:
        """`obj.attr = v` on an object from outside (at `src`): capture reads `v` back from
        here, the transformed function makes the assignment."""
        self._sources.setdefault(id(obj), (obj, src, obj))
        assigned = self._attrs.setdefault(id(obj), {})
        before = (attr in assigned, assigned.get(attr))
        assigned[attr] = v
        self.log.append(Mutation(obj, "__setattr__", (attr, v), {}, before))

    def getattr(self, obj, attr: str):
        """(True, value) if capture assigned `obj.attr`, else (False, None)."""
        assigned = self._attrs.get(id(obj))
        if assigned is None or attr not in assigned or self._sources[id(obj)][0] is not obj:
            return False, None
        return True, assigned[attr]

    # -- objects the captured code made ---------------------------------------------------------
    def fresh(self, obj) -> None:
        self._fresh[id(obj)] = obj

    def is_fresh(self, obj) -> bool:
        return id(obj) in self._fresh and self._fresh[id(obj)] is obj

    def touch(self, obj) -> None:
        """`obj` (fresh) is about to change: its state is kept to undo the change."""
        self.log.append(Mutation(obj, "__state__", (), {}, state(obj)))

    def mark(self) -> int:
        return len(self.log)

    def rollback(self, mark: int) -> None:
        """Undo the mutations logged since `mark` (newest first)."""
        while len(self.log) > mark:
            m = self.log.pop()
            if m.name == "__state__":
                set_state(m.obj, m.before)
            elif m.name == "__setattr__":
                had, old = m.before
                assigned = self._attrs[id(m.obj)]
                if had:
                    assigned[m.args[0]] = old
                else:
                    del assigned[m.args[0]]
            else:
                restore(m.obj, m.before)

    def guard_distinct(self) -> None:
        """Containers mutated here were distinct objects: the model of one does not see the
        other's mutations, so they must stay distinct."""
        mutated = {id(m.obj): m.obj for m in self.replays()}
        pairs = {tuple(sorted((self.source(m), src))) for m in mutated.values()
                 for other, src, _ in self._sources.values()
                 if other is not m and type(other) is type(m) and src is not None}
        for a, b in sorted(pairs):
            self.sources.guard(f"{SRC} is not {arg(1)}", f"{a} is not the same object as {b}", a, b)

    def replays(self) -> list[Mutation]:
        """The mutations of modelled containers: the transformed function makes them."""
        return [m for m in self.log if self.source(m.obj) is not None]


def plain_setattr(obj, attr) -> bool:
    """`obj.attr = v` only stores v (so capture can read it back): no `__setattr__` of the
    object's own, no property or slot; for a module, not one of its parameters or submodules
    (nn.Module.__setattr__ registers those)."""
    cls = type(obj)
    if isinstance(obj, (type, types.ModuleType, types.FunctionType, TensorVar, Unknown, *MUTABLE)):
        return False
    if cls.__setattr__ not in (object.__setattr__, nn.Module.__setattr__):
        return False
    if hasattr(inspect.getattr_static(cls, attr, None), "__set__"):
        return False
    return not isinstance(obj, nn.Module) or attr not in obj._parameters and attr not in obj._modules


def container_base(cls):
    """The builtin container a class derives from (OrderedDict before dict: it keeps its own
    order), whose C methods reach the items whatever the class overrides; None if none."""
    for base in (OrderedDict, dict, list, set):
        if issubclass(cls, base):
            return base
    return None


LIST_ITERATOR = type(iter([]))  # (capture's own `iter(...)`: builtins._iter)


def state(obj):
    """What a fresh object holds: its attributes and its items (as its builtin base sees them);
    for an iterator capture made (`iter(...)`), its position (builtins._next never exhausts it:
    a position stays one to go back to)."""
    if type(obj) is LIST_ITERATOR:
        reduced = obj.__reduce__()
        return None, reduced[2] if len(reduced) > 2 else None
    base = container_base(type(obj))
    items = None if base is None else list(base.items(obj)) if issubclass(base, dict) else list(base.__iter__(obj))
    attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else None
    slots = {n: getattr(obj, n) for n in _slots(type(obj)) if hasattr(obj, n)}
    return ({**(attrs or {}), **slots} if slots else attrs), items


@functools.cache
def _slots(cls) -> list:
    """The slot names of `cls` and its bases (inspect's BoundArguments keeps its state in slots)."""
    names = []
    for c in cls.__mro__:
        declared = c.__dict__.get("__slots__", ())
        names += [declared] if isinstance(declared, str) else [n for n in declared if n not in ("__dict__", "__weakref__")]
    return names


def set_state(obj, st) -> None:
    attrs, items = st
    if type(obj) is LIST_ITERATOR:
        if items is not None:
            obj.__setstate__(items)
        return
    if attrs is not None:
        slots = set(_slots(type(obj)))
        if hasattr(obj, "__dict__"):
            vars(obj).clear()
        for k, v in attrs.items():
            if k in slots:
                object.__setattr__(obj, k, v)
            else:
                vars(obj)[k] = v
    base = container_base(type(obj))
    if base is None:
        return
    base.clear(obj)
    if issubclass(base, dict):
        for k, v in items:
            base.__setitem__(obj, k, v)
    elif base is list:
        list.extend(obj, items)
    else:
        set.update(obj, items)


def rebuild(cls, state):
    """A fresh tuple (a named tuple, a structseq-like subclass) made again from its state (the
    transformed function calls this where it escapes): no `__init__` runs."""
    attrs, items = state
    obj = tuple.__new__(cls, items)
    if attrs:
        vars(obj).update(attrs)
    return obj


def _is_key(k) -> bool:
    """A key whose repr is a Python literal (a source can name the item)."""
    return type(k) in (int, str, bool) or type(k) is tuple and all(_is_key(x) for x in k)


def _item(src, key):
    return None if src is None else f"{src}[{key!r}]"


def contents(obj):
    """A container's items (pairs for a dict), to tell whether a call changed it."""
    if isinstance(obj, dict):
        return list(obj.items())
    return list(obj) if isinstance(obj, list) else set(obj)


def changed(obj, before) -> bool:
    now = contents(obj)
    if isinstance(obj, set):
        return now != before
    if len(now) != len(before):
        return True
    if isinstance(obj, dict):
        return any(a[0] is not b[0] and a[0] != b[0] or a[1] is not b[1] for a, b in zip(now, before))
    return any(a is not b for a, b in zip(now, before))


def restore(obj, before):
    obj.clear()
    if isinstance(obj, list):
        obj.extend(before)
    else:
        obj.update(before)


def _stored_or_copy(obj, before, a):
    """A container argument the mutation stored (`log.append(items)`) is replayed as that
    object, with its contents where it is materialized; one it only read (`log.extend(items)`)
    as a copy of its contents now: a later change of it must not reach the replay."""
    if not isinstance(a, MUTABLE):
        return a
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
    old = (v for _, v in before) if isinstance(obj, dict) else before if isinstance(obj, list) else ()
    if sum(v is a for v in values) > sum(v is a for v in old):
        return a
    return copy.copy(a)
