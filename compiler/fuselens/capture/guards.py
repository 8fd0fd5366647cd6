"""Guards and constants of one capture.

A source is a Python expression that finds a value at run time, in the scope of the
transformed function (and of its guard function, which has the same signature): a parameter
name (`x`), an attribute or item of one (`self.fc.weight`, `xs[0]`), or a constant the
capture embeds (`__fl_c3`, e.g. a module reached through a global). Guards are conditions
over sources; the runtime compiles them into one function per cache entry."""
from __future__ import annotations

import ast
import inspect
import types

import torch
import torch.nn as nn

from .frames import Guard


class Sources:
    def __init__(self, example: dict):
        self.guards: list[Guard] = []
        self.constants: dict[str, object] = {}
        self._const_names: dict[int, str] = {}
        self._seen: set[str] = set()
        self.example = example  # parameter name -> example value, to resolve sources
        self.written: list[str] = []  # inputs written in place: must share no storage

    # -- constants ---------------------------------------------------------------------------
    def constant(self, obj, hint: str = "c") -> str:
        # devices by value: each `t.device` is a new object, and one constant per tensor made
        # otherwise identical guards differ (a tensor guarded twice was checked twice)
        key = ("device", str(obj)) if isinstance(obj, torch.device) else id(obj)
        name = self._const_names.get(key)
        if name is None:
            import re
            base = re.sub(r"[^0-9a-zA-Z_]", "_", hint)[:24] or "c"
            name = f"__fl_{base}_{len(self.constants)}"
            self.constants[name] = obj
            self._const_names[key] = name
        return name

    def resolve(self, src: str):
        return eval(src, {"torch": torch, **self.constants}, dict(self.example))

    def guard_unshared(self, inputs: list[str]) -> None:
        """One guard for every input written in place: it shares its storage with no other of
        the graph's `inputs` (each source read once: a guard per pair costs W x N lookups, a
        ResNet's running statistics against its parameters)."""
        if not self.written:
            return
        fn = self.constant(unshared, "unshared")
        w = "".join(f"{s}, " for s in dict.fromkeys(self.written))
        ins = "".join(f"{s}, " for s in inputs)
        self.guard(f"{fn}(({w}), ({ins}))", f"{', '.join(dict.fromkeys(self.written))} share no memory "
                   "with another input")

    def function_source(self, sig_text: str) -> str:
        """Source of `__fl_guard(<sig_text>)`: True when every guard holds (guard_function)."""
        return guard_function(self.guards, sig_text, self.constants)

    def fast_graph_call(self, text: str, name: str, inputs: list[str]) -> str:
        """`text`, a transformed function, with its call of graph `name` reading the graph's
        `inputs` as the guard function does (constants for guarded sources, modules' dicts):
        the inputs are read on entry, right after the guards held (a model's parameters were
        each read by walking its module path: ~2 ms a call for a ResNet-50 on a CPU)."""
        fn = ast.parse(text).body[0]  # (once: a model's transformed function is ~100 kB)
        roots = _roots(fn, self.constants)
        rewrite = _Rewrite(_facts(_parse(self.guards), roots, self.constants), self.constants, roots)
        for stmt in fn.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
                    getattr(stmt.targets[0], "id", None) in ("__fl_o", "__fl_in")):
                continue
            value = stmt.value
            args = value.args if isinstance(value, ast.Call) and getattr(value.func, "id", None) == name else \
                value.elts if isinstance(value, ast.Tuple) else None
            if args is None or [ast.unparse(a) for a in args] != [ast.unparse(ast.parse(i, mode="eval").body)
                                                                   for i in inputs]:
                return text  # not the call capture writes: left as it is
            args[:] = [rewrite.visit(a)[0] for a in args]
            lines = text.split("\n")
            indent = lines[stmt.lineno - 1][:stmt.col_offset]
            lines[stmt.lineno - 1:stmt.end_lineno] = [indent + ast.unparse(stmt)]
            return "\n".join(lines)
        return text

    # -- guards ----------------------------------------------------------------------------
    def guard(self, expr: str, reason: str) -> None:
        if expr not in self._seen:
            self._seen.add(expr)
            self.guards.append(Guard(expr, reason))

    def guard_value(self, src: str, v) -> None:
        if isinstance(v, (bool, type(None))):
            self.guard(f"{src} is {v!r}", f"{src} == {v!r}")
        elif isinstance(v, float) and v != v:
            self.guard(f"{src} != {src}", f"{src} is nan")
        elif _is_literal(v):
            self.guard(f"type({src}) is {type(v).__name__} and {src} == {v!r}", f"{src} == {v!r}")
        elif _bound_builtin(v):
            # `buf.write`: a new object at each lookup, of the same receiver and name
            self.guard(f"{src}.__self__ is {self.constant(v.__self__, type(v.__self__).__name__)}"
                       f" and {src}.__name__ == {v.__name__!r}", f"{src} is the same method")
        elif isinstance(v, _STATIC_KINDS) or isinstance(v, (torch.dtype, torch.device, torch.Size)):
            # code and classes: inlined or called as they are, so the very object matters
            self.guard(f"{src} is {self.constant(v, getattr(v, '__name__', type(v).__name__))}"
                       if not isinstance(v, (torch.device, torch.Size)) else
                       f"{src} == {self.constant(v, type(v).__name__)}", f"{src} is the same object")
        elif isinstance(v, types.MethodType):
            self.guard(f"{src}.__func__ is {self.constant(v.__func__, v.__func__.__name__)}",
                       f"{src} is the same method")
        else:
            # any other object: only its type; attributes read during capture are guarded
            # where they are read (Evaluator.getattr)
            self.guard(f"type({src}) is {self.constant(type(v), type(v).__name__)}",
                       f"{src} is a {type(v).__name__}")

    def guard_tensor(self, src: str, t: torch.Tensor, dynamic=()) -> None:
        parts = [f"type({src}) is {self.constant(type(t), type(t).__name__)}",
                 f"{src}.dtype is {self.constant(t.dtype, str(t.dtype).replace('torch.', ''))}",
                 f"{src}.device == {self.constant(t.device, 'dev_' + t.device.type)}"]
        if t.layout != torch.strided:  # sparse: no strides; a strided tensor fails this guard
            parts.append(f"{src}.layout is {self.constant(t.layout, str(t.layout).replace('torch.', ''))}")
            parts.append(f"{src}.shape == {tuple(t.shape)}")
        elif dynamic:
            parts.append(f"{src}.dim() == {t.dim()}")
            parts += [f"{src}.shape[{d}] == {n}" for d, n in enumerate(t.shape) if d not in dynamic]
            parts.append(f"{src}.is_contiguous() is {t.is_contiguous()}")
        else:
            parts.append(f"{src}.shape == {tuple(t.shape)}")
            parts.append(f"{src}.stride() == {tuple(t.stride())}")
        parts.append(f"{src}.requires_grad is {t.requires_grad}")
        shape = "x".join("?" if d in dynamic else str(n) for d, n in enumerate(t.shape))
        self.guard(" and ".join(parts),
                   f"{src}: {str(t.dtype).replace('torch.', '')}[{shape}] on {t.device}"
                   f"{' requiring grad' if t.requires_grad else ''}")

    def guard_module(self, mod: nn.Module, src: str) -> None:
        c = self.constant(mod, type(mod).__name__)
        if c != src:
            self.guard(f"{src} is {c}", f"{src} is the same {type(mod).__name__}")
        self.guard(f"{src}.training is {mod.training}", f"{src}.training is {mod.training}")

    def global_source(self, gdict: dict, name: str, v) -> str:
        g = self.constant(gdict, "G")
        src = f"{g}[{name!r}]"
        if isinstance(v, types.ModuleType):
            return src
        if isinstance(v, torch.Tensor):
            return src  # guarded as a graph input (tensor guard)
        self.guard_value(src, v)
        return src

    def guard_argument(self, src: str, v, dynamic: dict) -> None:
        """Guards for a value passed in as an argument (recursively for containers)."""
        if isinstance(v, torch.Tensor):
            return  # guarded when it becomes a graph input
        if isinstance(v, (list, tuple)):
            self.guard(f"type({src}) is {self.type_name(v)} and len({src}) == {len(v)}",
                       f"{src}: {type(v).__name__} of length {len(v)}")
            for i, x in enumerate(v):
                self.guard_argument(f"{src}[{i}]", x, dynamic)
        elif isinstance(v, dict):
            keys = [self.key(k) for k in v]  # a key that is no literal (a class) by its constant
            self.guard(f"type({src}) is {self.type_name(v)} and tuple({src}.keys()) == ({''.join(k + ', ' for k in keys)})",
                       f"{src}: dict with keys {tuple(v.keys())!r}")
            for k, x in zip(keys, v.values()):
                self.guard_argument(f"{src}[{k}]", x, dynamic)
        elif type(v) is set and all(_is_literal(x) for x in v):
            self.guard(f"type({src}) is set and {src} == {v!r}" if v else
                       f"type({src}) is set and not {src}", f"{src} == {v!r}")
        elif isinstance(v, nn.Module):
            self.guard_module(v, src)
        else:
            self.guard_value(src, v)

    def type_name(self, v) -> str:
        """`type(v)` in a guard: a builtin by its name, any other class (a named tuple, a dict
        subclass such as ModelOutput) by its constant."""
        t = type(v)
        return t.__name__ if t in (list, tuple, dict) else self.constant(t, t.__name__)

    def key(self, k) -> str:
        """A dict key as Python in a guard."""
        if _is_literal(k) or k is None or type(k) is tuple and all(_is_literal(x) or x is None for x in k):
            return repr(k)
        return self.constant(k, getattr(k, "__name__", type(k).__name__))

    def global_state(self, device_types=("cpu", "cuda")) -> None:
        self.guard(f"torch.is_grad_enabled() is {torch.is_grad_enabled()}",
                   f"grad mode is {'on' if torch.is_grad_enabled() else 'off'}")
        self.guard(f"torch.get_default_dtype() is {self.constant(torch.get_default_dtype(), 'default_dtype')}",
                   f"default dtype is {torch.get_default_dtype()}")
        for dev in device_types:  # autocast matters only where the graph's tensors live
            on = torch.is_autocast_enabled(dev)
            self.guard(f"torch.is_autocast_enabled({dev!r}) is {on}",
                       f"autocast on {dev} is {'on' if on else 'off'}")
            if on:
                dtype = torch.get_autocast_dtype(dev)
                self.guard(f"torch.get_autocast_dtype({dev!r}) is {self.constant(dtype, str(dtype)[6:])}",
                           f"autocast on {dev} computes in {dtype}")


_STATIC_KINDS = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type,
                 types.BuiltinMethodType, nn.Module)


def _bound_builtin(v) -> bool:
    """A C method bound to an object (`io.StringIO().write`, `[].append`), not a module's or a
    class's function (`torch.add`, `dict.fromkeys`), which is the same object at each lookup."""
    return isinstance(v, types.BuiltinMethodType) and \
        not isinstance(v.__self__, (types.ModuleType, type)) and v.__self__ is not None


def _is_literal(v) -> bool:
    if isinstance(v, (int, float, str, bytes)):
        return True
    if isinstance(v, tuple):
        return all(_is_literal(x) for x in v)
    return False


_storage = torch.Tensor.untyped_storage


def unshared(written, inputs) -> bool:
    """Each tensor of `written` is the only one of `inputs` on its storage (empty ones aside).
    Checked on every call of a training step (a ResNet's ~480 inputs): first whether any two
    inputs share a storage at all (one pass, at half the cost), and only then which ones."""
    starts = [s.data_ptr() for s in map(_storage, [t for t in inputs if isinstance(t, torch.Tensor)])]
    if len(set(starts)) == len(starts):
        return True
    count: dict[int, int] = {}
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.numel():
            p = t.untyped_storage().data_ptr()
            count[p] = count.get(p, 0) + 1
    return all(not t.numel() or count.get(t.untyped_storage().data_ptr(), 0) <= 1 for t in written)


# -- the guard function ------------------------------------------------------------------------
# Guards are written one per condition, each source spelled from a parameter (`self.encoder.
# stages[0].layers[1].conv.weight`). Evaluated as written, a model's guards walk every module
# path once per tensor and per condition (nn.Module.__getattr__ and Sequential.__getitem__ are
# Python: ~14 ms a call for a ResNet-50's 1250 guards on a CPU). The guard function evaluates
# the same conditions with three rewrites, none of which changes when all of them hold:
# - a source guarded to be a constant (`self.encoder is __fl_Encoder_3`, as every module is)
#   is that constant in every other guard: all hold only if it is;
# - an nn.Module constant's parameter, buffer or submodule is read from its dict, where
#   nn.Module.__getattr__ finds it (`__fl_Conv2d_7._parameters['weight']`);
# - a source read more than once is read into a local before the first condition that reads it
#   unconditionally (where reading it raises, that condition, or one before it, fails anyway).
_CHAIN = (ast.Attribute, ast.Subscript)
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
# scopes of their own (a name there may be their variable, not a source): left as written
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def guard_function(guards, sig_text: str, constants: dict) -> str:
    roots = _roots(f"def f({sig_text}): pass", constants)
    trees = _parse(guards)
    rewrite = _Rewrite(_facts(trees, roots, constants), constants, roots)
    trees = [rewrite.guard(t) for t in trees]
    hoist = _Hoist({k for k, n in rewrite.uses.items() if n > 1})
    lines, seen = [f"def __fl_guard({sig_text}):"], set()
    for t in trees:
        text = ast.unparse(hoist.visit_guard(t))
        lines += [f"    {name} = {ast.unparse(value)}" for name, value in hoist.pending]
        hoist.pending = []
        if text not in seen:  # guards that the rewrites made the same (a module reached by two paths)
            seen.add(text)
            lines.append(f"    if not ({text}):\n        return False")
    lines.append("    return True")
    return "\n".join(lines)


def _roots(function, constants) -> set:
    """The names a source may start from: the function's (its text's, or its FunctionDef's)
    parameters and the constants."""
    args = (ast.parse(function).body[0] if isinstance(function, str) else function).args
    return {a.arg for a in ast.walk(args) if isinstance(a, ast.arg)} | set(constants) | {"torch"}


def _parse(guards) -> list:
    """The guards' expressions, parsed together."""
    if not guards:
        return []
    return ast.parse("(\n" + ",\n".join(g.expr for g in guards) + ",\n)", mode="eval").body.elts


def _facts(trees, roots, constants) -> dict:
    """{source text: the constant that the guards (parsed), all holding, make it} (`src is __fl_c`)."""
    facts = {}
    for t in trees:
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Is) and \
                isinstance(t.comparators[0], ast.Name) and t.comparators[0].id in constants:
            key = _source_key(t.left, roots)
            if key is not None:
                facts.setdefault(key, t.comparators[0].id)
    return facts


_NO_KEY = object()


def _source_key(node, roots):
    """A source's text (a parameter or constant, or an attribute or constant-keyed item of one, at
    any depth) as the rewrites compare them (not `ast.unparse`: ResNet-50's guards hold ~25k
    sources, whose unparsing was most of the guard function's build), or None for any other
    expression."""
    if isinstance(node, ast.Name):
        return node.id if node.id in roots else None
    if isinstance(node, ast.Attribute):
        base = _source_key(node.value, roots)
        return None if base is None else f"{base}.{node.attr}"
    if isinstance(node, ast.Subscript):
        base = _source_key(node.value, roots)
        key = _literal(node.slice)
        return None if base is None or key is _NO_KEY else f"{base}[{key!r}]"
    return None


def _literal(node):
    """The value of a constant key (`0`, `-1`, `'w'`, `(1, 2)`), or _NO_KEY."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, ast.Tuple):
        items = tuple(_literal(e) for e in node.elts)
        return _NO_KEY if _NO_KEY in items else items
    return _NO_KEY


class _Rewrite:
    """Facts' constants for their sources; a module's entries read from its dicts where the
    module is known (a constant, or an entry of a known module's dicts). One pass over each
    guard: a rewritten source carries its text as `fl_key`, and `uses` counts the reads of each."""

    def __init__(self, facts, constants, roots):
        self.facts, self.constants, self.roots = facts, constants, roots
        self.known: dict = {}  # id(node) -> (node, the object it is)
        self.uses: dict = {}

    def guard(self, tree):
        if isinstance(tree, ast.Compare) and isinstance(tree.ops[0], ast.Is) and \
                isinstance(tree.comparators[0], ast.Name) and \
                self.facts.get(_source_key(tree.left, self.roots)) == tree.comparators[0].id:
            # the guard that makes the fact: only the source's own prefixes are rewritten
            if isinstance(tree.left, _CHAIN):
                tree.left.value, base_key = self.visit(tree.left.value)
                tree.left = self._chain(tree.left, base_key, use_fact=False)[0]
            return tree
        return self.visit(tree)[0]

    def visit(self, node):
        """(the node rewritten, the source text of the node as it was, or None)."""
        if isinstance(node, ast.Name):
            if node.id not in self.roots:
                return node, None
            name = self.facts.get(node.id, node.id)
            out = node if name == node.id else ast.Name(id=name, ctx=ast.Load())
            out.fl_key = name
            if name in self.constants:
                self.known[id(out)] = (out, self.constants[name])
            return out, node.id
        if isinstance(node, _CHAIN):
            node.value, base_key = self.visit(node.value)
            return self._chain(node, base_key)
        if isinstance(node, _SCOPES):
            return node, None
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [self.visit(v)[0] if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value)[0])
        return node, None

    def _chain(self, node, base_key, use_fact=True):
        """`node`, whose value is already rewritten (its text was `base_key`)."""
        if isinstance(node, ast.Subscript):
            literal = _literal(node.slice)
            if literal is _NO_KEY:
                node.slice = self.visit(node.slice)[0]
            key = None if base_key is None or literal is _NO_KEY else f"{base_key}[{literal!r}]"
        else:
            key = None if base_key is None else f"{base_key}.{node.attr}"
        name = self.facts.get(key) if use_fact else None
        if name is not None:
            return self.visit(ast.Name(id=name, ctx=ast.Load()))[0], key
        out = self._module_entry(node)
        base = getattr(out.value, "fl_key", None)
        if base is not None:
            literal = _literal(out.slice) if isinstance(out, ast.Subscript) else None
            if literal is not _NO_KEY:
                out.fl_key = f"{base}[{literal!r}]" if isinstance(out, ast.Subscript) else f"{base}.{out.attr}"
                self.uses[out.fl_key] = self.uses.get(out.fl_key, 0) + 1
        return out, key

    def _module_entry(self, node):
        """`M.name` -> `M._parameters['name']` (or `_buffers`, `_modules`) for a known module M
        whose attribute lookup reaches nn.Module.__getattr__; `M[i]` -> `M._modules['i']` for a
        ModuleList, or a Sequential whose keys are its positions."""
        if not isinstance(node, _CHAIN):
            return node
        base, mod = self.known.get(id(node.value), (None, None))
        if base is not node.value or not isinstance(mod, nn.Module):
            return node
        if isinstance(node, ast.Subscript):
            i = _literal(node.slice)
            if type(i) is int and -len(mod._modules) <= i < len(mod._modules) and (
                    type(mod).__getitem__ is nn.ModuleList.__getitem__ or
                    type(mod).__getitem__ is nn.Sequential.__getitem__ and
                    list(mod._modules) == [str(k) for k in range(len(mod._modules))]):
                if i >= 0:
                    return self._entry(node, "_modules", str(i), mod)
                # counted from the end: the entry at its position now (IndexError and KeyError alike
                # where there is none)
                modules = self._attribute(node.value, "_modules")
                key = ast.parse(f"str(len(_m) - {-i})", mode="eval").body
                key.args[0].left.args[0] = modules
                out = ast.Subscript(value=modules, slice=key, ctx=ast.Load())
                self.known[id(out)] = (out, mod._modules[str(len(mod._modules) + i)])
                return out
            return node
        if type(mod).__getattr__ is not nn.Module.__getattr__ or \
                type(mod).__getattribute__ is not object.__getattribute__ or node.attr in mod.__dict__ or \
                inspect.getattr_static(type(mod), node.attr, _MISSING) is not _MISSING:
            return node
        for d in _MODULE_DICTS:
            if node.attr in mod.__dict__.get(d, ()):
                return self._entry(node, d, node.attr, mod)
        return node

    def _entry(self, node, d, key, mod):
        out = ast.Subscript(value=self._attribute(node.value, d), slice=ast.Constant(key), ctx=ast.Load())
        self.known[id(out)] = (out, mod.__dict__[d][key])
        return out

    def _attribute(self, value, attr):
        """`value.attr`, a source where `value` is one (its reads counted)."""
        out = ast.Attribute(value=value, attr=attr, ctx=ast.Load())
        base = getattr(value, "fl_key", None)
        if base is not None:
            out.fl_key = f"{base}.{attr}"
            self.uses[out.fl_key] = self.uses.get(out.fl_key, 0) + 1
        return out


_MISSING = object()


class _Hoist:
    """Replaces sources read more than once by locals, assigned (`pending`) before the first guard
    that reads them where its evaluation reaches them whenever the guard can hold."""

    def __init__(self, shared):
        self.shared = shared
        self.names: dict = {}
        self.pending: list = []

    def visit_guard(self, tree):
        return self.visit(tree, True, True)

    def visit(self, node, sure, conjunct):
        """`sure`: evaluated whenever the guard holds; `conjunct`: the guard is False when it is."""
        key = getattr(node, "fl_key", None) if isinstance(node, _CHAIN) else None
        if key is not None:
            if key in self.names:
                return ast.Name(id=self.names[key], ctx=ast.Load())
            node.value = self.visit(node.value, sure, False)
            if isinstance(node, ast.Subscript):
                node.slice = self.visit(node.slice, sure, False)
            if key in self.shared and sure:
                name = self.names[key] = f"__fl_s{len(self.names)}"
                self.pending.append((name, node))
                return ast.Name(id=name, ctx=ast.Load())
            return node
        if isinstance(node, ast.BoolOp):
            all_sure = conjunct and isinstance(node.op, ast.And)
            node.values = [self.visit(v, sure and (all_sure or i == 0), all_sure) for i, v in enumerate(node.values)]
            return node
        if isinstance(node, ast.IfExp):
            node.test = self.visit(node.test, sure, False)
            node.body, node.orelse = self.visit(node.body, False, False), self.visit(node.orelse, False, False)
            return node
        if isinstance(node, ast.Compare) and len(node.ops) > 1:
            node.left = self.visit(node.left, sure, False)
            node.comparators = [self.visit(c, sure and i == 0, False) for i, c in enumerate(node.comparators)]
            return node
        if isinstance(node, _SCOPES):
            return node
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                setattr(node, field, [self.visit(v, sure, False) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value, sure, False))
        return node
