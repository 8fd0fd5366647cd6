"""The process's environment (`os.environ`, `os.environb`, `os.getenv`) read by captured code.

Eager reads it on every call: `if os.environ.get("MODE") == "a":` takes the branch of the value
the variable has now. So capture reads it as a guarded source, as torch.compile does: what a call
read of it is guarded by value (a variable's value or its absence, a membership, its length, or
all of it where the code iterates or copies it), and a later call in which it differs captures
again. The guards name it through the `os` module (`__fl_os_3.environ.get('MODE') == 'a'`), a
name another process finds too: a capture kept on disk (runtime/capture_cache.py) is taken by a
process started with another value only where its guards hold there. A change to the
environment (`os.environ[k] = v`, `setdefault`, `pop`...) is a break: eager makes it in Python.
The editor knows no process's environment: what it reads is unknown."""
from __future__ import annotations

import hashlib
import os

from . import breaks as B
from .guards import SRC, literal
from .values import UNKNOWN

ENVIRONMENTS = (type(os.environ),)
# methods that read one variable (by its key), and those that change the environment
_BY_KEY = ("get", "__getitem__", "__contains__")
_WRITES = ("__setitem__", "__delitem__", "setdefault", "pop", "popitem", "update", "clear", "__ior__")


class EnvironMethod:
    """`os.environ.get` (or another method of the environment) read by captured code: its call
    is a guarded read (`read`); called in Python (where it escapes), it is the method itself."""
    __slots__ = ("env", "name")

    def __init__(self, env, name: str):
        self.env, self.name = env, name

    def __call__(self, *args, **kwargs):
        return getattr(self.env, self.name)(*args, **kwargs)


def method(env, name: str):
    """What reading `env.<name>` gives capture: the method as an EnvironMethod, or for anything
    else (`_data`, `encodekey`) the attribute itself."""
    if name in _BY_KEY or name in _WRITES or name in _WHOLE:
        return EnvironMethod(env, name)
    return getattr(env, name)


def read(ev, env, name: str, args, kwargs, e, scope):
    """`env.<name>(*args, **kwargs)` as eager computes it now, what it read guarded."""
    if not ev.domain.runs_python:
        return UNKNOWN
    if name in _WRITES:
        ev.brk(B.UNKNOWN_CALL, e, scope, detail=f"os.environ.{name}() changes the process's environment")
    guard(ev, env, name, args)  # (before the read, which may raise KeyError)
    return getattr(env, name)(*args, **kwargs)


def guard(ev, env, name: str, args) -> None:
    """Guard what `env.<name>(*args)` reads: one variable's value or absence, its membership,
    the environment's length, or all of it."""
    src = _source(ev, env)
    key = args[0] if args else None
    if name in _BY_KEY and isinstance(key, (str, bytes)):  # (a key of another type raises in eager)
        value = env.get(key)
        if name == "__contains__":
            ev.domain.guard(f"({literal(key)} in {SRC}) is {value is not None}",
                            f"{key!r} {'in' if value is not None else 'not in'} {src}", src)
        else:
            ev.domain.guard(f"{SRC}.get({literal(key)}) {'is' if value is None else '=='} {literal(value)}",
                            f"{src}[{key!r}] " + ("is unset" if value is None else f"== {value!r}"), src)
    elif name == "__len__":
        ev.domain.guard(f"len({SRC}) == {len(env)}", f"len({src}) == {len(env)}", src)
    elif name not in _BY_KEY:  # iterated or copied: all of it (by a digest: no secret is written out)
        ev.domain.guard(f"{ev.domain.constant(digest, 'environ_digest')}({SRC}) == {literal(digest(env))}",
                        f"{src} is as it was", src)


_WHOLE = ("keys", "values", "items", "copy", "__iter__", "__len__", "__eq__", "__or__", "__ror__")


def digest(env) -> str:
    """The environment's variables and values, hashed (a guard on all of it, kept on disk with a
    capture, writes no value out)."""
    return hashlib.sha256(repr(sorted(env.items())).encode()).hexdigest()


def _source(ev, env) -> str:
    """The environment as the guard function reads it: through the `os` module."""
    for name in ("environ", "environb"):
        if getattr(os, name, None) is env:
            return f"{ev.domain.constant(os, 'os')}.{name}"
    return ev.domain.constant(env, "environ")
