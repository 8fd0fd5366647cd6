"""Guards and constants of one capture.

A source is a Python expression that finds a value at run time, in the scope of the
transformed function (and of its guard function, which has the same signature): a parameter
name (`x`), an attribute or item of one (`self.fc.weight`, `xs[0]`), or a constant the
capture embeds (`__fl_c3`, e.g. a module reached through a global). Guards are conditions
over sources; the runtime compiles them into one function per cache entry."""
from __future__ import annotations

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
        name = self._const_names.get(id(obj))
        if name is None:
            import re
            base = re.sub(r"[^0-9a-zA-Z_]", "_", hint)[:24] or "c"
            name = f"__fl_{base}_{len(self.constants)}"
            self.constants[name] = obj
            self._const_names[id(obj)] = name
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

    def attr_source(self, module: types.ModuleType, attr: str) -> str:
        return f"{self.constant(module, module.__name__.split('.')[-1])}.{attr}"

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


def _is_literal(v) -> bool:
    if isinstance(v, (int, float, str, bytes)):
        return True
    if isinstance(v, tuple):
        return all(_is_literal(x) for x in v)
    return False


def unshared(written, inputs) -> bool:
    """Each tensor of `written` is the only one of `inputs` on its storage (empty ones aside)."""
    count: dict[int, int] = {}
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.numel():
            p = t.untyped_storage().data_ptr()
            count[p] = count.get(p, 0) + 1
    return all(not t.numel() or count.get(t.untyped_storage().data_ptr(), 0) <= 1 for t in written)
