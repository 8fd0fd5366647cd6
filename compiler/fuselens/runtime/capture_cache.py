"""Captures kept across processes: a later process's first call of a function takes what an earlier
process captured for it, instead of capturing again (a ResNet-50 training step: ~0.3-0.45 s of a
warm start on a GPU host).

A capture is written over its constants (capture.Capture's `namespace`): its transformed function,
its guard function and its graph's call name them. In one process they are the objects capture
saw, and guards compare modules, functions and classes by identity (`SRC is __fl_Conv2d_7`).
Another process has other objects, so a kept capture names each constant by how that process
finds it again, and is not kept where one has no such name:
- an nn.Module (or a function of no name: a decorator's wrapped one) by the source its identity
  guard reads (`self.layer1[0].conv1`), evaluated on the arguments of the call that loads it,
  parents first, stopping at the first module of another class (so its identity guards hold by
  construction), with no hooks (capture breaks at a call of a module with hooks);
- a function, builtin, class, enum member, Python module or module's globals by its qualified
  name (program_cache's `qualified_name`; a function's code, defaults and closure's contents
  compared by fingerprint);
- the function's own defaults and closure cells: this process's function's;
- None, numbers (NumPy's scalars too), strings, slices, dtypes, devices and sizes by value.
A tensor or any other object capture met makes the capture unkept.

What capture relied on without a guard, as constants of the process, is checked again instead:
- code: the hash of every source file capture ran or took a class or function from, and which
  file each module name it uses is; the methods of every class it holds (a module's class, a
  class constant) and of their bases, by their code (a method patched in one process only);
- modules' attributes it read as constants (`config.DEBUG`, a registry held in a global,
  `F.gelu`): read again, compared by value (an object of no value: by its class, as its guard);
- standard-library calls it ran natively: constants where they read only literals, code, objects
  the capture made and the attributes above; a capture that ran one on anything else (a config
  object's state) is not kept.

Kept: captures without a graph break (no resume functions, no break helpers); dynamic dims (a
recompile's, or `torch._dynamo.mark_dynamic`'s) are kept with the capture, and the process that
takes it compiles them dynamic and keeps them dynamic in its own recompiles. When it keeps one,
capture checks that the names give back the very objects of its
namespace (an unpickled constant that is not the object, a module source that reads another
module: not kept). A process takes a kept capture when the checks above pass and its guard
function holds for the call's arguments; otherwise it captures, and keeps the new capture beside
the others (up to KEPT_PER_FUNCTION). Names resolve only in modules already imported (importing
one would run its top-level code where eager does not). Entries live in
`$FUSELENS_CACHE_DIR/captures` under a hash of the function's file, module, qualified name, line and column,
the `fullgraph` setting and the compiler's version (program_cache.py, which also writes and checks
the files); FUSELENS_CAPTURE_CACHE=0 (or FUSELENS_PROGRAM_CACHE=0) turns it off. Anything that
fails here costs a capture, never a result: it is logged on `fuselens.runtime` at DEBUG.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import io
import logging
import marshal
import os
import pickle
import sys
import types
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from .. import settings
from ..capture.capture import Capture, GraphInfo
from ..capture.guards import SRC
from ..capture.resume import signature
from ..capture.values import NUMPY_SCALARS
from ..capture.source import FunctionSource, build_function, factory_code
from ..backend import program_cache
from ..backend.program_cache import qualified_name

FOLDER = "captures"
KEPT_PER_FUNCTION = 8
_log = logging.getLogger("fuselens.runtime")


def enabled() -> bool:
    return os.environ.get("FUSELENS_CAPTURE_CACHE", "1") != "0" and settings.program_cache_enabled()


Unstable = program_cache.Unstable  # a constant that another process has no name for


@dataclass
class Kept:
    """One capture as another process makes it again (see the module's text)."""
    files: dict            # source file -> sha256 of its bytes
    modules: dict          # module name -> its file, of the modules whose names it uses
    state: bytes           # what capture took as constants of the process: checked again (_process_state)
    values: bytes          # (the constants named by reference or by value, what each found one must be), pickled
    found: list            # (constant, the source its identity guard reads): modules, unnamed functions
    signature: str         # the guard function's parameters, as written
    function_source: str
    guard_source: str
    source: str
    guards: list
    tensor_shapes: dict
    graph: tuple           # (nodes as data, inputs, writeback, function, lines, op_count, name)
    codes: bytes           # the transformed, guard and resolver functions' code, marshalled (Capture.codes)
    dynamic: dict          # Capture.dynamic: graph inputs' dims of unguarded sizes


def key(fs: FunctionSource, fullgraph: bool) -> str | None:
    if not enabled() or fs.generated or not os.path.isfile(fs.filename):
        return None
    # (the column tells lambdas on one line apart: they share their file, qualname and line)
    where = (fs.filename, fs.globals.get("__name__"), fs.qualname, getattr(fs.node, "lineno", 0),
             getattr(fs.node, "col_offset", 0), fullgraph, program_cache._environment())
    return hashlib.sha256(settings.compiler_version().encode() + repr(where).encode()).hexdigest()


# -- keeping --------------------------------------------------------------------------------------
def keep(k: str, cap: Capture, args, kwargs) -> None:
    """Store `cap`, just captured from this call, under `k` (beside what is kept there already)."""
    if cap.graph_break is not None or cap.resumes or cap.helpers or cap.graph is None:
        return
    try:
        kept = _kept(cap, args, kwargs)
    except Exception as e:  # (Unstable, or anything else: the capture is just not kept)
        _log.debug("capture cache: %s not kept (%s: %s)", cap.fs.qualname, type(e).__name__, e)
        return
    others = [c for c in (program_cache.load(k, list, FOLDER) or []) if c.guard_source != kept.guard_source]
    program_cache.store(k, [kept] + others[:KEPT_PER_FUNCTION - 1], FOLDER)


def _kept(cap: Capture, args, kwargs) -> Kept:
    ns = cap.namespace
    found, values = [], {}  # found: (constant, (guard position, source), what it must be)
    facts = _facts(cap.guards, ns)
    defaults = signature(cap.fs.node.args, cap.fs.defaults)[1]  # (another process's are its own)
    for name, v in ns.items():
        if name in defaults:
            if defaults[name] is not v:
                raise Unstable(f"{name}: not the function's default")
        elif isinstance(v, nn.Module) or isinstance(v, types.FunctionType) and qualified_name(v) is None:
            if name not in facts:
                raise Unstable(f"{name}: a {type(v).__name__} no guard reads from the arguments")
            if isinstance(v, nn.Module) and _has_hooks(v):
                raise Unstable(f"{name}: a module with hooks")
            check = _class_print(type(v)) if isinstance(v, nn.Module) else _fingerprint(v)
            found.append((name, facts[name], check))
        elif _by_value(v) or _by_reference(v):
            values[name] = v
        else:
            raise Unstable(f"{name}: a {type(v).__name__}")
    if _global_hooks():
        raise Unstable("global module hooks")
    found.sort(key=lambda m: m[1][0])  # in the order capture guarded them (parents first)
    checks = [check for _, _, check in found]
    found = [(name, src) for name, (_, src), _ in found]
    params = cap.guard_source.split("\n", 1)[0][len("def __fl_guard("):-len("):")]
    classes = [c for c in values.values() if isinstance(c, type)]
    class_prints = [_class_print(c) for c in classes]
    blob = _pickle((values, checks, classes, class_prints), cap.fs, values)
    again, again_checks, again_classes, _ = _unpickle(blob, cap.fs)  # the names give back these very
    for name, v in values.items():                                     # objects, or nothing is kept
        w = again[name]
        if not (w is v or _by_value(v) and type(w) is type(v) and w == v):
            raise Unstable(f"{name}: {v!r} is not found again by its name")
    if again_checks != checks or any(a is not b for a, b in zip(again_classes, classes)):
        raise Unstable("a class is not found again by its name")
    resolve, resolve_code = _resolver(params, found, checks, dict(values, **defaults))
    objects = resolve(*args, **kwargs)
    if objects is None:
        raise Unstable("a module's source reads a module of another class")
    for (name, src), m in zip(found, objects):
        if m is not ns[name]:
            raise Unstable(f"{name}: {src} reads another object")
    files, modules = _files(cap, values, [c[0] for c in checks if isinstance(c, tuple)])
    reads, unchecked = cap.process_state
    if unchecked:
        raise Unstable(f"ran {unchecked[0]}")
    state = _pickle([(m, a, _state(v)) for (m, a), v in reads])
    modules.update((m, getattr(sys.modules.get(m), "__file__", None)) for (m, _), _ in reads)
    g = cap.graph
    graph = (_nodes(g.gm.graph), g.inputs, g.writeback, g.function, g.lines, g.op_count, g.name)
    return Kept(files, modules, state, blob, found, params, cap.function_source, cap.guard_source, cap.source,
                list(cap.guards), dict(cap.tensor_shapes), graph,
                marshal.dumps(dict(cap.codes, resolve=resolve_code)), dict(cap.dynamic))


def _facts(guards, ns) -> dict:
    """constant -> (the position of its identity guard, the source that guard finds it at), of
    modules and functions."""
    facts = {}
    for i, g in enumerate(guards):
        t = g.template
        if t is not None and t.startswith(f"{SRC} is ") and len(g.over) == 1:
            name = t[len(SRC) + 4:]
            if isinstance(ns.get(name), (nn.Module, types.FunctionType)) and name not in facts:
                facts[name] = (i, g.over[0])
    return facts


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _class_print(cls) -> tuple:
    """What a class must be in another process: the very class (by its name) with the same methods
    in it and its bases (a class's methods are not guarded: one patched in one process and not in
    the other differs here)."""
    return cls, tuple((c.__qualname__, tuple((k, _method_print(f)) for k, f in vars(c).items()
                                              if isinstance(f, _METHODS)))
                      for c in cls.__mro__ if c.__module__ != "builtins")


_METHODS = (types.FunctionType, staticmethod, classmethod, property)
_CODE_PRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _method_print(f) -> str | None:
    """A method's code, hashed (not its closure: a decorator's holds objects whose pickled state
    differs between processes; a method patched in is another function, of other code)."""
    if isinstance(f, (staticmethod, classmethod)):
        f = f.__func__
    if isinstance(f, property):
        return repr(tuple(_method_print(g) for g in (f.fget, f.fset, f.fdel) if g is not None))
    if not isinstance(f, types.FunctionType):
        return None
    return _code_print(f.__code__)


def _code_print(code) -> str:
    """A code object's hash, the same in every process where the code is (marshal's bytes are
    not: they depend on objects' reference counts)."""
    p = _CODE_PRINTS.get(code)  # (nn.Module's ~150 methods are in every module class's print)
    if p is None:
        h = hashlib.sha256(code.co_code)
        h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_name,
                       code.co_filename, code.co_flags, code.co_argcount, code.co_posonlyargcount,
                       code.co_kwonlyargcount)).encode())
        for k in code.co_consts:
            h.update(_code_print(k).encode() if isinstance(k, types.CodeType) else
                     repr(sorted(map(repr, k))).encode() if isinstance(k, frozenset) else
                     repr((type(k).__name__, k)).encode())
        p = _CODE_PRINTS[code] = h.hexdigest()
    return p


def _has_hooks(m: nn.Module) -> bool:
    return any(getattr(m, h, None) for h in _HOOKS)


def _global_hooks() -> bool:
    """Hooks registered for every module (capture takes a module's call as its forward)."""
    return any(getattr(nn.modules.module, "_global" + h, None) for h in _HOOKS)


_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, slice, range, type(...), torch.dtype,
                torch.device, torch.layout, torch.memory_format, torch.Size)
_CODE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
               types.WrapperDescriptorType, types.ClassMethodDescriptorType, types.GetSetDescriptorType)


def _state(v):
    """`v` as data equal in two processes where `v` is the same: a module by its name, a function
    by its name and fingerprint, anything else as the program cache's key writes it (an object by
    its pickled state), or by its class where it has none (a context variable: as its guard)."""
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    if isinstance(v, types.FunctionType):
        return ("function", qualified_name(v), _fingerprint(v))
    try:
        return program_cache._canonical(v)
    except Unstable:
        return ("object", _class_print(type(v)))


def _by_value(v) -> bool:
    if type(v) in (tuple, frozenset):
        return all(_by_value(x) for x in v)
    return type(v) in _VALUE_TYPES or isinstance(v, NUMPY_SCALARS)


def _by_reference(v) -> bool:
    return isinstance(v, (type, enum.Enum, types.ModuleType, types.CellType, *_CODE_TYPES)) or \
        _globals_of(v) is not None


def _globals_of(v) -> str | None:
    """The name of the module whose globals `v` is, or None."""
    if type(v) is not dict:
        return None
    name = v.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and mod.__dict__ is v else None


def _fingerprint(fn, seen=()) -> str | None:
    """A Python function's code, defaults and closure's contents (which capture read as they were),
    hashed, a function among them by its own fingerprint (a decorator's wrapped function has no
    name); None for a builtin."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if fn in seen:  # (a function whose closure holds itself)
        return "itself"
    try:
        closure = tuple(c.cell_contents for c in fn.__closure__ or ())
    except ValueError:  # an empty cell
        raise Unstable(f"{fn.__qualname__}: an empty closure cell") from None
    state = [_fingerprint(v, (*seen, fn)) if isinstance(v, types.FunctionType) else program_cache._canonical(v)
             for v in (*closure, *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).items())]
    return hashlib.sha256(_code_print(code).encode() + pickle.dumps(state, protocol=4)).hexdigest()


class _Pickler(program_cache._Pickler):
    """Code, Python modules, modules' globals and closure cells by name; nn.Modules and real tensors
    never (by value they would be copies: see the module's text). `fs`: the function captured, whose
    cells are named by its variables; `values`: functions whose cells are named by them."""

    def __init__(self, file, fs=None, values=()):
        super().__init__(file, protocol=4)
        self.cells = dict(fs.cells) if fs is not None else {}
        self.owners = [v for v in (values.values() if isinstance(values, dict) else values)
                       if isinstance(v, types.FunctionType) and v.__closure__]
        self.storages = {}  # a meta storage -> its _MetaStorage (one per storage: views share it)

    def reducer_override(self, obj):
        # a graph's meta values with their storages shared and their offsets (torch pickles a meta
        # tensor as a fresh one: a split's parts at offset 0, the backend's layouts otherwise)
        if type(obj) is not torch.Tensor or obj.device.type != "meta":
            return NotImplemented
        storage = obj.untyped_storage()
        ms = self.storages.get(storage._cdata)
        if ms is None:
            ms = self.storages[storage._cdata] = _MetaStorage(storage.nbytes())
        return _meta_tensor, (ms, tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.dtype, obj.requires_grad)

    def persistent_id(self, obj):
        if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, type)):
            return None  # (operators by the dispatch table, classes by pickle's own name)
        if isinstance(obj, nn.Module) or isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            raise Unstable(f"a {type(obj).__name__}")
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if isinstance(obj, _CODE_TYPES):
            return ("code", *self._name(obj), _fingerprint(obj))
        if isinstance(obj, types.CellType):
            return self._cell(obj)
        module = _globals_of(obj)
        if module is not None:
            return ("globals", module)
        return None

    def _name(self, obj):
        name = qualified_name(obj)
        if name is None:
            raise Unstable(f"{getattr(obj, '__qualname__', obj)!r}: no name another process finds")
        return name

    def _cell(self, cell):
        for var, c in self.cells.items():
            if c is cell:
                return ("cell", None, var)
        for fn in self.owners:
            for var, c in zip(fn.__code__.co_freevars, fn.__closure__):
                if c is cell:
                    return ("cell", ("code", *self._name(fn), _fingerprint(fn)), var)
        raise Unstable("a closure cell of no function named")


class _MetaStorage:
    __slots__ = ("nbytes", "storage")

    def __init__(self, nbytes):
        self.nbytes, self.storage = nbytes, None

    def __reduce__(self):
        return _MetaStorage, (self.nbytes,)


def _meta_tensor(ms: _MetaStorage, shape, stride, offset, dtype, requires_grad):
    if ms.storage is None:
        ms.storage = torch.empty(ms.nbytes, dtype=torch.uint8, device="meta").untyped_storage()
    t = torch.empty(0, dtype=dtype, device="meta").set_(ms.storage, offset, shape, stride)
    return t.requires_grad_(requires_grad)


class _Unpickler(pickle.Unpickler):
    """Names resolved in the modules this process has imported, never by importing one (its
    top-level code would run where eager's does not)."""

    def __init__(self, file, fs=None):
        super().__init__(file)
        self.fs = fs

    def find_class(self, module, name):
        _imported(module)
        return super().find_class(module, name)

    def persistent_load(self, pid):
        if pid[0] == "cell":
            if pid[1] is None:
                return self.fs.cells[pid[2]]
            fn = self.persistent_load(pid[1])
            return fn.__closure__[fn.__code__.co_freevars.index(pid[2])]
        kind, module = pid[0], pid[1]
        mod = _imported(module)
        if kind == "module":
            return mod
        if kind == "globals":
            return mod.__dict__
        obj = mod
        for part in pid[2].split("."):
            obj = getattr(obj, part)
        if qualified_name(obj) != (module, pid[2]) or _fingerprint(obj) != pid[3]:
            raise Unstable(f"{module}.{pid[2]}: another function, or its code changed")
        return obj


def _imported(module: str):
    mod = sys.modules.get(module)
    if mod is None:
        raise Unstable(f"module {module} is not imported")
    return mod


def _pickle(obj, fs=None, values=()) -> bytes:
    f = io.BytesIO()
    _Pickler(f, fs, values).dump(obj)
    return f.getvalue()


def _unpickle(blob: bytes, fs=None):
    return _Unpickler(io.BytesIO(blob), fs).load()


def _resolver(signature: str, found, checks, values: dict, code=None):
    """(`f(*args, **kwargs)` -> each found constant as the call's arguments lead to it, or None at
    the first module of another class (parents first: nothing is read through an object of a class
    the capture did not see); the code of its factory: `code`, from the process that kept it, or
    compiled here)."""
    lines = [f"def __fl_resolve({signature}):"]
    classes = {}
    for (name, src), check in zip(found, checks):
        lines.append(f"    {name} = {src}")
        if isinstance(check, tuple):
            cls = classes.setdefault(check[0], f"__fl_class_{len(classes)}")
            lines.append(f"    if type({name}) is not {cls}:\n        return None")
    lines.append(f"    return ({''.join(name + ', ' for name, _ in found)})")
    text = "\n".join(lines)
    consts = {name: cls for cls, name in classes.items()}
    code = code or factory_code(text, "__fl_resolve", consts)
    return build_function(text, "__fl_resolve", {"torch": torch, **values}, consts, code), code


# -- the files a capture was made from ----------------------------------------------------------------
def _files(cap: Capture, values: dict, classes) -> tuple[dict, dict]:
    """(source file -> its hash, module name -> its file): of what capture ran, and of the modules
    whose names the capture uses (in another process a name may be another file's module)."""
    paths, names = set(cap.files) | {cap.fs.filename}, set()
    for v in list(values.values()) + list(classes):
        for cls in (v.__mro__ if isinstance(v, type) else ()):
            names.add(cls.__module__)
        if isinstance(v, types.FunctionType):
            names.add(v.__module__)
            paths.add(v.__code__.co_filename)
        if isinstance(v, types.ModuleType):
            names.add(v.__name__)
        names.add(_globals_of(v))
    modules = {n: _module_file(n) for n in names if n is not None}
    hashes = {}
    for p in paths | set(modules.values()):
        if p is None or not p.endswith(".py"):
            continue  # builtins, extension modules: fixed by the versions in the compiler's hash
        h = _file_hash(p)
        if h is None:
            raise Unstable(f"{p}: not a file")
        hashes[p] = h
    return hashes, modules


def _module_file(name) -> str | None:
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return getattr(mod, "__file__", None)


def _file_hash(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _hash_of(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4096)
def _hash_of(path, mtime_ns, size) -> str | None:  # (a file read once while it stays as it is)
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


# -- graphs as data ---------------------------------------------------------------------------------
class _Ref:
    """A node named in another node's arguments or metadata."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return _Ref, (self.name,)


def _nodes(graph: fx.Graph) -> bytes:
    """The graph as a list (a linked graph pickles one recursion level per node), pickled; of each
    node's metadata, the entries that name nodes (few: `writes`) listed apart."""
    ref = lambda n: _Ref(n.name)
    data = []
    for n in graph.nodes:
        meta = dict(n.meta)
        linked = [k for k, v in meta.items() if _names_node(v)]
        for k in linked:
            meta[k] = fx.node.map_arg(meta[k], ref)
        data.append((n.op, n.name, n.target, fx.node.map_arg(n.args, ref), fx.node.map_arg(dict(n.kwargs), ref),
                     meta, linked, n.type))
    return _pickle(data)


def _names_node(v) -> bool:
    found = []
    fx.node.map_arg(v, found.append) if isinstance(v, (fx.Node, tuple, list, dict, slice)) else None
    return bool(found)


def _graph(blob: bytes) -> fx.Graph:
    graph, env = fx.Graph(), {}
    find = lambda r: env[r.name] if type(r) is _Ref else r
    for op, name, target, args, kwargs, meta, linked, type_expr in _unpickle(blob):
        node = graph.create_node(op, target, fx.node.map_aggregate(args, find),
                                 fx.node.map_aggregate(kwargs, find), name, type_expr)
        if node.name != name:
            raise ValueError(f"node {name} made as {node.name}")
        for k in linked:
            meta[k] = fx.node.map_aggregate(meta[k], find)
        node.meta = meta
        env[name] = node
    return graph


def _process_state(blob: bytes) -> bool:
    """Whether the modules' attributes capture took as constants of the process (a flag, a registry,
    a function looked up in a module) are as they were."""
    for module, attr, was in _unpickle(blob):
        mod = sys.modules.get(module)
        if mod is None or not hasattr(mod, attr) or _state(getattr(mod, attr)) != was:
            _log.debug("capture cache: %s.%s differs", module, attr)
            return False
    return True


# -- taking ------------------------------------------------------------------------------------------
def candidates(k: str, fs: FunctionSource, args, kwargs):
    """The captures kept under `k`, each made again with this process's objects for this call
    (newest first): the caller takes the first whose guard function holds."""
    kept_here = program_cache.load(k, list, FOLDER) or []
    if not kept_here:
        _log.debug("capture cache: nothing kept for %s", fs.qualname)
    for kept in kept_here:
        try:
            cap = _capture(kept, fs, args, kwargs)
        except Exception as e:
            _log.debug("capture cache: a capture of %s not taken (%s: %s)", fs.qualname, type(e).__name__, e)
            continue
        if cap is not None:
            yield cap


def _capture(kept: Kept, fs: FunctionSource, args, kwargs) -> Capture | None:
    for path, h in kept.files.items():
        if _file_hash(path) != h:
            _log.debug("capture cache: %s changed since a capture of %s", path, fs.qualname)
            return None
    for name, path in kept.modules.items():
        if getattr(sys.modules.get(name), "__file__", None) != path:
            _log.debug("capture cache: module %s is not %s's here", name, path)
            return None
    if _global_hooks() or not _process_state(kept.state):
        return None
    values, checks, classes, class_prints = _unpickle(kept.values, fs)
    prints = {}  # class -> its print, made once
    for cls, p in zip(classes, class_prints):
        prints[cls] = _class_print(cls)
        if prints[cls] != p:
            return None
    codes = marshal.loads(kept.codes)
    ns = dict(values, **signature(fs.node.args, fs.defaults)[1])  # the function's defaults here
    found = _resolver(kept.signature, kept.found, checks, ns, codes.pop("resolve"))[0](*args, **kwargs)
    if found is None:
        return None
    for (name, _), check, v in zip(kept.found, checks, found):
        if isinstance(check, tuple):
            cls = type(v)
            if cls not in prints:
                prints[cls] = _class_print(cls)
            if prints[cls] != check or _has_hooks(v):
                return None
        elif not isinstance(v, types.FunctionType) or _fingerprint(v) != check:
            return None
        ns[name] = v
    nodes, inputs, writeback, function, lines, op_count, name = kept.graph
    gm = _LazyGraphModule(nn.Module(), _graph(nodes))
    graph = GraphInfo(gm, inputs, writeback, function, lines, op_count, name)
    return Capture(fs, kept.source, ns, kept.guards, kept.guard_source, graph, None,
                   tensor_shapes=kept.tensor_shapes, function_source=kept.function_source,
                   files=set(kept.files), codes=codes, dynamic=kept.dynamic)
