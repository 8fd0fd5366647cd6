"""Building one FX graph: graph inputs, op nodes with meta tensors for shapes, outputs."""
from __future__ import annotations

import contextlib
import operator
import re

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..ops import effects
from . import meta_memo
from .values import LocalFunction, SymInt, TensorVar, Unknown, leaves


class MetaEvalError(Exception):
    """Evaluating an op on meta tensors failed (the op is invalid, or has no meta kernel).
    `dynamic_shape`: it failed in an operator whose result's shape depends on the data."""

    def __init__(self, msg, dynamic_shape=False):
        super().__init__(msg)
        self.dynamic_shape = dynamic_shape


def to_meta(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:  # sparse, mkldnn: no strides; every op on it runs in Python
        m = torch.empty(tuple(t.shape), dtype=t.dtype, layout=t.layout, device="meta")
    else:
        m = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    if t.requires_grad and t.is_floating_point() or t.is_complex() and t.requires_grad:
        m.requires_grad_(True)
    return m


def _device_of(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, TensorVar):
            return a.device
        if isinstance(a, (list, tuple)):
            d = _device_of(a, {})
            if d is not None:
                return d
    return None


def _parse_device(v):
    if isinstance(v, torch.device):
        return v
    if isinstance(v, str):
        try:
            return torch.device(v)
        except RuntimeError:
            return None
    if isinstance(v, int):
        return torch.device("cuda", v)
    return None


class GraphBuilder:
    """One graph. `abstract`: no meta evaluation (shapes unknown)."""

    def __init__(self, abstract: bool = False):
        self.graph = fx.Graph()
        self.abstract = abstract
        self.inputs: list[tuple[str, object]] = []   # (source expression, runtime object)
        self._input_by_id: dict[int, TensorVar] = {}
        self._by_storage: dict[int, list] = {}  # storage address -> the inputs on it: (source, tensor)
        self._by_source: dict[str, object] = {}
        self._storageless: list = []  # tensor inputs with no storage
        self._names: set[str] = set()  # the placeholders' names
        self._last_input = None  # placeholders are kept in order, before the first op
        self.n_ops = 0
        # the torch.utils.checkpoint call being evaluated: its ops are recomputed for the backward
        # (autograd/partition.py), not saved (capture/builtins.py `_checkpoint`)
        self.recompute = None
        self.regions = 0
        self.lines: set[tuple[str, int]] = set()
        self.constants: dict[str, object] = {}  # attributes of the graph module (`_as_node`)

    # -- inputs --------------------------------------------------------------------------
    def input(self, obj, source: str, loc=None) -> TensorVar:
        key = id(obj)
        tv = self._input_by_id.get(key)
        if tv is not None:
            return tv
        node = self._placeholder(source)
        if obj is None or self.abstract:
            meta, device = None, None
        else:
            meta, device = to_meta(obj), obj.device
        node.meta["val"] = meta
        node.meta["device"] = device
        node.meta["source"] = source
        node.meta["is_leaf"] = obj is None or obj.is_leaf
        tv = TensorVar(node, meta, device, source=source)
        self.inputs.append((source, obj))
        self._input_by_id[key] = tv
        if isinstance(obj, torch.Tensor):
            self._by_source[source] = obj
            storage = _storage_address(obj)
            if storage is not None:
                self._by_storage.setdefault(storage, []).append((source, obj))
            else:
                self._storageless.append(obj)
        return tv

    def input_object(self, source: str):
        """The tensor the input found at `source` is (None: no tensor input there)."""
        return self._by_source.get(source)

    def sharing(self, source: str) -> list[str]:
        """The other inputs, not empty, on the storage of the input found at `source`. Where an
        input has no storage (sparse, a wrapper subclass such as DTensor), what its
        `untyped_storage` raises: which memory it shares is not known."""
        obj = self._by_source.get(source)  # (none in the abstract domain)
        if obj is None:
            return []
        for t in [obj, *self._storageless]:
            t.untyped_storage()
        return [s for s, o in self._by_storage.get(obj.untyped_storage().data_ptr(), ())
                if s != source and o.numel()]

    def _placeholder(self, source: str):
        """A new placeholder, after the last one (placeholders come before the first op)."""
        if self._last_input is not None:
            where = self.graph.inserting_after(self._last_input)
        else:
            first = self._first_op()
            where = self.graph.inserting_before(first) if first is not None else contextlib.nullcontext()
        with where:
            self._last_input = self.graph.placeholder(self._placeholder_name(source))
        return self._last_input

    def abstract_input(self, source: str) -> TensorVar:
        node = self._placeholder(source)
        node.meta["val"] = None
        self.inputs.append((source, None))
        return TensorVar(node, None, None, source=source)

    def _placeholder_name(self, source: str) -> str:
        """A short identifier from the input's source, unique among the graph's placeholders
        (FX makes them the generated function's parameters)."""
        s = re.sub(r"[^0-9a-zA-Z_]+", "_", source).strip("_")
        s = re.sub(r"^(__fl_G_|L_)", "", s)
        s = (s or "in")[:40]
        if not s.isidentifier():
            s = "in_" + s
        name, k = s, 1
        while name in self._names:
            name, k = f"{s}_{k}", k + 1
        self._names.add(name)
        return name

    def _first_op(self):
        for n in self.graph.nodes:
            if n.op != "placeholder":
                return n
        return None

    # -- ops -------------------------------------------------------------------------------
    def call(self, target, args, kwargs, loc, *, n_outputs=None):
        """Add `target(*args, **kwargs)` to the graph. Returns a TensorVar, a tuple of them,
        or raises MetaEvalError."""
        out_meta, device, _ = self.evaluate(target, args, kwargs)
        return self.add(target, args, kwargs, loc, out_meta, device, n_outputs=n_outputs)

    def evaluate(self, target, args, kwargs):
        """Run `target` on meta stand-ins of its tensor arguments (ops/effects.py): its result's
        meta tensors, its device, and what it wrote and aliases (None in the abstract domain)."""
        device = _device_of(args, kwargs)
        if self.abstract:
            return None, device, None
        tvs = _tensor_vars(args, kwargs)
        fn_arg = next((v for v in leaves([args, kwargs]) if callable(v) and not isinstance(v, (TensorVar, type))
                       or isinstance(v, LocalFunction)), None)
        if fn_arg is not None:  # a graph's code names tensors and constants only
            name = fn_arg.name if isinstance(fn_arg, LocalFunction) else _name(fn_arg)
            raise MetaEvalError(f"{_name(target)}: a function as an argument ({name})")
        other = next((tv.meta.layout for tv in tvs if tv.meta.layout != torch.strided), None)
        if other is not None:  # graphs hold strided tensors only (kernels index by strides)
            raise MetaEvalError(f"{_name(target)}: an argument of layout {other}: only strided "
                                "tensors are captured")
        specs = [_stand_in_spec(tv) for tv in tvs]
        metas = effects.stand_ins(specs)
        by_id = {id(tv): m for tv, m in zip(tvs, metas)}
        as_meta = lambda v: by_id[id(v)] if isinstance(v, TensorVar) else _as_meta(v)  # noqa: E731
        margs = _map(args, as_meta)
        mkwargs = _map(kwargs, as_meta)
        if "device" in mkwargs:
            device = _parse_device(mkwargs["device"]) or device
            mkwargs["device"] = "meta"
        if target in (torch.Tensor.to,) and device is not None:
            for a in margs[1:]:  # (a `device=` keyword was read above)
                d = _parse_device(a) if not isinstance(a, (torch.dtype, bool)) else None
                if d is not None:
                    device = d
            margs = [a if isinstance(a, (torch.dtype, bool, torch.Tensor)) or _parse_device(a) is None
                     else "meta" for a in margs]
        elif target is torch.Tensor.cuda:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cuda")
        elif target is torch.Tensor.cpu:
            device = torch.device("cpu")
        if device is None:
            device = torch.device("cpu")
            if "device" not in mkwargs and _takes_device(target):  # a factory (torch.zeros, torch.tensor): meta
                mkwargs["device"] = "meta"
        fn = target if target not in (torch.Tensor.cuda, torch.Tensor.cpu) else torch.Tensor.clone
        memo = meta_memo.key(fn, margs, mkwargs, specs, metas, device)
        recalled = meta_memo.recall(memo, metas)
        if recalled is not None:
            out_meta, eff = recalled
        else:
            try:
                out_meta, eff = effects.run(fn, margs, mkwargs, metas)
            except Exception as e:  # the op is invalid here, or has no meta kernel
                raise MetaEvalError(f"{_name(target)}: {type(e).__name__}: {e}",
                                    getattr(e, "fl_dynamic_shape", False)) from None
            meta_memo.remember(memo, metas, out_meta, eff)
        made = {t.device for t in effects._flat_tensors(out_meta) if t.device.type != "meta"}
        if made:
            # run on meta stand-ins, the call still made a real tensor: it chose the device itself
            # (a TorchScript function's `torch.tensor(...)`), and eager's value is there whatever
            # its arguments' device
            device = next(iter(made))
            out_meta = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                                if isinstance(t, torch.Tensor) and t.device.type != "meta" else t, out_meta)
        _check_device_kernel(fn, margs, mkwargs, device)
        _check_out_dtypes(fn, margs, mkwargs, device)
        eff.tensor_vars = tvs
        return out_meta, device, eff

    def add_on_copies(self, fn, eff, args, kwargs, loc, out_meta, device):
        """`fn`'s call, which writes its arguments `eff.written`, as `OnCopies(fn, written)`, whose
        metas follow from `fn`'s own evaluation (`out_meta`, `eff`) instead of a second one (a
        training BatchNorm's is a Python decomposition, ~4 ms a fresh shape): the written stand-ins
        as the call left them, copied, then the result's tensors that are none of them. Evaluated
        again where a result views an argument without being it."""
        written = tuple(eff.written)
        results = effects._flat_tensors(out_meta)
        if any(a is not None and r is None for a, r in zip(eff.aliases, eff.returns_arg)):
            return self.call(effects.OnCopies(fn, written), args, kwargs, loc)
        copies = [eff.stand_ins[i].clone() for i in written]
        fresh = [t for t, arg in zip(results, eff.returns_arg) if arg not in written]
        return self.add(effects.OnCopies(fn, written), args, kwargs, loc, tuple(copies + fresh), device)

    def add(self, target, args, kwargs, loc, out_meta, device, *, n_outputs=None, aten=None):
        """The graph node of a call `evaluate` ran: a TensorVar, or a tuple of them. `aten`: the
        ATen operators the call reached (its Effects' trace), where known."""
        node_args = _map(args, self._as_node)
        node_kwargs = _map(kwargs, self._as_node)
        node = self.graph.call_function(target, tuple(node_args), node_kwargs)
        node.meta["loc"] = loc
        node.meta["device"] = device
        if aten is not None:
            node.meta["aten"] = aten
        if self.recompute is not None:
            node.meta["recompute"] = self.recompute
        self.n_ops += 1
        if loc is not None:
            self.lines.add((loc[0], loc[1]))
        if self.abstract:
            node.meta["val"] = None
            if n_outputs:
                return tuple(self._getitem(node, i, None, None, loc) for i in range(n_outputs))
            tv = TensorVar(node, None, None)
            tv.abstract_bool = _returns_bool(target, tuple(
                (torch.bool if a.is_bool else torch.float32) if isinstance(a, TensorVar)
                else 1 if isinstance(a, (Unknown, SymInt)) else a for a in args))
            # a Python operator (`x > 0`, `x * 2`) on values assumed to be tensors works on numbers
            # too; any torch function, or a known tensor among the operands, makes it a tensor
            tv.assumed = getattr(target, "__module__", None) == "_operator" \
                and TensorVar.only_assumed(leaves([args, kwargs]))
            return tv
        return self._wrap(node, out_meta, device, loc)

    def _as_node(self, v):
        """A call's argument in the graph: a constant the graph's code cannot spell (a NumPy array
        would print as `array([...])`) is an attribute of the graph module."""
        v = _as_node(v)
        # (a literal's subclass is none: `np.float64(0.5)`, an IntEnum member write no Python)
        if isinstance(v, fx.Node) or type(v) in _LITERALS or callable(v):
            return v
        name = f"_const{len(self.constants)}"
        self.constants[name] = v
        node = self.graph.get_attr(name)
        node.meta.update(val=v, loc=None, device=None)
        return node

    def _wrap(self, node, out_meta, device, loc):
        if isinstance(out_meta, torch.Tensor):
            node.meta["val"] = out_meta
            return TensorVar(node, out_meta, device)
        if isinstance(out_meta, (tuple, list)) and all(isinstance(m, torch.Tensor) or m is None for m in out_meta) \
                and any(isinstance(m, torch.Tensor) for m in out_meta):
            node.meta["val"] = tuple(out_meta)  # (output, None): `need_weights=False` attention
            items = [self._getitem(node, i, m, device, loc) if m is not None else None
                     for i, m in enumerate(out_meta)]
            if isinstance(out_meta, list):
                return items
            # `x.max(dim=1)` is a named tuple (torch.return_types.max): `.values`, `.indices`
            return type(out_meta)(items) if type(out_meta) is not tuple else tuple(items)
        self.graph.erase_node(node)
        self.n_ops -= 1
        err = MetaEvalError(f"{_name(node.target)} returned {type(out_meta).__name__}, not a tensor")
        err.not_a_tensor = True
        raise err

    def _getitem(self, node, i, meta, device, loc):
        n = self.graph.call_function(operator.getitem, (node, i))
        n.meta["val"] = meta
        n.meta["loc"] = loc
        n.meta["device"] = device
        return TensorVar(n, meta, device)

    def sym_node(self, target, args, hint):
        node = self.graph.call_function(target, tuple(_map(args, _as_node)))
        node.meta["val"] = hint
        return node

    # -- finishing ----------------------------------------------------------------------------
    def output(self, values: list, dynamic_sources=frozenset()) -> fx.GraphModule:
        """The graph module returning `values`. Ops whose results nothing uses go, except where
        eager's run of them is seen: a write (`meta["writes"]`: autograd refuses a backward through
        a value saved before it, autograd/facts.py), a random op (it draws), and an op on a size
        of the inputs in `dynamic_sources` that may change (the backend checks its shapes at each
        call's sizes, raising where eager's checks raise, and builds no kernel for it)."""
        self.graph.output(tuple(_as_node(v) for v in values))
        sized = _on_sources(self.graph, dynamic_sources)
        self.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or "writes" in n.meta or n in sized)
        root = torch.nn.Module()
        for name, v in self.constants.items():
            setattr(root, name, v)
        # its Python code made when first run or printed: the backend reads the graph (a model's
        # forward: 20-50 ms of a capture on the dev CPU), and runs the code only to fall back
        return _LazyGraphModule(root, self.graph)


def _on_sources(graph: fx.Graph, sources) -> set:
    """The nodes that read, directly or through others, a placeholder of one of `sources`."""
    found: set = set()
    for n in graph.nodes if sources else ():
        reads = n.meta.get("source") in sources if n.op == "placeholder" else \
            any(a in found for a in n.all_input_nodes)
        if reads:
            found.add(n)
    return found


def _storage_address(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse tensors, wrapper subclasses (DTensor)
        return None


def _check_device_kernel(fn, margs, mkwargs, device):
    """Meta kernels check shapes, not whether `device` has a kernel for these dtypes (`abs` of a
    bool tensor: eager raises NotImplementedError), and an op whose result is unused leaves the
    graph: so `fn` runs here on empty tensors of the same dtypes on `device` (nothing computed,
    allocated or drawn), where meta accepts them too and they give empty results. The answer
    depends on the dtypes, not the sizes: known answers are kept."""
    if fn in _NOT_PROBED_EMPTY:
        return
    leaves = torch.utils._pytree.tree_leaves((margs, mkwargs))
    key = (fn, device, tuple((v.dtype, v.dim()) if isinstance(v, torch.Tensor) else
                             v if isinstance(v, (torch.dtype, str, bool, type(None))) else type(v)
                             for v in leaves))
    if key not in _KERNEL_ERRORS:
        _KERNEL_ERRORS[key] = _probe_device_kernel(fn, margs, mkwargs, device)
    if _KERNEL_ERRORS[key] is not None:
        raise MetaEvalError(f"{_name(fn)}: NotImplementedError: {_KERNEL_ERRORS[key]}")


_KERNEL_ERRORS: dict = {}  # probe key -> the device's NotImplementedError message, or None
# ops whose device kernels divide by a size before looking at the element count: on empty tensors
# they die of SIGFPE instead of answering (CUDA's attention with enable_gqa divides the query heads
# by the key/value heads); they have kernels for every floating dtype on CPU and CUDA
_NOT_PROBED_EMPTY = {torch.nn.functional.scaled_dot_product_attention}


def _probe_device_kernel(fn, margs, mkwargs, device):
    def empty(on):
        return lambda v: torch.empty((0,) * v.dim(), dtype=v.dtype, device=on) \
            if isinstance(v, torch.Tensor) else v
    try:
        probe = fn(*_map(margs, empty("meta")), **_map(mkwargs, empty("meta")))
    except Exception:  # empty shapes are not valid here: ask the dispatcher
        return _missing_device_kernel(fn, margs, mkwargs, device)
    outs = probe if isinstance(probe, (tuple, list)) else [probe]
    if not all(isinstance(o, torch.Tensor) and o.numel() == 0 for o in outs):
        return None
    try:
        fn(*_map(margs, empty(device)), **_map(mkwargs, empty(device)))
    except NotImplementedError as e:  # no kernel for these dtypes on this device
        return str(e)
    except Exception:  # e.g. an empty reduction: refused for emptiness only
        pass
    return None


class _OpsCalled(TorchDispatchMode):
    """The ATen overloads a call dispatches to (below autograd and composite decompositions)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _missing_device_kernel(fn, margs, mkwargs, device):
    """Where empty tensors cannot stand in (sizes the arguments index into: `narrow_copy`'s start),
    the call runs on its meta values and each ATen overload it reaches is looked up in the
    dispatcher's table for `device` (`narrow_copy.out` has none on CUDA): eager's NotImplementedError,
    or None."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(torch.device(device).type)
    if key is None:
        return None
    called = _OpsCalled()
    try:
        with called:
            fn(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - invalid on meta too: capture reports that itself
        return None
    for op in called.ops:
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), key):
            return f"Could not run '{op.name()}' with arguments from the '{key}' backend."
    return None


def _check_out_dtypes(fn, margs, mkwargs, device):
    """An `out=` tensor of another dtype than the op computes: eager casts into it or refuses
    (`torch.complex` and `multinomial` want their exact dtype, most ops one it can be cast to),
    a rule meta kernels skip. So the op runs on empty tensors on `device` with the given `out`
    and with an `out` of the computed dtypes: an error only the first raises is eager's answer."""
    outs = effects._flat_tensors(mkwargs.get("out"))
    if not outs:
        return
    try:
        res = effects._flat_tensors(fn(*margs, **{k: v for k, v in mkwargs.items() if k != "out"}))
    except Exception:  # noqa: BLE001 - an op of out= only: nothing to compare with
        return
    if len(res) != len(outs) or all(r.dtype == o.dtype for r, o in zip(res, outs)):
        return
    leaves = torch.utils._pytree.tree_leaves((margs, mkwargs))
    key = ("out", fn, device, tuple((v.dtype, v.dim()) if isinstance(v, torch.Tensor) else
                                    v if isinstance(v, (torch.dtype, str, bool, type(None))) else type(v)
                                    for v in leaves), tuple(r.dtype for r in res))
    if key not in _KERNEL_ERRORS:
        def probe(out_dtypes):
            empty = lambda v: torch.empty((0,) * v.dim(), dtype=v.dtype, device=device) \
                if isinstance(v, torch.Tensor) else v  # noqa: E731
            it = iter(out_dtypes)
            out = _map(mkwargs["out"], lambda o: torch.empty((0,) * o.dim(), dtype=next(it), device=device))
            try:
                fn(*_map(margs, empty), **{**_map(mkwargs, empty), "out": out})
            except Exception as e:  # noqa: BLE001 - compared below
                return f"{type(e).__name__}: {e}"
            return None
        given = probe([o.dtype for o in outs])
        _KERNEL_ERRORS[key] = given if given is not None and given != probe([r.dtype for r in res]) else None
    if _KERNEL_ERRORS[key] is not None:
        raise MetaEvalError(f"{_name(fn)}: {_KERNEL_ERRORS[key]}")


def _returns_bool(target, args) -> bool:
    try:
        return effects.returns_bool(target, args)
    except TypeError:  # an unhashable callable
        return False


def _takes_device(fn) -> bool:
    """Whether `fn` (an op of no tensor argument) takes `device=`: a factory does; `torch.div` of
    two numbers makes a CPU tensor, as eager's does, and refused the keyword."""
    schemas = getattr(fn, "_schemas", None) or (torch._C._jit_get_schemas_for_operator(f"aten::{fn.__name__}")
                                                 if getattr(fn, "__name__", None) else [])
    return not schemas or any(a.name == "device" for s in schemas for a in s.arguments)


def _name(target) -> str:
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def _map(v, f):
    if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
        return type(v)(_map(x, f) for x in v) if type(v) in (list, tuple) else [_map(x, f) for x in v]
    if isinstance(v, dict):
        return {k: _map(x, f) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(_map(v.start, f), _map(v.stop, f), _map(v.step, f))
    return f(v)


# constants a graph's code writes as themselves (`repr`), besides functions and types
_LITERALS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
             torch.memory_format, torch.Size, slice, type(Ellipsis))


def _as_node(v):
    if isinstance(v, TensorVar):
        return v.node
    if isinstance(v, SymInt):
        return v.node()
    return v


def _as_meta(v):
    if isinstance(v, TensorVar):
        return v.meta
    if isinstance(v, SymInt):
        return v.hint
    return v


def _tensor_vars(args, kwargs) -> list:
    """The distinct TensorVars among a call's arguments, in argument order."""
    found = {id(v): v for v in leaves([args, kwargs]) if isinstance(v, TensorVar)}
    return list(found.values())


def _stand_in_spec(tv: TensorVar):
    """(meta, root's meta, root identity, root is a leaf) for effects.stand_ins: the root is the
    tensor `tv` views, through the views capture recorded."""
    root = tv
    while root.view_of is not None:
        root = root.view_of[0]
    placeholder = root.node is not None and root.node.op == "placeholder"
    leaf = root.node.meta.get("is_leaf", True) if placeholder else root.meta.is_leaf
    return tv.meta, root.meta, id(root), leaf
