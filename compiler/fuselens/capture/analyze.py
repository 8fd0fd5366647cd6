"""Capture in the abstract domain, for the editor: a file's source in, each function's graph
breaks out. No user code runs: the file is parsed, not imported; only a fixed set of library
modules (torch, math, logging, ...) is imported to know what their names mean. Tensors have
unknown shapes, unknown ints stay unknown, both arms of a branch on an unknown value are
analysed. Breaks come from the same evaluator rules as in the concrete domain."""
from __future__ import annotations

import ast
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import breaks as B
from . import calls as C
from .evaluator import Evaluator
from .graph import GraphBuilder
from .source import FunctionSource
from .values import UNKNOWN, BoundUserMethod, TensorVar, Unknown

# Modules whose names the analysis may resolve by importing them (libraries, never user code).
SAFE_MODULES = ("torch", "math", "operator", "functools", "itertools", "logging", "warnings",
                "numpy", "collections", "typing", "dataclasses", "fuselens")


@dataclass
class FunctionAnalysis:
    name: str
    qualname: str
    line: int
    col: int
    end_line: int
    end_col: int
    compiled: bool
    uses_torch: bool
    graph_count: int
    breaks: list[B.GraphBreak] = field(default_factory=list)


@dataclass
class SourceAnalysis:
    functions: list[FunctionAnalysis]
    syntax_error: tuple[int, int, str] | None = None


# -- abstract stand-ins for the file's classes and their instances --------------------------
# They answer the evaluator through its hooks: `__fl_abstract_getattr__` (attribute reads),
# `__fl_abstract_call__`, `__fl_abstract_iter__` (items of unknown number), `__fl_abstract_super__`.
_DESCRIPTORS = {"staticmethod", "classmethod", "property"}


def _descriptor(f: ast.FunctionDef, env) -> str | None:
    """Which of staticmethod/classmethod/property decorates `f` (None: a plain method)."""
    for d in f.decorator_list:
        if isinstance(d, ast.Name) and d.id in _DESCRIPTORS and d.id not in env:
            return d.id
    return None


class AbstractClass:
    def __init__(self, node: ast.ClassDef, env: dict, filename: str):
        self.node, self.env, self.filename = node, env, filename
        self._bases: list | None = None
        # a property's `@name.setter` / `.deleter` defs do not replace its getter when read
        self.methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)
                        and not any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
                                    for d in f.decorator_list)}
        self.class_attrs = {}
        for st in node.body:
            if isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        self.class_attrs[t.id] = st.value.value

    @property
    def bases(self) -> list:
        if self._bases is None:  # when first needed: a base may live in another module's source
            self._bases = []
            self._bases = [_resolve(b, self.env) for b in self.node.bases]
        return self._bases

    @property
    def is_module(self) -> bool:
        return any(isinstance(b, type) and issubclass(b, nn.Module) or
                   isinstance(b, AbstractClass) and b.is_module for b in self.bases)

    def function_source(self, f: ast.FunctionDef) -> FunctionSource:
        # `__class__`: what zero-argument super() reads in a method of this class
        return FunctionSource(f.name, f"{self.node.name}.{f.name}", self.filename, f, self.env,
                              closure={"__class__": self}, compile_disabled=_decorated_disabled(f, self.env))

    def method_source(self, name) -> FunctionSource | None:
        found = self.find(name)
        return None if found is None or found[1] is None else found[0].function_source(found[1])

    def find(self, name):
        """(the class that defines `name`, its def or None for a class attribute), searching the
        bases parsed from the file in order; None where it is not found there."""
        if name in self.methods:
            return self, self.methods[name]
        if name in self.class_attrs:
            return self, None
        for b in self.bases:
            if isinstance(b, AbstractClass):
                hit = b.find(name)
                if hit is not None:
                    return hit
        return None

    def lookup(self, name, instance, ev, e, scope):
        """`name` read on `instance` (None: on the class) as Python's descriptors would give it."""
        found = self.find(name)
        if found is None:
            return UNKNOWN  # a base the editor did not parse (nn.Module, a library class)
        owner, f = found
        if f is None:
            return owner.class_attrs[name]
        fs, kind = owner.function_source(f), _descriptor(f, owner.env)
        if kind == "staticmethod":
            return fs
        if kind == "classmethod":
            return BoundUserMethod(fs, self)
        if kind == "property":
            return UNKNOWN if instance is None else ev.inline(fs, [], {}, e, scope, self_value=instance)
        return fs if instance is None else BoundUserMethod(fs, instance)

    def __fl_abstract_getattr__(self, ev, attr, e, scope):
        return self.lookup(attr, None, ev, e, scope)

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        return AbstractInstance(self)

    def __fl_abstract_super__(self, instance):
        return AbstractSuper(self, instance)


class AbstractSuper:
    """`super()` in a method of a class parsed from the file: lookups start at its bases."""

    def __init__(self, cls: AbstractClass, instance):
        self.cls, self.instance = cls, instance

    def __fl_abstract_getattr__(self, ev, attr, e, scope):
        for b in self.cls.bases:
            if isinstance(b, AbstractClass) and b.find(attr) is not None:
                inst = self.instance if isinstance(self.instance, AbstractInstance) else None
                return b.lookup(attr, inst, ev, e, scope)
        return UNKNOWN


class AbstractInstance:
    """`self` (or an instance made in `__init__`): attributes from `self.x = ...` in the
    `__init__`s of its class and of the bases parsed from the file."""

    def __init__(self, cls: AbstractClass):
        self.cls = cls
        self._attrs: dict | None = None

    @property
    def attrs(self) -> dict:
        if self._attrs is None:  # lazily: instances nest (a model holds its layers)
            self._attrs = {}
            for c in reversed(_abstract_mro(self.cls)):
                init = c.methods.get("__init__")
                for st in ast.walk(init) if init is not None else ():
                    if isinstance(st, ast.Assign):
                        for t in st.targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                    and t.value.id == "self":
                                self._attrs[t.attr] = _static_value(st.value, c.env)
        return self._attrs

    def __fl_abstract_getattr__(self, ev, attr, e, scope):
        if attr in self.attrs:
            return self.attrs[attr]
        return self.cls.lookup(attr, self, ev, e, scope)

    def __getitem__(self, idx):
        return UNKNOWN

    def __fl_abstract_iter__(self):
        return UNKNOWN

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        fs = self.cls.method_source("forward" if self.cls.is_module else "__call__")
        if fs is None:
            return UNKNOWN
        return ev.inline(fs, args, kwargs, e, scope, self_value=self)


def _abstract_mro(cls: AbstractClass) -> list:
    out = [cls]
    for b in cls.bases:
        if isinstance(b, AbstractClass):
            out += [c for c in _abstract_mro(b) if c not in out]
    return out


class AbstractModule:
    """An instance of a torch.nn module class, constructed with unknown arguments; a container
    (ModuleList, Sequential, ModuleDict) knows what it holds where the construction says
    (`nn.ModuleList([Layer(config) for _ in ...])`)."""

    def __init__(self, cls, element=UNKNOWN):
        self.cls = cls
        self.element = element

    def __fl_abstract_getattr__(self, ev, attr, e, scope):
        return UNKNOWN

    def __fl_abstract_iter__(self):
        return self.element if issubclass(self.cls, (nn.ModuleList, nn.Sequential)) else UNKNOWN

    def __getitem__(self, idx):
        return self if isinstance(idx, slice) else self.element

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        return TensorVar(None, None, None)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _element(call: ast.Call, env):
    """What a module container made by `call` holds, if its items are all alike."""
    items = list(call.args)
    if len(items) == 1 and isinstance(items[0], (ast.List, ast.Tuple)):
        items = items[0].elts
    elif len(items) == 1 and isinstance(items[0], (ast.ListComp, ast.GeneratorExp)):
        items = [items[0].elt]
    values = [_static_value(x, env) for x in items]
    kinds = {(type(v), getattr(v, "cls", None)) for v in values}
    return values[0] if len(kinds) == 1 and not isinstance(values[0], Unknown) else UNKNOWN


def _static_value(expr, env):
    """What `self.x = <expr>` in __init__ holds, without running anything."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Call):
        f = _resolve(expr.func, env)
        if isinstance(f, type) and issubclass(f, nn.Module):
            return AbstractModule(f, _element(expr, env) if issubclass(f, _CONTAINERS) else UNKNOWN)
        if isinstance(f, AbstractClass):
            return AbstractInstance(f)
    return UNKNOWN


def _resolve(expr, env):
    if isinstance(expr, ast.Name):
        return env.get(expr.id, UNKNOWN)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, env)
        if isinstance(base, Unknown) or isinstance(base, (AbstractClass, AbstractInstance)):
            return UNKNOWN
        return getattr(base, expr.attr, UNKNOWN)
    return UNKNOWN


# -- the module's names -----------------------------------------------------------------------
def _safe_import(name: str):
    if name.split(".")[0] not in SAFE_MODULES:
        return UNKNOWN
    try:
        return importlib.import_module(name)
    except Exception:
        return UNKNOWN


class SourceModule:
    """A module of the package the file belongs to (`from ...utils import logging`), known from
    its source: read and parsed when a name of it is first used, never imported."""

    _cache: dict = {}  # (path, mtime) -> its names

    def __init__(self, path: str):
        self.path = path

    def _env(self) -> dict:
        key = (self.path, os.path.getmtime(self.path))
        env = SourceModule._cache.get(key)
        if env is None:
            with open(self.path, encoding="utf-8") as f:
                env = module_env(ast.parse(f.read(), self.path), self.path)
            SourceModule._cache[key] = env
        return env

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self._env().get(name, UNKNOWN)
        except (OSError, SyntaxError, ValueError, RecursionError):
            return UNKNOWN


def _module_file(path: str) -> str | None:
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _relative_module(filename: str, level: int, module: str | None, name: str):
    """What `from <level dots><module> import <name>` names in the file's package: a module (a
    SourceModule), or a name defined in one (read when first used); UNKNOWN if not found."""
    base = os.path.dirname(os.path.abspath(filename))
    for _ in range(level - 1):
        base = os.path.dirname(base)
    package = os.path.join(base, *(module.split(".") if module else []))
    sub = _module_file(os.path.join(package, name))
    if sub is not None:
        return SourceModule(sub)
    owner = _module_file(package)
    return UNKNOWN if owner is None else LazyName(SourceModule(owner), name)


class LazyName:
    """A name imported from another module's source, in a ModuleEnv until first read."""

    def __init__(self, module: SourceModule, name: str):
        self.module, self.name = module, name


class ModuleEnv(dict):
    """A module's names; those imported from the package's other modules resolved when read
    (reading every module a file imports from would parse the whole package). `stars`: the
    modules of its `from ... import *`, searched for a name it does not define itself (only
    those whose source may define it are parsed: `_may_define`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.stars: list[SourceModule] = []
        self._not_in_stars: set = set()  # (names looked for there and not found)

    def __getitem__(self, key):
        if not dict.__contains__(self, key):
            v = self._from_stars(key)
            if v is None:
                raise KeyError(key)
            dict.__setitem__(self, key, v)
            return v
        v = dict.__getitem__(self, key)
        if isinstance(v, LazyName):
            dict.__setitem__(self, key, UNKNOWN)  # (an import cycle reads it as unknown)
            v = getattr(v.module, v.name)
            dict.__setitem__(self, key, v)
        return v

    def _from_stars(self, key):
        if key.startswith("_") or not self.stars or key in self._not_in_stars:
            return None  # (`import *` brings no private names)
        for star in self.stars:
            if _may_define(star.path, key):
                v = getattr(star, key)
                if not isinstance(v, Unknown):
                    return v
        self._not_in_stars.add(key)
        return None

    def __contains__(self, key):
        return dict.__contains__(self, key) or self._from_stars(key) is not None

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default


_SOURCE_TEXT: dict = {}  # (path, mtime) -> (source text, has `import *`)


def _may_define(path: str, name: str) -> bool:
    """Whether the module at `path` may export `name`: the name is in its source, or it
    re-exports other modules with `import *` (a package's `__init__`)."""
    try:
        key = (path, os.path.getmtime(path))
        hit = _SOURCE_TEXT.get(key)
        if hit is None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            hit = _SOURCE_TEXT[key] = (text, "import *" in text)
    except (OSError, UnicodeDecodeError):
        return False
    return hit[1] or name in hit[0]


def _returned_value(fs: FunctionSource, depth=0):
    """What a call of a function known from source returns where all its `return`s agree (an
    object of a library class: transformers' `get_logger` returns `logging.getLogger(name)`),
    else unknown."""
    rets = [n.value for n in ast.walk(fs.node) if isinstance(n, ast.Return) and n.value is not None]
    vals = [_top_level_value(r, fs.globals, depth + 1) for r in rets] if depth < 4 else []
    if vals and all(isinstance(v, AbstractObject) and v.cls is vals[0].cls for v in vals):
        return vals[0]
    return UNKNOWN


class AbstractObject:
    """An object of a library class, not made: what the editor knows is its type."""

    def __init__(self, cls: type):
        self.cls = cls

    def __fl_abstract_getattr__(self, ev, attr, e, scope):
        return AbstractMethod(self.cls, attr)


class AbstractMethod:
    """`obj.name` of an AbstractObject, called: every method of a logger is a logging call
    (torch.compile breaks on each: GB0291), whatever adds it (transformers' `warning_once`)."""

    def __init__(self, cls: type, name: str):
        self.cls, self.name = cls, name

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        if issubclass(self.cls, (logging.Logger, logging.LoggerAdapter)):
            ev.brk(B.LOGGING, e, scope, detail=f"call to {self.cls.__name__}.{self.name}")
        return UNKNOWN


def _source_import(filename: str, module: str, name: str | None = None):
    """`import <module>` / `from <module> import <name>` read from source, never imported: a
    module beside the file (a script's directory is the first place Python looks: the user's
    other files), else one of an installed library (on sys.path; not the standard library's,
    which stays unknown); None if there is no such file."""
    if module.split(".")[0] in sys.stdlib_module_names:
        return None
    for d in [os.path.dirname(os.path.abspath(filename))] + [p for p in sys.path if p]:
        package = os.path.join(d, *module.split("."))
        if name is not None:
            sub = _module_file(os.path.join(package, name))
            if sub is not None:
                return SourceModule(sub)
        owner = _module_file(package)
        if owner is not None:
            return SourceModule(owner) if name is None else LazyName(SourceModule(owner), name)
    return None


def _import(filename: str, module: str):
    v = _safe_import(module)
    if isinstance(v, Unknown) and module.split(".")[0] not in SAFE_MODULES:
        v = _source_import(filename, module) or UNKNOWN
    return v


def _star_module(filename: str, s: ast.ImportFrom):
    """The module of `from <module> import *`, known from its source (None if not found)."""
    if s.level == 0:
        mod = _source_import(filename, s.module) if s.module else None
        return mod if isinstance(mod, SourceModule) else None
    base = os.path.dirname(os.path.abspath(filename))
    for _ in range(s.level - 1):
        base = os.path.dirname(base)
    path = _module_file(os.path.join(base, *(s.module.split(".") if s.module else [])))
    return SourceModule(path) if path is not None else None


def _type_checking(test) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def module_env(tree: ast.Module, filename: str) -> dict:
    env: dict = ModuleEnv({"__name__": "__fuselens_abstract__"})
    body = list(tree.body)
    for s in body:
        if isinstance(s, ast.If) and _type_checking(s.test):
            # what a lazily importing package exports (transformers' `_LazyModule`), as written for
            # type checkers: its imports, read like the module's own
            body.extend(x for x in s.body if isinstance(x, (ast.Import, ast.ImportFrom)))
        elif isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names):
            star = _star_module(filename, s)
            if star is not None:
                env.stars.append(star)
        elif isinstance(s, ast.Import):
            for a in s.names:
                if a.asname:
                    env[a.asname] = _import(filename, a.name)
                else:
                    root = a.name.split(".")[0]
                    env[root] = _import(filename, root)
        elif isinstance(s, ast.ImportFrom) and s.level > 0:
            for a in s.names:  # the package's own modules: read, never imported
                env[a.asname or a.name] = _relative_module(filename, s.level, s.module, a.name)
        elif isinstance(s, ast.ImportFrom) and s.module:
            mod = _safe_import(s.module)
            for a in s.names:
                v = getattr(mod, a.name, UNKNOWN) if not isinstance(mod, Unknown) else UNKNOWN
                if isinstance(v, Unknown) and not isinstance(mod, Unknown):
                    v = _safe_import(f"{s.module}.{a.name}")
                if isinstance(mod, Unknown) and s.module.split(".")[0] not in SAFE_MODULES:
                    v = _source_import(filename, s.module, a.name) or UNKNOWN
                env[a.asname or a.name] = v
        elif isinstance(s, ast.FunctionDef):
            env[s.name] = FunctionSource(s.name, s.name, filename, s, env,
                                         compile_disabled=_decorated_disabled(s, env))
        elif isinstance(s, ast.ClassDef):
            env[s.name] = AbstractClass(s, env, filename)
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            value = _top_level_value(s.value, env) if s.value is not None else UNKNOWN
            for t in targets:
                if isinstance(t, ast.Name):
                    env[t.id] = value
    return env


def _top_level_value(expr, env, depth=0):
    try:
        return ast.literal_eval(expr)
    except Exception:
        pass
    if isinstance(expr, ast.Call):
        f = _resolve(expr.func, env)
        if f is logging.getLogger:  # a logger: calls on it are logging breaks
            return AbstractObject(logging.Logger)
        if isinstance(f, FunctionSource):
            return _returned_value(f, depth)
        if isinstance(f, type) and issubclass(f, nn.Module):
            return AbstractModule(f)
        if isinstance(f, AbstractClass):
            return AbstractInstance(f)
    v = _resolve(expr, env)
    return v


# -- which functions are compiled ---------------------------------------------------------------
def _is_compile(fn_value) -> bool:
    # fuselens.compile by its name: the package face is a layer above capture
    return fn_value is torch.compile or (getattr(fn_value, "__module__", None) == "fuselens"
                                         and getattr(fn_value, "__qualname__", None) == "compile")


def _compiled_names(tree, env) -> tuple[set, list]:
    """Names of the functions compiled in this file, and the classes (AbstractClass values, of
    this file or another one it imports) whose instances are compiled here:
    `torch.compile(f)`, `torch.compile(Net())`, `m = Net(); torch.compile(m)`, `m.compile()`,
    `torch.compile(m.forward)`, with `fuselens.compile` alike."""
    fns, classes = set(), []
    instances: dict[str, AbstractClass] = {}

    def cls_of(expr):
        v = _resolve(expr, env)
        return v if isinstance(v, AbstractClass) else None

    def add(c):
        if c is not None and all(c is not k for k in classes):
            classes.append(c)

    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and cls_of(n.value.func) is not None:
            for t in n.targets:
                if isinstance(t, ast.Name):
                    instances[t.id] = cls_of(n.value.func)
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = _resolve(n.func, env)
        if _is_compile(f) and n.args:
            a = n.args[0]
            if isinstance(a, ast.Name):
                if cls_of(a) is not None:
                    add(cls_of(a))
                elif a.id in instances:
                    add(instances[a.id])
                else:
                    fns.add(a.id)
            elif isinstance(a, ast.Call):
                add(cls_of(a.func))
            elif isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.attr == "forward":
                add(instances.get(a.value.id))
        elif isinstance(n.func, ast.Attribute) and n.func.attr == "compile" and \
                isinstance(n.func.value, ast.Name) and n.func.value.id in instances:
            add(instances[n.func.value.id])
    return fns, classes


def compiled_elsewhere(source: str, filename: str) -> set[tuple[str, str]]:
    """(file, class name) of each class defined in another file whose instances this file
    compiles: that file's `forward` of the class is compiled code (read, never executed)."""
    if "compile" not in source:
        return set()
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    env = module_env(tree, filename)
    here = os.path.realpath(filename)
    return {(os.path.realpath(c.filename), c.node.name) for c in _compiled_names(tree, env)[1]
            if os.path.realpath(c.filename) != here}


def _decorated_disabled(f: ast.FunctionDef, env) -> bool:
    """`@torch.compiler.disable` (or `torch._dynamo.disable`, called or not) decorates `f`."""
    for d in f.decorator_list:
        target = _resolve(d.func if isinstance(d, ast.Call) else d, env)
        if any(target is t for t in C.disable_decorators()):
            return True
    return False


def _decorated_compiled(f: ast.FunctionDef, env) -> bool:
    for d in f.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if _is_compile(_resolve(target, env)):
            return True
    return False


# Tensor methods no other common Python type has: calling one means the function uses torch.
_TENSOR_ONLY_METHODS = frozenset(
    m for m in dir(torch.Tensor) if not m.startswith("_") and not any(
        hasattr(t, m) for t in (list, dict, str, bytes, set, tuple, int, float)) and m not in {
        "sum", "mean", "max", "min", "all", "any", "copy", "item", "tolist", "reshape", "transpose",
        "astype", "view", "sort", "fill", "clip", "round", "std", "var", "prod", "cumsum", "dot",
        "flatten", "squeeze", "repeat", "take", "put", "resize", "argmax", "argmin", "nonzero",
        "size", "shape", "dtype", "T", "data", "real", "imag", "conj", "abs", "trace", "diagonal"})


def _uses_torch(f, env) -> bool:
    for n in ast.walk(f):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and n.func.attr in _TENSOR_ONLY_METHODS:
            return True
        if isinstance(n, ast.Name):
            v = env.get(n.id)
            mod = getattr(v, "__name__", "") if v is not None else ""
            if isinstance(v, type(torch)) and mod.startswith("torch"):
                return True
            if getattr(v, "__module__", "") and str(getattr(v, "__module__", "")).startswith("torch"):
                return True
    return False


# -- the analysis ----------------------------------------------------------------------------
def analyze_source(source: str, filename: str, compiled_classes=frozenset()) -> SourceAnalysis:
    """`compiled_classes`: names of this file's classes whose instances other files compile
    (see `compiled_elsewhere`)."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return SourceAnalysis([], (e.lineno or 1, max((e.offset or 1) - 1, 0), e.msg))
    env = module_env(tree, filename)
    fns, compiled = _compiled_names(tree, env)
    classes = set(compiled_classes) | {s.name for s in tree.body if isinstance(s, ast.ClassDef)
                                       and any(env.get(s.name) is c for c in compiled)}
    out = []
    for s in tree.body:
        if isinstance(s, ast.FunctionDef):
            compiled = s.name in fns or _decorated_compiled(s, env)
            out.append(_analyze_function(s, s.name, env, filename, compiled, None))
        elif isinstance(s, ast.ClassDef):
            cls = env.get(s.name)
            for f in s.body:
                if isinstance(f, ast.FunctionDef) and f.name != "__init__":
                    compiled = (s.name in classes and f.name == "forward") or _decorated_compiled(f, env)
                    out.append(_analyze_function(f, f"{s.name}.{f.name}", env, filename, compiled, cls))
    return SourceAnalysis(out)


def _analyze_function(f, qualname, env, filename, compiled, cls) -> FunctionAnalysis:
    uses = _uses_torch(f, env)
    found: list[B.GraphBreak] = []
    n_ops = 0
    if compiled or uses:
        fs = cls.function_source(f) if cls is not None else FunctionSource(f.name, qualname, filename, f, env)
        kind = _descriptor(f, env) if cls is not None else None
        builder = GraphBuilder(abstract=True)
        ev = Evaluator(builder, abstract=True, on_break=lambda b: _keep(b, ev, filename, found))
        frame = {}
        params = f.args.posonlyargs + f.args.args
        defaults = dict(zip([p.arg for p in params][len(params) - len(f.args.defaults):],
                            f.args.defaults))
        defaults.update({p.arg: d for p, d in zip(f.args.kwonlyargs, f.args.kw_defaults) if d})
        for i, p in enumerate(params + f.args.kwonlyargs):
            if i == 0 and cls is not None and kind != "staticmethod":
                frame[p.arg] = cls if kind == "classmethod" else AbstractInstance(cls)
            else:
                frame[p.arg] = _abstract_param(p, defaults.get(p.arg), builder)
        if f.args.vararg:
            frame[f.args.vararg.arg] = UNKNOWN
        if f.args.kwarg:
            frame[f.args.kwarg.arg] = UNKNOWN
        try:
            ev.run(fs, frame)
        except Exception:  # half-typed code: what was found so far stands
            pass
        n_ops = builder.n_ops
    seen, uniq = set(), []
    for b in found:
        key = (b.code, b.line, b.col, b.end_line, b.end_col, b.stack)
        if key not in seen:
            seen.add(key)
            uniq.append(b)
    graphs = (1 if n_ops else 0) + len(uniq)
    return FunctionAnalysis(f.name, qualname, f.lineno, f.col_offset, f.end_lineno or f.lineno,
                            f.end_col_offset or 0, compiled, uses, graphs, uniq)


def _keep(b, ev, filename, found):
    """A break on a path that may not run is reported where the user sees the condition (an
    unknown branch in this file); in code read from another file (a library's) only where the
    path to it is certain: there its conditions are a config's or the library's own state."""
    if all(f == filename for f in ev.domain.uncertain):
        found.append(b)


def _abstract_param(p: ast.arg, default, builder):
    """A parameter is taken for a tensor unless its annotation or default says otherwise;
    without a `Tensor` annotation, only assumed to be one (values.TensorVar.assumed)."""
    ann = ast.unparse(p.annotation) if p.annotation is not None else ""
    if ann and "Tensor" not in ann:  # `int`, `tuple[int, int]`, `LlamaConfig`, `Cache | None`
        return UNKNOWN
    if isinstance(default, ast.Constant) or isinstance(default, (ast.Tuple, ast.List)):
        return UNKNOWN
    tv = builder.abstract_input(p.arg)
    tv.assumed = not ann
    return tv
