"""Capture in the abstract domain, for the editor: a file's source in, each function's graph
breaks out. No user code runs: the file is parsed, not imported; only a fixed set of library
modules (torch, math, logging, ...) is imported to know what their names mean. Tensors have
unknown shapes, unknown ints stay unknown, both arms of a branch on an unknown value are
analysed. Breaks come from the same evaluator rules as in the concrete domain."""
from __future__ import annotations

import ast
import importlib
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import breaks as B
from .evaluator import Evaluator
from .graph import GraphBuilder
from .source import FunctionSource
from .values import UNKNOWN, BoundUserMethod, TensorVar, Unknown

# Modules whose names the analysis may resolve by importing them (libraries, never user code).
SAFE_MODULES = ("torch", "math", "operator", "functools", "itertools", "logging", "warnings",
                "numpy", "collections", "typing", "dataclasses", "fuselens")
_NOT_TENSOR_ANNOTATIONS = {"int", "float", "bool", "str", "bytes", "list", "tuple", "dict",
                           "Optional[int]", "Optional[float]", "Sequence[int]"}


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
class AbstractClass:
    def __init__(self, node: ast.ClassDef, env: dict, filename: str, bases: list):
        self.node, self.env, self.filename, self.bases = node, env, filename, bases
        self.methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}

    @property
    def is_module(self) -> bool:
        return any(isinstance(b, type) and issubclass(b, nn.Module) or
                   isinstance(b, AbstractClass) and b.is_module for b in self.bases)

    def method_source(self, name) -> FunctionSource | None:
        f = self.methods.get(name)
        if f is None:
            for b in self.bases:
                if isinstance(b, AbstractClass):
                    fs = b.method_source(name)
                    if fs is not None:
                        return fs
            return None
        return FunctionSource(f.name, f"{self.node.name}.{f.name}", self.filename, f, self.env)

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        return AbstractInstance(self)


class AbstractInstance:
    """`self` (or an instance made in `__init__`): attributes from `self.x = ...` in __init__."""

    def __init__(self, cls: AbstractClass):
        self.cls = cls
        self.attrs: dict = {}
        init = cls.methods.get("__init__")
        if init is not None:
            for s in ast.walk(init):
                if isinstance(s, ast.Assign):
                    for t in s.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                                and t.value.id == "self":
                            self.attrs[t.attr] = _static_value(s.value, cls.env)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.attrs:
            return self.attrs[name]
        fs = self.cls.method_source(name)
        if fs is not None:
            return BoundUserMethod(fs, self)
        return UNKNOWN

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        fs = self.cls.method_source("forward")
        if fs is None:
            return UNKNOWN
        return ev.inline(fs, args, kwargs, e, scope, self_value=self)


class AbstractModule:
    """An instance of a torch.nn module class, constructed with unknown arguments."""

    def __init__(self, cls):
        self.cls = cls

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return UNKNOWN

    def __fl_abstract_call__(self, ev, args, kwargs, e, scope):
        return TensorVar(None, None, None)


def _static_value(expr, env):
    """What `self.x = <expr>` in __init__ holds, without running anything."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Call):
        f = _resolve(expr.func, env)
        if isinstance(f, type) and issubclass(f, nn.Module):
            return AbstractModule(f)
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


def module_env(tree: ast.Module, filename: str) -> dict:
    env: dict = {"__name__": "__fuselens_abstract__"}
    for s in tree.body:
        if isinstance(s, ast.Import):
            for a in s.names:
                if a.asname:
                    env[a.asname] = _safe_import(a.name)
                else:
                    root = a.name.split(".")[0]
                    env[root] = _safe_import(root)
        elif isinstance(s, ast.ImportFrom) and s.module and s.level == 0:
            mod = _safe_import(s.module)
            for a in s.names:
                v = getattr(mod, a.name, UNKNOWN) if not isinstance(mod, Unknown) else UNKNOWN
                if isinstance(v, Unknown) and not isinstance(mod, Unknown):
                    v = _safe_import(f"{s.module}.{a.name}")
                env[a.asname or a.name] = v
        elif isinstance(s, ast.FunctionDef):
            env[s.name] = FunctionSource(s.name, s.name, filename, s, env)
        elif isinstance(s, ast.ClassDef):
            bases = [_resolve(b, env) for b in s.bases]
            env[s.name] = AbstractClass(s, env, filename, bases)
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            value = _top_level_value(s.value, env) if s.value is not None else UNKNOWN
            for t in targets:
                if isinstance(t, ast.Name):
                    env[t.id] = value
    return env


def _top_level_value(expr, env):
    try:
        return ast.literal_eval(expr)
    except Exception:
        pass
    if isinstance(expr, ast.Call):
        f = _resolve(expr.func, env)
        if f is logging.getLogger:  # a logger: calls on it are logging breaks
            return logging.getLogger("fuselens.abstract")
        if isinstance(f, type) and issubclass(f, nn.Module):
            return AbstractModule(f)
        if isinstance(f, AbstractClass):
            return AbstractInstance(f)
    v = _resolve(expr, env)
    return v


# -- which functions are compiled ---------------------------------------------------------------
def _is_compile(fn_value) -> bool:
    import fuselens
    return fn_value is torch.compile or fn_value is fuselens.compile


def _compiled_names(tree, env) -> tuple[set, set]:
    """Names of functions and classes whose instances are compiled in this file."""
    fns, classes = set(), set()
    instances: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and \
                isinstance(n.value.func, ast.Name) and isinstance(env.get(n.value.func.id), AbstractClass):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    instances[t.id] = n.value.func.id
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        f = _resolve(n.func, env)
        if _is_compile(f) and n.args:
            a = n.args[0]
            if isinstance(a, ast.Name):
                if isinstance(env.get(a.id), AbstractClass):
                    classes.add(a.id)
                elif a.id in instances:
                    classes.add(instances[a.id])
                else:
                    fns.add(a.id)
            elif isinstance(a, ast.Call) and isinstance(a.func, ast.Name):
                classes.add(a.func.id)
            elif isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.attr == "forward":
                if a.value.id in instances:
                    classes.add(instances[a.value.id])
        elif isinstance(n.func, ast.Attribute) and n.func.attr == "compile" and \
                isinstance(n.func.value, ast.Name) and n.func.value.id in instances:
            classes.add(instances[n.func.value.id])
    return fns, classes


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
def analyze_source(source: str, filename: str) -> SourceAnalysis:
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return SourceAnalysis([], (e.lineno or 1, max((e.offset or 1) - 1, 0), e.msg))
    env = module_env(tree, filename)
    fns, classes = _compiled_names(tree, env)
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
        fs = FunctionSource(f.name, qualname, filename, f, env)
        builder = GraphBuilder(abstract=True)
        ev = Evaluator(builder, abstract=True, on_break=found.append)
        frame = {}
        params = f.args.posonlyargs + f.args.args
        defaults = dict(zip([p.arg for p in params][len(params) - len(f.args.defaults):],
                            f.args.defaults))
        defaults.update({p.arg: d for p, d in zip(f.args.kwonlyargs, f.args.kw_defaults) if d})
        for i, p in enumerate(params + f.args.kwonlyargs):
            if i == 0 and cls is not None and p.arg == "self":
                frame[p.arg] = AbstractInstance(cls)
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


def _abstract_param(p: ast.arg, default, builder):
    """A parameter is taken for a tensor unless its annotation or default says otherwise."""
    ann = ast.unparse(p.annotation) if p.annotation is not None else ""
    if ann in _NOT_TENSOR_ANNOTATIONS:
        return UNKNOWN
    if isinstance(default, ast.Constant) or isinstance(default, (ast.Tuple, ast.List)):
        return UNKNOWN
    return builder.abstract_input(p.arg)
