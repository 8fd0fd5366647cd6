"""Guards and constants of one capture.

A source is a Python expression that finds a value at run time, in the scope of the
transformed function (and of its guard function, which has the same signature): a parameter
name (`x`), an attribute or item of one (`self.fc.weight`, `xs[0]`), or a constant the
capture embeds (`__fl_c3`, e.g. a module reached through a global). Guards are conditions
over sources; the runtime compiles them into one function per cache entry."""
from __future__ import annotations

import ast
import enum
import functools
import inspect
import math
import numbers
import re
import types

import torch
import torch.nn as nn

from .frames import Guard
from .values import NUMPY_SCALARS


# a global's source as capture names it (`__fl_G_3['STEPS']`: the function's globals, a constant
# of the guard function), and as the user wrote it
_GLOBAL_SOURCE = re.compile(r"__fl_G_\d+\[(['\"])(\w+)\1\]")


def in_words(reason: str) -> str:
    """A guard's reason as the user's code spells it (`STEPS[0] == 110`): explain, the
    recompile warnings and the editor show it."""
    return _GLOBAL_SOURCE.sub(r"\2", reason)


class Sources:
    def __init__(self, example: dict):
        self.guards: list[Guard] = []
        self.constants: dict[str, object] = {}
        self._const_names: dict[int, str] = {}
        self._seen: set[str] = set()
        self.example = example  # parameter name -> example value, to resolve sources
        self.written: list[str] = []  # inputs written in place: must share no storage
        self._reads = None  # Reads of the guard function, for the graph call (fast_graph_call)

    # -- constants ---------------------------------------------------------------------------
    def constant(self, obj, hint: str = "c") -> str:
        # devices by value: each `t.device` is a new object, and one constant per tensor made
        # otherwise identical guards differ (a tensor guarded twice was checked twice)
        key = ("device", str(obj)) if isinstance(obj, torch.device) else id(obj)
        name = self._const_names.get(key)
        if name is None:
            # (never `__fl__<digits>_`: how a guard's template writes its sources)
            base = re.sub(r"[^0-9a-zA-Z_]", "_", hint).lstrip("_")[:24] or "c"
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
        written = list(dict.fromkeys(self.written))
        w = "".join(f"{arg(i)}, " for i in range(len(written)))
        ins = "".join(f"{arg(len(written) + i)}, " for i in range(len(inputs)))
        self.guard(f"{fn}(({w}), ({ins}))", f"{', '.join(written)} share no memory with another input",
                   *written, *inputs, kind="unshared")

    def function_source(self, sig_text: str) -> str:
        """Source of `__fl_guard(<sig_text>)`: True when every guard holds (guard_function)."""
        self._reads = Reads(self.guards, sig_text, self.constants)
        return guard_function(self.guards, sig_text, self.constants, self._reads)

    def fast_graph_call(self, text: str, name: str, inputs: list[str]) -> str:
        """`text`, a transformed function, with its call of graph `name` reading the graph's
        `inputs` as the guard function does (constants for guarded sources, modules' dicts):
        the inputs are read on entry, right after the guards held (a model's parameters were
        each read by walking its module path: ~2 ms a call for a ResNet-50 on a CPU)."""
        fn = ast.parse(text).body[0]  # (once: a model's transformed function is ~100 kB)
        reads = self._reads or Reads(self.guards, ast.unparse(fn.args), self.constants)
        for stmt in fn.body:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
                    getattr(stmt.targets[0], "id", None) in ("__fl_o", "__fl_in")):
                continue
            value = stmt.value
            args = value.args if isinstance(value, ast.Call) and getattr(value.func, "id", None) == name else \
                value.elts if isinstance(value, ast.Tuple) else None
            lines = text.split("\n")
            line = lines[stmt.lineno - 1].encode()  # (offsets count UTF-8 bytes)
            if args is None or len(args) != len(inputs) or \
                    any(a.lineno != stmt.lineno or a.end_lineno != stmt.lineno or
                        line[a.col_offset:a.end_col_offset].decode() != i for a, i in zip(args, inputs)):
                return text  # not the call capture writes: left as it is
            for a, i in reversed(list(zip(args, inputs))):
                chain = reads.read(i)
                if chain is not None:
                    line = line[:a.col_offset] + chain.render({}).encode() + line[a.end_col_offset:]
            lines[stmt.lineno - 1] = line.decode()
            return "\n".join(lines)
        return text

    # -- guards ----------------------------------------------------------------------------
    def guard(self, expr: str, reason: str, *over: str, kind: str = "") -> None:
        """`expr`: Python over the guard function's parameters and constants. With `over`, it is
        written over these sources as `arg(i)` (SRC for the first), so that the guard function
        is built without parsing it. `kind`: Guard.kind."""
        text = fill(expr, over) if over else expr
        if over and len(_ARG.findall(expr)) != sum(_template(expr)[1].values()):
            # a placeholder's text inside a literal (written without `literal`): not a template
            text, expr, over = _fill_tree(expr, over), None, ()
        if text not in self._seen:
            self._seen.add(text)
            self.guards.append(Guard(text, in_words(reason), expr if over else None, over, kind))

    def guard_value(self, src: str, v) -> None:
        if isinstance(v, (bool, type(None))):
            self.guard(f"{SRC} is {v!r}", f"{src} == {v!r}", src)
        elif isinstance(v, (float, complex, *NUMPY_SCALARS)) and v != v:  # NaN equals nothing
            self.guard(f"type({SRC}) is {self.constant(type(v), type(v).__name__)} and {SRC} != {SRC}",
                       f"{src} is nan", src)
        elif isinstance(v, enum.Enum):  # a member is one object: compared by identity, as `is` would
            self.guard(f"{SRC} is {self.constant(v, type(v).__name__)}", f"{src} is {v}", src)
        elif is_literal(v):
            self.guard(f"type({SRC}) is {type(v).__name__} and {SRC} == {literal(v)}", f"{src} == {v!r}", src)
        elif isinstance(v, (numbers.Number, str, bytes, slice, range, frozenset, *NUMPY_SCALARS)):
            # values equal by their parts (infinity, NumPy's scalars, a slice): by constants
            self.guard(f"type({SRC}) is {self.constant(type(v), type(v).__name__)} and "
                       f"{SRC} == {self.constant(v, type(v).__name__)}", f"{src} == {v!r}", src)
        elif isinstance(v, tuple):  # of more than literals (functions): item by item, as an argument's
            self.guard_argument(src, v, {})
        elif _bound_builtin(v):
            # `buf.write`: a new object at each lookup, of the same receiver and name
            self.guard(f"{SRC}.__self__ is {self.constant(v.__self__, type(v.__self__).__name__)}"
                       f" and {SRC}.__name__ == {literal(v.__name__)}", f"{src} is the same method", src)
        elif isinstance(v, types.FunctionType) and getattr(v, "__fl_local__", False) and v.__closure__ \
                and is_literal(v.__defaults__) and is_literal(v.__kwdefaults__):
            # a local function made again from its source at a break (materialize.local_function),
            # a new object on each call that its resume receives: its code, defaults and globals,
            # not its identity; what its cells hold is read at this source where it is inlined
            self.guard(f"{SRC}.__code__ is {self.constant(v.__code__, v.__name__ + '_code')} and "
                       f"{SRC}.__defaults__ == {literal(v.__defaults__)} and "
                       f"{SRC}.__kwdefaults__ == {literal(v.__kwdefaults__)} and "
                       f"{SRC}.__globals__ is {self.constant(v.__globals__, 'globals')}",
                       f"{src} is a closure of the same code", src)
        elif isinstance(v, _STATIC_KINDS) or isinstance(v, (torch.dtype, torch.device, torch.Size)):
            # code and classes: inlined or called as they are, so the very object matters
            self.guard(f"{SRC} is {self.constant(v, getattr(v, '__name__', type(v).__name__))}"
                       if not isinstance(v, (torch.device, torch.Size)) else
                       f"{SRC} == {self.constant(v, type(v).__name__)}", f"{src} is the same object", src)
        elif type(v) is functools.partial:  # called as its three parts (kinds.Partial), read whole
            self.guard(f"type({SRC}) is {self.constant(functools.partial, 'partial')}", f"{src} is a partial", src)
            self.guard_value(f"{src}.func", v.func)
            self.guard_argument(f"{src}.args", v.args, {})
            self.guard_argument(f"{src}.keywords", v.keywords, {})
        elif isinstance(v, types.MethodType):
            self.guard(f"{SRC} is {self.constant(v.__func__, v.__func__.__name__)}",
                       f"{src} is the same method", f"{src}.__func__")
            self.guard_value(f"{src}.__self__", v.__self__)  # (what is read of it: where it is read)
        else:
            # any other object: only its type; attributes read during capture are guarded
            # where they are read (Evaluator.getattr)
            self.guard(f"type({SRC}) is {self.constant(type(v), type(v).__name__)}",
                       f"{src} is a {type(v).__name__}", src)

    def guard_tensor(self, src: str, t: torch.Tensor, dynamic=()) -> None:
        parts = [f"type({SRC}) is {self.constant(type(t), type(t).__name__)}",
                 f"{SRC}.dtype is {self.constant(t.dtype, str(t.dtype).replace('torch.', ''))}",
                 f"{SRC}.device == {self.constant(t.device, 'dev_' + t.device.type)}"]
        if t.layout != torch.strided:  # sparse: no strides; a strided tensor fails this guard
            parts.append(f"{SRC}.layout is {self.constant(t.layout, str(t.layout).replace('torch.', ''))}")
            parts.append(f"{SRC}.shape == {tuple(t.shape)}")
        elif dynamic:
            parts.append(f"{SRC}.dim() == {t.dim()}")
            parts += [f"{SRC}.shape[{d}] == {n}" for d, n in enumerate(t.shape) if d not in dynamic]
            parts.append(f"{SRC}.is_contiguous() is {t.is_contiguous()}")
        else:
            parts.append(f"{SRC}.shape == {tuple(t.shape)}")
            # a contiguous tensor's strides follow from its shape but for dims of size 1, which
            # no index reads (is_contiguous() is ~7x cheaper than reading the strides)
            parts.append(f"{SRC}.is_contiguous()" if t.is_contiguous() else f"{SRC}.stride() == {tuple(t.stride())}")
        parts.append(f"{SRC}.requires_grad is {t.requires_grad}")
        shape = "x".join("?" if d in dynamic else str(n) for d, n in enumerate(t.shape))
        self.guard(" and ".join(parts),
                   f"{src}: {str(t.dtype).replace('torch.', '')}[{shape}] on {t.device}"
                   f"{' requiring grad' if t.requires_grad else ''}", src,
                   kind="tensor" if t.layout == torch.strided and not dynamic else "")

    def guard_module(self, mod: nn.Module, src: str) -> None:
        c = self.constant(mod, type(mod).__name__)
        if c != src:
            self.guard(f"{SRC} is {c}", f"{src} is the same {type(mod).__name__}", src)
        self.guard(f"{SRC}.training is {mod.training}", f"{src}.training is {mod.training}", src)
        # its forward hooks (capture evaluates them: objects.call_module), as they are now
        if not (mod._forward_pre_hooks or mod._forward_hooks):
            self.guard(f"not {SRC}._forward_pre_hooks and not {SRC}._forward_hooks",
                       f"{src} has no forward hooks", src)
        for kind in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = list(getattr(mod, kind).values())
            if hooks:
                names = "".join(f"{self.constant(h, 'hook')}, " for h in hooks)
                self.guard(f"[*{SRC}.{kind}.values()] == [{names}]", f"{src}.{kind} are the same hooks", src)

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
            self.guard(f"type({SRC}) is {self.type_name(v)} and len({SRC}) == {len(v)}",
                       f"{src}: {type(v).__name__} of length {len(v)}", src)
            for i, x in enumerate(v):
                self.guard_argument(f"{src}[{i}]", x, dynamic)
        elif isinstance(v, dict):
            keys = [self.key(k) for k in v]  # a key that is no literal (a class) by its constant
            written = "".join(_escaped(k) + ", " for k in keys)
            self.guard(f"type({SRC}) is {self.type_name(v)} and tuple({SRC}.keys()) == ({written})",
                       f"{src}: dict with keys {tuple(v.keys())!r}", src)
            for k, x in zip(keys, v.values()):
                self.guard_argument(f"{src}[{k}]", x, dynamic)
        elif type(v) is set and all(is_literal(x) for x in v):
            self.guard(f"type({SRC}) is set and {SRC} == {literal(v)}" if v else
                       f"type({SRC}) is set and not {SRC}", f"{src} == {v!r}", src)
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
        if is_literal(k):
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
    """A C method that is a new object at each lookup: bound to an object (`io.StringIO().write`,
    `[].append`) or a class method of a C type (`dict.fromkeys`, `int.from_bytes`), not a module's
    function (`torch.add`), which is the same object at each lookup."""
    if not isinstance(v, types.BuiltinMethodType) or v.__self__ is None:
        return False
    if not isinstance(v.__self__, (types.ModuleType, type)):
        return True
    return getattr(v.__self__, v.__name__, None) is not v


def is_literal(v) -> bool:
    """A value its repr writes back exactly, as Python: None, a bool, int, finite float, str or
    bytes of these very types (an IntEnum's or numpy's repr is no such Python), a tuple of them."""
    t = type(v)
    if v is None or t in (bool, int, str, bytes):
        return True
    if t is float:
        return math.isfinite(v)
    return t is tuple and all(is_literal(x) for x in v)


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
# A guard is a template over the sources it reads (`Sources.guard(..., *over)`): the rewrites
# are made once per source and the templates' conditions analysed once per template, so a model's
# guards are not parsed (ResNet-50 training: 1318 guards, 300 kB of text, whose parsing and
# rewriting as one tree was 0.6 s of a 0.8 s capture on the dev CPU). A guard written without
# its sources is made a template by parsing it.
_CHAIN = (ast.Attribute, ast.Subscript)
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
# scopes of their own (a name there may be their variable, not a source): left as written
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_ARG = re.compile(r"__fl__(\d+)_")
_FACT = re.compile(r"__fl__0_ is (\w+)")


def arg(i: int) -> str:
    """How a guard's template writes its i-th source (`Sources.guard`)."""
    return f"__fl__{i}_"


def arg_index(name: str) -> int | None:
    """i of a template's `arg(i)`, or None for any other name."""
    m = _ARG.fullmatch(name)
    return int(m.group(1)) if m else None


SRC = arg(0)


def fill(template: str, over) -> str:
    """The template with its sources written in."""
    if not over:
        return template
    if len(over) == 1:
        return template.replace(SRC, over[0])
    return _ARG.sub(lambda m: over[int(m.group(1))], template)


def literal(v) -> str:
    """A literal value as a template writes it: its repr, where a placeholder's text in a string
    is written with an escape (`'__fl\\x5f_0_'`), so that it is not taken for a source."""
    return _escaped(repr(v))


def _escaped(text: str) -> str:
    return text.replace("__fl__", "__fl\\x5f_")


def _fill_tree(template: str, over) -> str:
    """fill() by the template's syntax tree: its sources where it names them, not in its literals."""
    def source(node):
        m = _ARG.fullmatch(node.id) if isinstance(node, ast.Name) else None
        return ast.parse(over[int(m.group(1))], mode="eval").body if m else None
    return ast.unparse(_replaced(ast.parse(template, mode="eval").body, source))


def _replaced(node, replace):
    """`node` with each subtree, from the top, replaced by `replace(subtree)` where that is not None."""
    new = replace(node)
    if new is not None:
        return new
    for field, value in ast.iter_fields(node):
        if isinstance(value, list):
            setattr(node, field, [_replaced(v, replace) if isinstance(v, ast.AST) else v for v in value])
        elif isinstance(value, ast.AST):
            setattr(node, field, _replaced(value, replace))
    return node


# the names a native guard function (`guard_function(native=...)`) calls: runtime/native_guards.py's
# checks of the guards read from constants, and its match of the static tensor guards' tensors
NATIVE_CHECKS, NATIVE_MATCH = "__fl_native_checks", "__fl_native_match"


def guard_function(guards, sig_text: str, constants: dict, reads: "Reads | None" = None, native=None):
    """The guard function's source. With `native` (runtime/native_guards.py's `Checks`), (source,
    checks): the guards `native(template, chains)` takes as C++ checks are left out and checked
    first by one call of NATIVE_CHECKS; the static tensor guards (Guard.kind "tensor") are left
    out and the function returns NATIVE_MATCH((tensors), others) where every other guard holds:
    `tensors` those of them that `native.tensor(chain)` does not read itself, `others` (where
    guards.unshared's guard is, else None) that guard's inputs that are not among them, whose
    storages must be distinct from the tensors' and each other's (its guard is left out too)."""
    reads = reads or Reads(guards, sig_text, constants)
    uses: dict = {}  # each source's prefixes read more than once get a local
    forms, checks, tensors, unshared, taken_texts = [], [], {}, None, set()
    for guard, (template, over) in zip(guards, reads.forms):
        chains = [reads.read(s, own=i == 0 and template in reads.own) for i, s in enumerate(over)]
        if native and guard.kind == "tensor":
            text = chains[0].render({})
            if text in tensors or text in taken_texts:
                continue
            if native.tensor(chains[0]):
                taken_texts.add(text)
                continue
            tensors[text] = chains[0]
            continue
        if native and guard.kind == "unshared":  # (its inputs, and the written ones not among them)
            n_written = len(ast.parse(template, mode="eval").body.args[0].elts)
            inputs = {c.render({}): c for c in chains[n_written:]}
            unshared = list({**inputs, **{c.render({}): c for c in chains[:n_written]}}.items())
            continue
        if native and guard.kind == "":
            taken = native(template, chains)
            if taken is not None:
                checks += taken
                continue
        sure, counts = _template(template)
        for i, chain in enumerate(chains):
            for key in chain.keys:
                if key is not None:
                    uses[key] = uses.get(key, 0) + counts.get(i, 0)
        forms.append((template, sure, chains))
    others = [c for text, c in unshared or () if text not in tensors and text not in taken_texts]
    for chain in [*tensors.values(), *others]:  # (each read once, in the returned tuples)
        for key in chain.keys:
            if key is not None:
                uses[key] = uses.get(key, 0) + 1
    names: dict = {}
    lines, seen = [f"def __fl_guard({sig_text}):"], set()
    if checks:
        lines.append(f"    if not {NATIVE_CHECKS}():\n        return False")
    for template, sure, chains in forms:
        for i in sorted(sure):  # prefixes of a source read whenever the guard holds: read once, here
            chain = chains[i]
            for j, key in enumerate(chain.keys):
                if key is not None and key not in names and uses[key] > 1:
                    value = chain.render(names, j + 1)
                    names[key] = f"__fl_s{len(names)}"
                    lines.append(f"    {names[key]} = {value}")
        text = fill(template, [c.render(names) for c in chains])
        if text not in seen:  # guards that the rewrites made the same (a module reached by two paths)
            seen.add(text)
            lines.append(f"    if not ({text}):\n        return False")
    if not native:
        lines.append("    return True")
        return "\n".join(lines)
    tuple_of = lambda chains: f"({''.join(f'{c.render(names)}, ' for c in chains)})"  # noqa: E731
    lines.append(f"    return {NATIVE_MATCH}({tuple_of(tensors.values())}, "
                 f"{tuple_of(others) if unshared is not None else None})")
    return "\n".join(lines), checks


@functools.lru_cache(maxsize=8192)
def _template(template: str):
    """(the sources a guard reads whenever it holds, {source: times written}) of a template."""
    sure, counts = set(), {}

    def walk(node, s, conjunct):
        """`s`: evaluated whenever the guard holds; `conjunct`: the guard is False when it is."""
        if isinstance(node, ast.Name):
            m = _ARG.fullmatch(node.id)
            if m:
                i = int(m.group(1))
                counts[i] = counts.get(i, 0) + 1
                if s:
                    sure.add(i)
        elif isinstance(node, ast.BoolOp):
            all_sure = conjunct and isinstance(node.op, ast.And)
            for i, v in enumerate(node.values):
                walk(v, s and (all_sure or i == 0), all_sure)
        elif isinstance(node, ast.IfExp):
            walk(node.test, s, False)
            walk(node.body, False, False)
            walk(node.orelse, False, False)
        elif isinstance(node, ast.Compare) and len(node.ops) > 1:
            walk(node.left, s, False)
            for i, c in enumerate(node.comparators):
                walk(c, s and i == 0, False)
        elif not isinstance(node, _SCOPES):
            for child in ast.iter_child_nodes(node):
                walk(child, s, False)
    walk(ast.parse(template, mode="eval").body, True, True)
    return frozenset(sure), counts


def _roots(function, constants) -> set:
    """The names a source may start from: the function's (its text's, or its FunctionDef's)
    parameters and the constants."""
    args = (ast.parse(function).body[0] if isinstance(function, str) else function).args
    return {a.arg for a in ast.walk(args) if isinstance(a, ast.arg)} | set(constants) | {"torch"}


_NO_KEY = object()


def _source_key(node, roots):
    """A source's text (a parameter or constant, or an attribute or constant-keyed item of one, at
    any depth) as the rewrites compare them, or None for any other expression."""
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


class Chain:
    """A source as the guard function reads it: `root`, then steps, each `parts` joined by the text
    before it (`('', '._parameters')`; an item counted from a ModuleList's end names the list's
    dict twice). `keys[j]`: the text up to step j, under which its reads are counted and shared,
    or None where they cannot be (from a computed item on)."""
    __slots__ = ("root", "text", "parts", "keys", "shareable")

    def __init__(self, root):
        self.root = self.text = root
        self.parts, self.keys, self.shareable = [], [], True

    def step(self, parts, shareable=True):
        self.text = self.text.join(parts)
        self.shareable = self.shareable and shareable
        self.parts.append(parts)
        self.keys.append(self.text if self.shareable else None)

    def render(self, names: dict, upto=None) -> str:
        """The text of the first `upto` steps (all), read from the locals `names` where it can."""
        upto = len(self.parts) if upto is None else upto
        text, start = self.root, 0
        for j in range(upto - 1, -1, -1):
            name = names.get(self.keys[j]) if self.keys[j] is not None else None
            if name is not None:
                text, start = name, j + 1
                break
        for parts in self.parts[start:upto]:
            text = text.join(parts)
        return text


class Reads:
    """Every guard as (template, sources), the facts all of them make (`src is __fl_c`), and each
    source's Chain under those facts (made once)."""

    def __init__(self, guards, sig_text: str, constants: dict):
        self.constants = constants
        self.roots = _roots(f"def f({sig_text}): pass", constants)
        self._nodes: dict = {}  # source text -> its expression, parsed once
        self._chains: dict = {}
        self._attrs: dict = {}
        self.forms = [self._form(g) for g in guards]
        self.facts: dict = {}
        self.own = set()  # templates that make a fact: their own source is read without it
        for template, over in self.forms:
            m = _FACT.fullmatch(template)
            if m and m.group(1) in constants:
                key = _source_key(self._node(over[0]), self.roots)
                if key is not None:
                    self.facts.setdefault(key, m.group(1))
                    self.own.add(template)

    def _form(self, g):
        """(template, sources) of a guard: as written where its sources are plain sources."""
        if g.template is not None and all(_chain_root(self._node(s), self.roots) for s in g.over):
            return g.template, tuple(g.over)
        return self._templatize(g.expr)

    def _templatize(self, expr):
        """A guard written without its sources: each source it reads becomes a template's (one
        with a placeholder's text in a literal is taken as it is: no source of it is rewritten)."""
        tree = ast.parse(expr, mode="eval")
        if any(isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) and
               ("__fl__" in n.value if isinstance(n.value, str) else b"__fl__" in n.value) for n in ast.walk(tree)):
            return expr, ()
        over = []
        roots, constants = self.roots, self.constants

        def placeholder(node):
            if isinstance(node, _SCOPES):
                return node
            if isinstance(node, (ast.Name, *_CHAIN)) and _chain_root(node, roots) is not None and \
                    not (isinstance(node, ast.Name) and node.id in constants):
                over.append(ast.unparse(node))
                return ast.Name(id=arg(len(over) - 1), ctx=ast.Load())
            return None
        return ast.unparse(_replaced(tree.body, placeholder)), tuple(over)

    def _node(self, src: str):
        node = self._nodes.get(src)
        if node is None:
            node = self._nodes[src] = ast.parse(src, mode="eval").body
        return node

    def read(self, src: str, own=False) -> Chain | None:
        """`src` read as a Chain (`own`: the guard making a fact of it reads it without that fact),
        or None where it is no source."""
        hit = self._chains.get((src, own), _MISSING)
        if hit is _MISSING:
            hit = self._chains[(src, own)] = self._read(self._node(src), own)
        return hit

    def _read(self, node, own):
        steps = []
        while isinstance(node, _CHAIN):
            steps.append(node)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.roots:
            return None
        steps.reverse()
        facts, constants = self.facts, self.constants
        key = node.id  # the source's own text so far (None after a computed item)
        name = key if own and not steps else facts.get(key, key)
        chain = Chain(name)
        obj = constants.get(name, _MISSING) if name in constants else _MISSING
        for i, st in enumerate(steps):
            literal = _literal(st.slice) if isinstance(st, ast.Subscript) else None
            if key is not None:
                key = f"{key}.{st.attr}" if isinstance(st, ast.Attribute) else \
                    None if literal is _NO_KEY else f"{key}[{literal!r}]"
            fact = facts.get(key) if key is not None and not (own and i == len(steps) - 1) else None
            if fact is not None:  # the whole source so far is that constant
                chain, obj = Chain(fact), constants[fact]
                continue
            obj = self._module_entry(chain, obj, st, literal)
            if obj is _PLAIN:
                obj = _MISSING
                if isinstance(st, ast.Attribute):
                    chain.step(("", f".{st.attr}"))
                elif literal is not _NO_KEY:
                    chain.step(("", f"[{literal!r}]"))
                else:
                    chain.step(("", f"[{ast.unparse(st.slice)}]"), shareable=False)
        return chain

    def _module_entry(self, chain, mod, st, literal):
        """`M.name` -> `M._parameters['name']` (or `_buffers`, `_modules`) for a known module M
        whose attribute lookup reaches nn.Module.__getattr__; `M[i]` -> `M._modules['i']` for a
        ModuleList, or a Sequential whose keys are its positions: steps added to `chain`, and the
        object reached, or _PLAIN where the step is read as written."""
        if not isinstance(mod, nn.Module):
            return _PLAIN
        if isinstance(st, ast.Subscript):
            i, n = literal, len(mod._modules)
            if type(i) is int and -n <= i < n and (
                    type(mod).__getitem__ is nn.ModuleList.__getitem__ or
                    type(mod).__getitem__ is nn.Sequential.__getitem__ and
                    list(mod._modules) == [str(k) for k in range(n)]):
                chain.step(("", "._modules"))
                if i >= 0:
                    chain.step(("", f"[{str(i)!r}]"))
                else:  # counted from the end: the entry at its position now (IndexError and KeyError
                    # alike where there is none)
                    chain.step(("", "[str(len(", f") - {-i})]"), shareable=False)
                return mod._modules[str(i % n)]
            return _PLAIN
        attr = st.attr
        if not self._plain_getattr(type(mod), attr) or attr in mod.__dict__:
            return _PLAIN
        for d in _MODULE_DICTS:
            entries = mod.__dict__.get(d, ())
            if attr in entries:
                chain.step(("", f".{d}"))
                chain.step(("", f"[{attr!r}]"))
                return entries[attr]
        return _PLAIN

    def _plain_getattr(self, cls, attr) -> bool:
        """Whether `M.attr` of a module of class `cls` reaches nn.Module.__getattr__ (when not in
        the instance's dict)."""
        hit = self._attrs.get((cls, attr))
        if hit is None:
            hit = self._attrs[(cls, attr)] = cls.__getattr__ is nn.Module.__getattr__ and \
                cls.__getattribute__ is object.__getattribute__ and \
                inspect.getattr_static(cls, attr, _MISSING) is _MISSING
        return hit


_MISSING = object()
_PLAIN = object()


def _chain_root(node, roots):
    """The root name of a chain of attributes and items (a source), or None."""
    while isinstance(node, _CHAIN):
        node = node.value
    return node.id if isinstance(node, ast.Name) and node.id in roots else None
