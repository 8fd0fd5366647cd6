"""What a standard-library call that capture runs natively reads of the process's state.

Capture runs the standard library on plain values natively and takes the result as a constant
(kinds.PythonFunction). That holds for computations on their arguments (`inspect.signature`,
`copy.deepcopy` of a config), not for calls that read the process's state, which eager reads
anew on every call: the environment (`os.path.expandvars`, `os.path.expanduser`,
`getpass.getuser`), the file system and the working directory (`os.path.exists`,
`os.path.abspath`), the clock, randomness (`uuid.uuid4`), the current thread. So such a call
runs watched (a profile function, this thread only): its reads of `os.environ` are guarded by
value as capture's own are (environ.py), and a call into C code that reads other state (the
`os`, `time`, `_thread`, `_random`, `io` files... modules' functions) makes the call a break, run
in Python on every call. The modules below compute on their arguments alone and run unwatched
(a watched run is ~4x slower)."""
from __future__ import annotations

import os
import sys

from . import breaks as B
from . import environ

# standard-library modules of computations on values (their calls are many: unwatched)
UNWATCHED = frozenset({"inspect", "copy", "dataclasses", "typing", "enum", "functools", "re", "collections",
                       "string", "textwrap", "numbers", "abc", "keyword", "operator", "itertools", "math"})
# modules of C code that reads the process's state (files, clock, randomness, threads, users...)
_STATE_MODULES = frozenset({"posix", "nt", "time", "_thread", "_random", "pwd", "grp", "_socket", "_locale",
                            "resource", "_signal", "select", "fcntl", "_io", "io", "_winapi", "_posixsubprocess",
                            "datetime", "_datetime"})
_IN_MEMORY = ("StringIO", "BytesIO")  # (the `io` module's objects that are no file)
_ON_VALUES = frozenset(f"{m}.{name}" for m in ("posix", "nt") for name in (  # (`os.path.join` calls them)
    "fspath", "_path_normpath", "_path_splitroot", "_path_splitroot_ex", "strerror"))
_ENV = type(os.environ)
_ENV_READS = {_ENV.__getitem__.__code__: "__getitem__", _ENV.__iter__.__code__: "keys",
              _ENV.__len__.__code__: "__len__"}


def watched(fn, args, kwargs):
    """`fn(*args, **kwargs)` run natively: (its result, the reads of the environment it made as
    (env, method, key), the first state-reading C function it called or None)."""
    env_reads, state = [], []

    def profile(frame, event, arg):
        if event == "call":
            name = _ENV_READS.get(frame.f_code)
            if name is not None:
                env_reads.append((frame.f_locals.get("self"), name, frame.f_locals.get("key")))
        elif event == "c_call" and not state:
            where = _c_function(arg)
            if where is not None:
                state.append(where)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        r = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
    return r, env_reads, state[0] if state else None


def _c_function(fn) -> str | None:
    """`module.name` of a C function that reads the process's state, or None."""
    module, owner = getattr(fn, "__module__", None), getattr(fn, "__self__", None)
    if module is None and owner is not None:  # a method: the module of the C class defining it
        cls = owner if isinstance(owner, type) else type(owner)
        defining = next((c for c in cls.__mro__ if fn.__name__ in vars(c)), cls)
        if defining.__name__ in _IN_MEMORY:
            return None
        module = defining.__module__
    where = f"{module}.{getattr(fn, '__qualname__', fn.__name__)}"
    return where if module in _STATE_MODULES and where not in _ON_VALUES else None


def run(ev, fn, args, kwargs, e, scope):
    """A standard-library call on plain values, run natively: its result, with what it read of
    the environment guarded; a break where it read other state of the process."""
    if (getattr(fn, "__module__", None) or "").split(".")[0] in UNWATCHED:
        return ev.run_natively(fn, args, kwargs)
    r, env_reads, state = watched(ev.run_natively, (fn, args, kwargs), {})
    if state is not None:
        ev.brk(B.UNKNOWN_CALL, e, scope, detail=f"{getattr(fn, '__qualname__', fn)} reads the process's state "
                                                f"({state}), anew on every call")
    for env, name, key in env_reads:
        environ.guard(ev, env, name, [key] if key is not None else [])
    return r

