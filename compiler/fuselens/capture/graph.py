"""Building one FX graph: graph inputs, op nodes with meta tensors for shapes, outputs."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .values import SymInt, TensorVar, Unknown


class MetaEvalError(Exception):
    """Evaluating an op on meta tensors failed (the op is invalid, or has no meta kernel)."""


def to_meta(t: torch.Tensor) -> torch.Tensor:
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
        self.n_ops = 0
        self.lines: set[tuple[str, int]] = set()

    # -- inputs --------------------------------------------------------------------------
    def input(self, obj, source: str, loc=None) -> TensorVar:
        key = id(obj)
        tv = self._input_by_id.get(key)
        if tv is not None:
            return tv
        name = _placeholder_name(source, len(self.inputs))
        first = self._first_op()
        if first is None:
            node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_before(first):
                node = self.graph.placeholder(name)
        if obj is None or self.abstract:
            meta, device = None, None
        else:
            meta, device = to_meta(obj), obj.device
        node.meta["val"] = meta
        node.meta["device"] = device
        node.meta["source"] = source
        tv = TensorVar(node, meta, device, source=source)
        self.inputs.append((source, obj))
        self._input_by_id[key] = tv
        return tv

    def abstract_input(self, source: str) -> TensorVar:
        node = self.graph.placeholder(_placeholder_name(source, len(self.inputs)))
        node.meta["val"] = None
        self.inputs.append((source, None))
        return TensorVar(node, None, None, source=source)

    def _first_op(self):
        for n in self.graph.nodes:
            if n.op != "placeholder":
                return n
        return None

    # -- ops -------------------------------------------------------------------------------
    def call(self, target, args, kwargs, loc, *, n_outputs=None):
        """Add `target(*args, **kwargs)` to the graph. Returns a TensorVar, a tuple of them,
        or raises MetaEvalError."""
        node_args = _map(args, _as_node)
        node_kwargs = _map(kwargs, _as_node)
        device = _device_of(args, kwargs)
        if self.abstract:
            out_meta = None
        else:
            margs = _map(args, _as_meta)
            mkwargs = _map(kwargs, _as_meta)
            if "device" in mkwargs:
                device = _parse_device(mkwargs["device"]) or device
                mkwargs["device"] = "meta"
            if target in (torch.Tensor.to,) and device is not None:
                for a in list(margs[1:]) + list(mkwargs.values()):
                    d = _parse_device(a) if not isinstance(a, (torch.dtype, bool)) else None
                    if d is not None:
                        device = d
                margs = [a if _parse_device(a) is None or isinstance(a, (torch.dtype, bool, torch.Tensor))
                         else "meta" for a in margs]
            elif target is torch.Tensor.cuda:
                device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                    else torch.device("cuda")
            elif target is torch.Tensor.cpu:
                device = torch.device("cpu")
            if device is None:
                device = torch.device("cpu")
                if "device" not in mkwargs:  # a factory (torch.zeros, torch.tensor): meta, not cpu
                    mkwargs["device"] = "meta"
            fn = target if target not in (torch.Tensor.cuda, torch.Tensor.cpu) else torch.Tensor.clone
            try:
                out_meta = fn(*margs, **mkwargs)
            except Exception as e:  # the op is invalid here, or has no meta kernel
                raise MetaEvalError(f"{_name(target)}: {type(e).__name__}: {e}") from None
        node = self.graph.call_function(target, tuple(node_args), node_kwargs)
        node.meta["loc"] = loc
        node.meta["device"] = device
        self.n_ops += 1
        if loc is not None:
            self.lines.add((loc[0], loc[1]))
        if self.abstract:
            node.meta["val"] = None
            if n_outputs:
                return tuple(self._getitem(node, i, None, None, loc) for i in range(n_outputs))
            tv = TensorVar(node, None, None)
            tv.abstract_bool = getattr(target, "__name__", "").strip("_") in _BOOL_RESULTS
            return tv
        return self._wrap(node, out_meta, device, loc)

    def _wrap(self, node, out_meta, device, loc):
        if isinstance(out_meta, torch.Tensor):
            node.meta["val"] = out_meta
            return TensorVar(node, out_meta, device)
        if isinstance(out_meta, (tuple, list)) and all(isinstance(m, torch.Tensor) for m in out_meta):
            node.meta["val"] = tuple(out_meta)
            items = tuple(self._getitem(node, i, m, device, loc) for i, m in enumerate(out_meta))
            return items if isinstance(out_meta, tuple) else list(items)
        raise MetaEvalError(f"{_name(node.target)} returned {type(out_meta).__name__}, not a tensor")

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
    def output(self, values: list) -> fx.GraphModule:
        self.graph.output(tuple(_as_node(v) for v in values))
        self.graph.eliminate_dead_code()
        return fx.GraphModule(torch.nn.Module(), self.graph)


_BOOL_RESULTS = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
                 "logical_xor", "isnan", "isinf", "isfinite", "isclose", "bool", "and", "or",
                 "invert", "not"}


def _placeholder_name(source: str, i: int) -> str:
    import re
    s = re.sub(r"[^0-9a-zA-Z_]+", "_", source).strip("_")
    s = re.sub(r"^(__fl_G_|L_)", "", s)
    # a placeholder's name is its argument's name in the graph's code: a shortened one keeps
    # the input's number, or two long sources with one prefix would clash
    return (s[:32] + f"_{i}" if len(s) > 40 else s) or f"in{i}"


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
