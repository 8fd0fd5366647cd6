"""What autocast does to a call, asked of torch itself rather than of a list kept by hand.

The call runs on fake tensors of its arguments' shapes and dtypes on the autocast's device type,
with that device's autocast on and off (ATen's autocast kernels are registered for every device
type whether or not the machine has one: fake CUDA tensors get the CUDA policy on a CPU-only
machine). Autocast casts the call's arguments (ATen's cast of them shows in the ATen ops the call
runs), or has an op compute in float32 (its results' dtypes differ with autocast on and off). The graph has no autocast (kernels know none), so capture
casts the arguments itself and records the call on them; that is eager's computation only if the
ATen ops the call runs are the same as under autocast (an op computing in float32 inside a call
that autocast runs in float16 would not be): a third run, on the cast arguments with autocast
off, must run the same ATen ops with results of the same dtypes, or the call runs in Python. An op
may cast its own arguments too (SDPA's math kernel computes in float32): where autocast changes
nothing the call is recorded as it is, and of several casts seen, autocast's is the one whose run
with autocast off reproduces the computation. A composite op whose parts autocast treats apart
(`cross_entropy` under bfloat16: `log_softmax` in bfloat16, its result cast to float32 for
`nll_loss`) is recorded as the ATen ops it ran under autocast (`AtenCalls`), each as a graph node.

A probe costs milliseconds (three runs on fake tensors), and a model asks dozens: the answers are
kept on disk beside the program cache (`$FUSELENS_CACHE_DIR/autocast-probes-<compiler hash>`: a
file per fuselens and torch build, keyed by the function's name and the arguments' spec), so a
later process asks none again.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .. import settings
from ..backend.program_cache import qualified_name
from .values import SymInt, TensorVar

REFUSED = object()  # eager raises under autocast, or runs ATen ops the graph could not: Python runs it
# ATen's autocast casts floating-point tensors other than float64 (`is_eligible`, autocast_mode.h)
CASTS = (torch.float16, torch.bfloat16, torch.float32)
_cache: dict = {}


def cast_to(fn, args, kwargs, device_type: str, dtype: torch.dtype):
    """The dtype autocast on `device_type` (computing in `dtype`) casts the float16/bfloat16/
    float32 tensor arguments of `fn(*args, **kwargs)` (TensorVars) on that device to; None where
    it casts none; `AtenCalls` where it casts values inside the call; REFUSED where eager under
    autocast raises, computes what no recording of ATen ops would, or fake tensors cannot run the call."""
    tensors: dict = {}  # one tensor passed twice (`attention(x, x, x)`) is one tensor in the probe too
    spec = tree_map(lambda v: _Tensor(v.meta.dtype, tuple(v.meta.shape), v.meta.stride(), v.device,
                                      tensors.setdefault(id(v), len(tensors)))
                    if isinstance(v, TensorVar)
                    else v.hint if isinstance(v, SymInt) else v, (args, kwargs))
    try:
        key = (fn, device_type, dtype, repr(spec))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _cache:
        return _cache[key]
    stable = _stable_key(fn, device_type, dtype, spec) if key is not None else None
    answer = _on_disk().get(stable, _UNASKED) if stable is not None else _UNASKED
    if answer is _UNASKED:
        answer = _probe(fn, spec, device_type, dtype)
        if stable is not None:
            _new[stable] = answer
    answer = REFUSED if answer == "refused" else answer  # (REFUSED as written on disk)
    if key is not None:
        _cache[key] = answer
    return answer


_UNASKED = object()
_disk: dict | None = None  # earlier processes' answers (stable key -> answer), read on first use
_new: dict = {}  # this process's answers not yet written


def _stable_key(fn, device_type, dtype, spec) -> str | None:
    """The key of a probe that another process computes too: None where `fn` has no name that
    finds it again (a lambda, a bound method)."""
    name = qualified_name(fn)
    return None if name is None else repr((name, device_type, dtype, spec))


def _path() -> str:
    # (kept per compiler version: another build's probe may answer otherwise)
    return os.path.join(settings.cache_dir(), f"autocast-probes-{settings.compiler_version()}")


def _on_disk() -> dict:
    global _disk
    if not settings.program_cache_enabled():
        return {}
    if _disk is None:
        try:
            with open(_path(), "rb") as f:
                _disk = pickle.load(f)
            if not isinstance(_disk, dict):
                raise TypeError(type(_disk).__name__)
        except Exception:  # noqa: BLE001 - absent or unreadable: a cache, asked again
            _disk = {}
    return _disk


def save_probes() -> None:
    """Write the answers this process found (with those on disk now) whole, or not at all."""
    global _disk
    if not _new or not settings.program_cache_enabled():
        return
    with _lock:  # (captures in several threads)
        new = {k: "refused" if v is REFUSED else v for k, v in list(_new.items())}
        _new.clear()
        _disk = None
        merged = {**_on_disk(), **new}
        try:
            path = _path()
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(merged, f, protocol=4)
            os.replace(tmp, path)
        except OSError as e:
            logging.getLogger("fuselens.capture").debug("autocast probes not stored (%s)", e)
        _disk = merged


_lock = threading.Lock()


@dataclass(frozen=True)
class _Tensor:
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    device: torch.device
    identity: int  # arguments of one identity are one tensor (code may ask `q is k`)


@dataclass(frozen=True)
class AtenCalls:
    """A call as the ATen ops it ran under autocast: `steps` are (op name, overload, args, kwargs)
    whose tensors are `Ref`s to the call's tensor arguments (in `tree_leaves` order) or to earlier
    steps' tensor results; `result` is the call's result in the same terms. Plain data (kept on disk)."""
    steps: tuple
    result: object

    def op(self, step):
        name, overload = self.steps[step][:2]
        return getattr(getattr(torch.ops.aten, name), overload)


@dataclass(frozen=True)
class Ref:
    step: int  # -1: the call's tensor arguments
    index: int  # the tensor leaf's position among them / the step's results


class _Trace(TorchDispatchMode):
    """The ATen ops a call runs (below autocast: after its casts), with their results' dtypes,
    and the dtypes autocast cast the call's own tensor arguments to; and the call as `AtenCalls`
    (None where a step reads a tensor made outside the trace's reach)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {id(t) for t in inputs}
        self.ops, self.casts = [], set()
        self.refs = {id(t): Ref(-1, i) for i, t in enumerate(inputs)}
        self.keep = list(inputs)  # (ids stay unique while the trace runs)
        self.steps = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy and args and id(args[0]) in self.inputs:
            self.casts.add(out.dtype)
        elif func.overloadpacket is not torch.ops.prim.device and not func.is_view:  # (views compute nothing)
            self.ops.append((func.overloadpacket, tuple(t.dtype for t in tree_leaves(out)
                                                          if isinstance(t, torch.Tensor))))
        if func._schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
            self.steps = None  # (a graph node computes a value; random draws are the graph's own)
        elif self.steps is not None and func.namespace == "aten":
            try:
                call = tree_map(self.ref, (args, kwargs or {}))
            except KeyError:
                self.steps = None
            else:
                step = len(self.steps)
                self.steps.append((func.overloadpacket.__name__, func._overloadname, *call))
                for i, t in enumerate(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                    self.refs.setdefault(id(t), Ref(step, i))
                    self.keep.append(t)
        return out

    def ref(self, v):
        return self.refs[id(v)] if isinstance(v, torch.Tensor) else v

    def calls(self, out):
        """The traced call as AtenCalls, its result `out`; None where it cannot be replayed."""
        if self.steps is None:
            return None
        try:
            return AtenCalls(tuple(self.steps), tree_map(self.ref, out))
        except KeyError:
            return None


_modes = threading.local()


def _fake_mode() -> FakeTensorMode:
    """This thread's fake mode for the probes: one made per probe cost 0.85 ms of recording its
    maker's stack (Swin-T's capture: 264 probes)."""
    mode = getattr(_modes, "mode", None)
    if mode is None:
        mode = _modes.mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _probe(fn, spec, device_type, dtype):
    with _fake_mode():
        def fakes(cast=None):
            made = {}

            def fake(v):
                if isinstance(v, _Tensor):
                    d = cast if cast is not None and v.dtype in CASTS else v.dtype
                    if v.identity not in made:
                        made[v.identity] = torch.empty_strided(v.shape, v.stride, dtype=d, device=v.device)
                    return made[v.identity]
                return v
            return tree_map(fake, spec)
        on = _run(fn, fakes(), device_type, dtype)
        off = _run(fn, fakes(), device_type, None)
        if on is None:  # eager raises under autocast, or the probe cannot tell what it does
            return REFUSED
        if off is not None and (on[0], on[2], _computing(on[1])) == (off[0], off[2], _computing(off[1])):
            return None  # autocast changes nothing: casts seen are the op's own (SDPA's math upcast)
        results, casts = on[0], on[2]
        if casts:  # ATen's cast of the arguments (lower precision, float32, the widest of them)
            targets = sorted(casts, key=str)  # (with the op's own casts, as SDPA's math kernel's)
        else:  # or an op told to compute in float32 (`softmax(x, dtype=torch.float32)`), or casts of
            # views of the arguments (`linear(q, w.chunk(3)[0])`: eager without autocast raises there)
            floats = [d for d in results if d.is_floating_point]
            if not floats or off is not None and results == off[0]:
                return None
            targets = floats[:1]
        # autocast's target: the dtype whose arguments, autocast off, make the same computation
        for target in targets:
            cast = _run(fn, fakes(target), device_type, None)
            if cast is not None and _computing(cast[1]) == _computing(on[1]) and cast[0] == results:
                return target
        return on[3] if on[3] is not None else REFUSED


def _computing(ops):
    """The ATen ops of a trace less its casts (autocast's, of intermediates)."""
    return [op for op in ops if op[0] is not torch.ops.aten._to_copy]


def _run(fn, args_kwargs, device_type, dtype):
    """(dtypes of the tensor results, ATen trace, dtypes autocast cast arguments to, the call as
    AtenCalls or None) of the call under autocast computing in `dtype` on `device_type` (None:
    autocast off there); None if it raises."""
    args, kwargs = args_kwargs
    enabled, previous = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_enabled(device_type, dtype is not None)
    if dtype is not None:
        torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(False)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    # it logs each meta kernel that raises: here an answer (`disabled`, not a level: setLevel
    # clears every logger's cache, 0.17 ms a probe)
    silenced, log.disabled = log.disabled, True
    try:
        with _Trace([t for t in tree_leaves(args_kwargs) if isinstance(t, torch.Tensor)]) as trace:
            out = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - eager raises here, or fake tensors cannot run it
        return None
    finally:
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, previous)
        torch.set_autocast_cache_enabled(cache)
        log.disabled = silenced
    return (tuple(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor)), trace.ops, trace.casts,
            trace.calls(out))
