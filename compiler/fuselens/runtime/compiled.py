"""The runtime: a cache of captured entries per function, guard checks, recompiles, dynamic
dims after a size change, and the eager fallback (errors.fall_back) when capture fails."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..capture import breaks as B
from ..capture.autocast import save_probes
from ..capture.capture import Capture, GraphInfo, capture
from ..capture.source import FunctionSource, NoSourceError, build_function, factory_code, function_source
from .. import stats
from ..backend import driver
from ..backend.cudagraphs import CudaGraphed, graphable
from ..errors import InternalError, fall_back, warn
from . import capture_cache, native_guards
from .ddp_buckets import split_for_ddp
from .reinplace import reinplace
from .distributed import call_with_forward, is_ddp, is_fsdp_unit, unit_call

RECOMPILE_LIMIT = 8
# recompiles of a function and all its continuations together: each recompile of an entry makes
# continuations of its own, so per-function limits alone let a value that changes every call (a
# NumPy random draw live across breaks) grow the tree without bound
ACCUMULATED_RECOMPILE_LIMIT = 64
_LOG_CAPTURE = logging.getLogger("fuselens.capture")
_LOG_RUNTIME = logging.getLogger("fuselens.runtime")


# -- graphs ------------------------------------------------------------------------------------
# torch's "barebones" unsigned dtypes: few kernels (CUDA's _foreach_copy_ has none), copied one by one
_BAREBONES_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)

class GraphCall:
    """Runs one captured graph: compiled by the backend on first call, mutated inputs
    written back after it."""

    def __init__(self, info: GraphInfo, mode: str, dynamic_dims):
        self.info = info
        self.mode = mode
        self.dynamic_dims = dynamic_dims
        self.compiled = None
        self.n_wb = len(info.writeback)
        self.wb_targets = [info.inputs.index(s) for s in info.writeback]
        self.wb_positions = set(self.wb_targets)
        self.wb_plan = None  # (groups of targets copied by one _foreach_copy_, the others): first call

    def __call__(self, *inputs):
        targets = inputs
        if self.n_wb and torch.is_grad_enabled():
            # an input written back must not be the tensor the graph saves for backward (the
            # write bumps its version and backward would refuse it): the graph gets a copy
            copied = [k for k in self.wb_positions if inputs[k].requires_grad]
            if copied:
                inputs = list(inputs)
                for k in copied:
                    inputs[k] = inputs[k].clone()
        fn = self.compiled
        if fn is None:
            fn = self.compiled = self._compile(inputs)
            # a graph that draws random numbers takes a fresh seed per call as a kernel argument:
            # a replayed CUDA graph would freeze it, so such graphs launch normally
            if self.mode == "reduce-overhead" and graphable(inputs) and not getattr(fn, "uses_random", False):
                self.compiled = CudaGraphed(fn, on_direct=lambda: setattr(self, "compiled", fn),
                                            fixed_layouts=not any(self.dynamic_dims))  # (the guards fix them)
        try:
            if torch.is_autocast_enabled():  # capture already inserted autocast's casts
                with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                    outs = fn(*inputs)
            else:
                outs = fn(*inputs)
        except Exception as e:  # the user's error (driver.EagerRun): eager's writes before it are made
            written = getattr(e, "fl_input_values", None)
            if written is not None:
                del e.fl_input_values
                for source, value in written.items():
                    _copy_into(targets[self.info.inputs.index(source)], value)
            raise
        if self.n_wb:
            self._write_back(targets, outs[len(outs) - self.n_wb:])
        return outs

    def _write_back(self, targets, new):
        """The graph's new values of mutated inputs copied into them: those autograd does not
        record (BatchNorm's running statistics) by one `_foreach_copy_` per dtype and device (one
        list of mixed dtypes takes its slow path, a copy each: a ResNet-50 step's 159 cost 159
        launches and ~0.9 ms of an H100 host's time; by dtype, 3 launches and 60 us), the rest one
        by one, recorded as eager's in-place op records them (the input joins the graph).
        Capture's guards keep the inputs' aliasing as it was; targets that overlap are copied in
        order, one by one, as are targets an `out=` resized (eager resized them: resized here
        first). Which are which is decided at the first call: the guards fix each target's
        dtype, device, shape and requires_grad, and the grad mode, so the values' requires_grad."""
        targets = [targets[k] for k in self.wb_targets]
        if self.wb_plan is None:
            distinct = len({(t.untyped_storage().data_ptr(), t.device) for t in targets}) == len(targets)
            groups: dict = {}  # (dtype, device) -> target indices
            one_by_one = []
            for i, (target, value) in enumerate(zip(targets, new)):
                if (distinct and not (target.requires_grad or value.requires_grad) and target.shape == value.shape
                        and target.dtype not in _BAREBONES_UNSIGNED):
                    groups.setdefault((target.dtype, target.device), []).append(i)
                else:
                    one_by_one.append(i)
            self.wb_plan = list(groups.values()), one_by_one
        groups, one_by_one = self.wb_plan
        for i in one_by_one:
            if new[i] is not targets[i]:  # (a write the graph made in place: runtime/reinplace.py)
                _copy_into(targets[i], new[i])
        for group in groups:
            pairs = [(targets[i], new[i]) for i in group if new[i] is not targets[i]]
            if pairs:
                torch._foreach_copy_(*map(list, zip(*pairs)))

    def _compile(self, inputs):
        # capture's guards fix every graph input's layout and the grad mode; the backend runs
        # the graph eagerly where it fails (errors.fall_back), so this never raises
        name = f"{self.info.name} of {self.info.function}"
        subclass = next((type(t) for t in inputs if isinstance(t, torch.Tensor)
                         and type(t) not in (torch.Tensor, nn.Parameter)), None)
        if subclass is not None:  # (FSDP2's DTensor parameters, outside its hooks)
            warn(f"{name} takes a {subclass.__name__}, a tensor subclass whose ops dispatch in Python: "
                 "running it eagerly")
            run = driver.eager_run(self.info.gm)
            return lambda *inputs: tuple(run(*inputs))
        if self.mode != "reduce-overhead" and not any(self.dynamic_dims):  # (a piece's sizes are fixed)
            try:
                split = split_for_ddp(self.info.gm, inputs, self.mode, name)
            except Exception as e:  # one graph: no overlap, the same results
                warn(f"internal error splitting {name} at DDP's buckets ({type(e).__name__}: {e}); "
                     "compiling it as one graph")
                split = None
            if split is not None:
                return split
        gm = reinplace(self.info.gm, inputs, self.wb_targets) if self.n_wb else self.info.gm
        return driver.compile_graph(gm, list(inputs), mode=self.mode,
                                     dynamic_dims=self.dynamic_dims, guarded=True, name=name)

    @property
    def pieces(self) -> int:
        """How many graphs the backend compiled this one as (DDP's buckets: runtime/ddp_buckets.py)."""
        return len(getattr(self.compiled, "pieces", None) or [self.info])

    @property
    def kernels(self):
        return list(getattr(self.compiled, "kernels", []) or [])

    @property
    def wrapper_source(self):
        return getattr(self.compiled, "wrapper_source", None)


def _copy_into(target, value):
    """An input's new value written into it, as eager's in-place op left it."""
    if target.shape != value.shape:
        target.resize_(value.shape)
    if target.is_leaf and target.requires_grad:  # mutated under no_grad (an optimizer
        with torch.no_grad():                     # step): capture rejects the rest
            target.copy_(value)
    else:
        target.copy_(value)


# -- cache entries ---------------------------------------------------------------------------------
@dataclass
class CacheEntry:
    function: str
    guards: list
    source: str
    graphs: list[GraphInfo]
    graph_break: B.GraphBreak | None
    fn: object = None
    guard_fn: object = None
    graph_calls: list[GraphCall] = field(default_factory=list)
    tensor_shapes: dict = field(default_factory=dict)
    guard_namespace: dict = field(default_factory=dict)
    # a recompile: the previous entry's guard that failed, in words; its graph inputs' dynamic dims
    recompiled_because: str | None = None
    dynamic_dims: dict = field(default_factory=dict)

    @property
    def kernels(self):
        out = []
        for g in self.graph_calls:
            out += g.kernels
        return out

    @property
    def wrappers(self):
        return [g.wrapper_source for g in self.graph_calls if g.wrapper_source]

    def failing_guard(self, args, kwargs) -> str | None:
        """The first guard that fails for these arguments, in words."""
        for g in self.guards:
            try:
                fn = _make_guard_fn(self._sig, [g], self.guard_namespace)
                if not fn(*args, **kwargs):
                    return g.reason
            except Exception:
                return g.reason
        return None


_COLLECT = threading.local()


@contextlib.contextmanager
def collecting():
    """Records every cache entry created (including resume functions') while active."""
    prev = getattr(_COLLECT, "log", None), getattr(_COLLECT, "callees", None)
    _COLLECT.log = []
    _COLLECT.callees = weakref.WeakKeyDictionary()  # callees compiled afresh: their entries seen too
    try:
        yield _COLLECT.log
    finally:
        _COLLECT.log, _COLLECT.callees = prev


def _log(entry):
    log = getattr(_COLLECT, "log", None)
    if log is not None:
        log.append(entry)


# -- compiled functions --------------------------------------------------------------------------------
class CompiledFunction:
    """What `fuselens.compile(fn)` returns: call it as the function."""

    def __init__(self, fn, *, mode="default", fullgraph=False, dynamic=None, fs=None):
        self._fn = fn
        self._fs = fs
        self.mode = mode
        self.fullgraph = fullgraph
        self.dynamic_setting = dynamic
        self.entries: list[CacheEntry] = []
        self.children: list[CompiledFunction] = []
        self.dynamic: dict[str, set] = {}
        self.disabled: str | None = None
        self._last_failure = None
        self._tree = {"recompiles": 0, "warned": False}  # shared with its continuations (_entry)
        functools.update_wrapper(self, fn) if fn is not None else None
        if fs is not None:
            self.__name__ = fs.name
            self.__qualname__ = fs.qualname

    def __get__(self, obj, objtype=None):  # decorated methods
        if obj is None:
            return self
        return types.MethodType(self, obj)

    def __call__(self, *args, **kwargs):
        for e in self.entries:
            try:
                ok = e.guard_fn(*args, **kwargs)
            except Exception:
                ok = False
            if ok:
                return e.fn(*args, **kwargs)
        return self._miss(args, kwargs)

    @property
    def original(self):
        return self._fn

    def _eager(self, args, kwargs):
        if self._fn is not None:
            return self._fn(*args, **kwargs)
        return self._eager_generated(*args, **kwargs)

    @functools.cached_property
    def _eager_generated(self):
        """A resume function run as plain Python (its eager form)."""
        try:
            return build_function(self._fs.source_text, self._fs.name, self._fs.globals,
                                  dict(self._fs.closure))
        except Exception as e:  # the code before this resume has run: nothing can replace it
            raise InternalError(f"fuselens: no eager form of {self._fs.qualname}: "
                                f"{type(e).__name__}: {e}") from e

    def _source(self) -> FunctionSource:
        if self._fs is None:
            self._fs = function_source(self._fn)
        return self._fs

    def _miss(self, args, kwargs):
        if self.disabled:
            return self._eager(args, kwargs)
        if len(self.entries) >= RECOMPILE_LIMIT:
            reason = self.entries[-1].failing_guard(args, kwargs) or "unknown guard"
            self.disabled = f"recompile limit ({RECOMPILE_LIMIT}) reached; guard that kept failing: {reason}"
            warn(f"{self._name()}: {self.disabled}. Running it eagerly from now on.")
            return self._eager(args, kwargs)
        if self.entries and self._tree["recompiles"] >= ACCUMULATED_RECOMPILE_LIMIT:
            if not self._tree["warned"]:
                self._tree["warned"] = True
                warn(f"{self._name()}: {ACCUMULATED_RECOMPILE_LIMIT} recompiles of this function and its "
                     f"continuations; guard that failed: {self.entries[-1].failing_guard(args, kwargs)}. "
                     "A piece that misses its entries runs eagerly from now on.")
            return self._eager(args, kwargs)
        try:
            fs = self._source()
        except NoSourceError as e:
            fs, self.disabled = None, str(e)
        if fs is None:  # outside the `except`: the user's error must not come chained to ours
            warn(f"cannot compile {self._name()}: {self.disabled}. Running it eagerly.")
            return self._eager(args, kwargs)
        failed = self.entries[-1].failing_guard(args, kwargs) or "unknown guard" if self.entries else None
        self._mark_dynamic(args, kwargs)
        try:
            entry = self._build(fs, args, kwargs)
        except B.GraphBreakError:
            raise
        except Exception as e:
            cause = e
        else:
            cause = None
        if cause is not None:
            # capture ran none of this call's user statements: eager is the call's only run
            out = fall_back("capture", self._name(), cause, lambda: self._eager(args, kwargs))
            self.disabled = f"internal error in capture: {type(cause).__name__}: {cause}"
            return out
        entry.recompiled_because = failed
        self._tree["recompiles"] += failed is not None
        self.entries.append(entry)
        _log(entry)
        if _LOG_CAPTURE.isEnabledFor(logging.DEBUG):
            _LOG_CAPTURE.debug("%s: entry %d\nguards:\n  %s\n%s%s", entry.function, len(self.entries),
                               "\n  ".join(g.reason for g in entry.guards), entry.source,
                               "".join(f"\n{g.name}:\n{g.gm.code.strip()}" for g in entry.graphs))
        if failed:
            _LOG_RUNTIME.debug("%s: recompiled (%d entries) because %s; dynamic dims: %s", entry.function,
                               len(self.entries), failed, self.dynamic or "none")
        # Not re-checked eagerly if it raises: the breaking statements run here are the user's
        # own, once; graphs (errors.fall_back in the backend) and resume functions (their own
        # _miss) turn fuselens's errors into eager runs before anything they did is visible
        return entry.fn(*args, **kwargs)

    def _name(self):
        return getattr(self, "__qualname__", None) or repr(self._fn)

    def _mark_dynamic(self, args, kwargs):
        """After a size change, the dims that changed become dynamic (no more recompiles)."""
        if self.dynamic_setting is False or not self.entries:
            return
        last = self.entries[-1]
        for src, shape in last.tensor_shapes.items():
            try:
                now = _resolve(src, last, args, kwargs)
            except Exception:
                continue
            if isinstance(now, torch.Tensor) and now.dim() == len(shape):
                changed = {d for d, (a, b) in enumerate(zip(shape, now.shape)) if a != b}
                if changed:
                    self.dynamic.setdefault(src, set()).update(changed)

    def _build(self, fs, args, kwargs) -> CacheEntry:
        prefix = f"{len(self.entries)}_" if self.entries else ""
        if fs.generated:  # a resume's own resumes must not reuse its name (self-recursion)
            prefix = fs.name[len("__fl_resume_"):] + "_" + prefix
        start = time.perf_counter()
        kept = capture_cache.key(fs, self.fullgraph)
        entry = self._kept_entry(kept, fs, args, kwargs) if kept else None
        if entry is None:
            with stats.gc_paused():
                cap: Capture = capture(fs, args, kwargs, dynamic=self.dynamic, fullgraph=self.fullgraph,
                                       prefix=prefix, compile_callee=compiled_callee)
            stats.capture["functions"] += 1
            save_probes()  # what autocast does to each call, for the next process
            entry = self._entry(fs, cap)
            if kept:
                capture_cache.keep(kept, cap, args, kwargs)
        stats.capture["seconds"] += time.perf_counter() - start
        return entry

    def _kept_entry(self, k, fs, args, kwargs) -> CacheEntry | None:
        """The entry of a capture kept by an earlier process (runtime/capture_cache.py) whose
        guards hold for this call, or None."""
        with stats.gc_paused():
            for cap in capture_cache.candidates(k, fs, args, kwargs):
                try:  # (an entry that does not build costs a capture, never the compile)
                    entry = self._entry(fs, cap)
                    ok = entry.guard_fn(*args, **kwargs)
                except Exception as e:
                    _LOG_RUNTIME.debug("%s: a kept capture not taken (%s: %s)", fs.qualname, type(e).__name__, e)
                    ok = False
                if not ok:
                    _LOG_RUNTIME.debug("%s: a kept capture's guards do not hold here", fs.qualname)
                else:
                    stats.capture["kept"] += 1
                    for src, dims in cap.dynamic.items():  # (dynamic in this process's recompiles too)
                        self.dynamic.setdefault(src, set()).update(dims)
                    return entry
        return None

    def _entry(self, fs, cap: Capture) -> CacheEntry:
        ns = dict(cap.namespace)
        ns["torch"] = torch
        graph_calls = []
        if cap.graph is not None:
            dyn = [cap.dynamic.get(s, frozenset()) for s in cap.graph.inputs]
            gc = GraphCall(cap.graph, self.mode, dyn)
            ns[cap.graph.name] = gc
            graph_calls.append(gc)
        for r in cap.resumes:
            child = CompiledFunction(None, mode=self.mode, fullgraph=False, fs=r.fs)
            child._tree = self._tree
            self.children.append(child)
            ns[r.name] = child
        for name, src, globals_ in cap.helpers:
            ns[name] = build_function(src, name, globals_, dict(ns))
        codes = cap.codes  # (compiled once, kept with the capture: ~0.1 s of a ResNet-50's on the dev CPU)
        if "function" not in codes:
            codes["function"] = factory_code(cap.function_source, fs.name, ns)
            codes["guard"] = factory_code(cap.guard_source, "__fl_guard", {})
        fn = build_function(cap.function_source, fs.name, fs.globals, ns, codes["function"])
        guard_ns = {"torch": torch, **cap.namespace}
        guard_fn = build_function(cap.guard_source, "__fl_guard", guard_ns, {}, codes["guard"])
        entry = CacheEntry(fs.qualname, cap.guards, cap.source,
                           [cap.graph] if cap.graph is not None else [], cap.graph_break, fn,
                           guard_fn, graph_calls, cap.tensor_shapes, guard_ns,
                           dynamic_dims={src: sorted(dims) for src, dims in cap.dynamic.items()})
        entry._sig = cap.guard_source.split("\n")[0]
        native_guards.install(entry, cap)
        return entry

    def all_entries(self) -> list[CacheEntry]:
        out = list(self.entries)
        for c in self.children:
            out += c.all_entries()
        return out


def _resolve(src, entry, args, kwargs):
    sig = entry._sig  # "def __fl_guard(x, y=...):"
    ns = dict(entry.guard_namespace)
    code = f"{sig}\n    return {src}"
    exec(compile(code, "<fuselens-guard>", "exec"), ns)
    return ns["__fl_guard"](*args, **kwargs)


def _make_guard_fn(sig, guards, ns):
    body = " and ".join(f"({g.expr})" for g in guards) or "True"
    g = dict(ns)
    exec(compile(f"{sig}\n    return {body}", "<fuselens-guard>", "exec"), g)
    return g["__fl_guard"]


class CompiledModule(nn.Module):
    """What `fuselens.compile(module)` returns, as `torch.compile` returns an OptimizedModule:
    calling it runs the module's forward compiled. It holds the module as `_orig_mod` and shares
    everything with it (parameters, buffers, train/eval mode; other attributes are read from
    it); the original module stays eager. Its state_dict keys carry the `_orig_mod.` prefix, as
    torch.compile's do."""

    def __init__(self, mod: nn.Module, compiled: CompiledFunction):
        super().__init__()
        self._orig_mod = mod
        self._fuselens_compiled = compiled

    def forward(self, *args, **kwargs):
        # from its dict: `self._orig_mod` is nn.Module.__getattr__, Python on every call
        return self._fuselens_compiled(self._modules["_orig_mod"], *args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


class CompiledWrapper(CompiledModule):
    """What `fuselens.compile` returns for a torch.distributed wrapper (runtime/distributed.py):
    a DDP module (`wrapped` the module it wraps) or an FSDP2 unit (`wrapped` the unit itself).
    The wrapper's Python runs, `wrapped`'s forward compiled."""

    def __init__(self, mod: nn.Module, wrapped: nn.Module, compiled: CompiledFunction):
        super().__init__(mod, compiled)
        self.__dict__["_fuselens_wrapped"] = wrapped  # (not a submodule: the state_dict is mod's)

    def forward(self, *args, **kwargs):
        return call_with_forward(self._modules["_orig_mod"], self.__dict__["_fuselens_wrapped"],
                                 self._fuselens_compiled, args, kwargs)


def compiled_module(mod: nn.Module, compile_function) -> nn.Module:
    """`fuselens.compile(mod)`; `compile_function(forward)` makes its CompiledFunction."""
    if is_ddp(mod):
        inner = mod.module
        if compiled_of(inner) is not None:  # compile(DDP(compile(model))): compiled already
            return mod
        return CompiledWrapper(mod, inner, compile_function(type(inner).forward))
    if is_fsdp_unit(mod):
        return CompiledWrapper(mod, mod, compile_function(type(mod).forward))
    return CompiledModule(mod, compile_function(type(mod).forward))


_CALLEES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_of(obj) -> CompiledFunction | None:
    """The CompiledFunction of what `fuselens.compile` returned (or of a module compiled in place)."""
    if isinstance(obj, CompiledFunction):
        return obj
    if isinstance(obj, nn.Module):  # a CompiledModule, or a module compiled in place
        return obj.__dict__.get("_fuselens_compiled")
    bound = getattr(obj, "__func__", None)
    return bound if isinstance(bound, CompiledFunction) else None


def compiled_callee(fn):
    """`fn` compiled on its own (once per function), for a call inside a statement that runs
    in Python after a graph break: a function or method with source gets its own cache entries;
    an FSDP2 unit runs its hooks in Python and its forward compiled (runtime/distributed.py);
    anything else (a builtin, a module, code without source) is called as it is."""
    if is_fsdp_unit(fn):
        return unit_call(fn, CompiledFunction)
    if isinstance(fn, types.MethodType):
        inner = compiled_callee(fn.__func__)
        return fn if inner is fn.__func__ else types.MethodType(inner, fn.__self__)
    if not isinstance(fn, types.FunctionType) or getattr(fn, "__fl_source__", None) is not None:
        return fn
    callees = getattr(_COLLECT, "callees", None)
    callees = _CALLEES if callees is None else callees
    cf = callees.get(fn)
    if cf is None:
        try:
            function_source(fn)
        except NoSourceError:
            return fn
        cf = callees[fn] = CompiledFunction(fn)
    return cf
