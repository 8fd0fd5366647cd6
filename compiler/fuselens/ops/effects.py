"""What a call into torch writes, and which arguments its results alias: read from ATen.

Capture asks this module about every call into torch, whatever its spelling (`y.add_(1)`,
`torch.relu_(y)`, `torch.Tensor.add_(y, 1)`, `F.relu(y, inplace=True)`, `nn.ReLU(inplace=True)`,
`torch.add(y, 1, out=y)`, `y.squeeze_(0)`, `y[0] = 1`). The call runs on meta *stand-ins* for its
tensor arguments (fresh meta tensors with the same sizes, strides, storage sharing, leaf-ness and
requires_grad) under a dispatch mode that sees each ATen operator the call reaches:

- an argument of that operator annotated as written in its schema (`Tensor(a!)`) is a write
  into the call's argument whose stand-in shares its storage;
- an operator tagged `inplace_view` (`squeeze_`, `t_`, `transpose_`, ...) changes that
  argument's sizes and strides instead of its data;
- a result sharing storage with a stand-in is a view (or the very object) of that argument;
- ATen's own checks run, so the call raises what eager raises where eager refuses a write
  (a result dtype that cannot be cast back, a leaf or a view of a leaf that requires grad);
  the memory-overlap checks that meta kernels skip are made here from sizes and strides.

The stand-ins keep the evaluator's meta tensors untouched (an in-place op on them would change
their metadata), and the recorded operators say how to write the call without mutation
(`functional_form`): the functional overload of an in-place or `out=` operator, found from its
schema (same operator name without the trailing `_`, same arguments without the `out` ones).
"""
from __future__ import annotations

import functools
import keyword
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_INPLACE_VIEW = torch.Tag.inplace_view
_DYNAMIC_SHAPE = torch.Tag.dynamic_output_shape
_SEEDED = torch.Tag.nondeterministic_seeded


class OverlapError(RuntimeError):
    """A write eager refuses because the memory it writes is also read or written elsewhere."""


@dataclass
class Write:
    arg: int                  # index of the written tensor among the call's tensor arguments
    op: object                # the ATen OpOverload that wrote it
    metadata: bool            # inplace_view: sizes/strides changed, no data written
    whole: bool               # the operator was handed the argument itself (not a view of it)


@dataclass
class Effects:
    """What one call did, in terms of its tensor arguments (flattened in argument order)."""
    writes: list[Write] = field(default_factory=list)
    # for each tensor in the result (flattened): index of the argument it is (identity), else None
    returns_arg: list = field(default_factory=list)
    # for each tensor in the result: index of the argument whose storage it shares, else None
    aliases: list = field(default_factory=list)
    # for each tensor in the result: one of several views a single operator returned (`split`,
    # `chunk`, `unbind`): autograd refuses an in-place write into it, or into a view of it
    multi_output_views: list = field(default_factory=list)
    trace: list = field(default_factory=list)    # (OpOverload, args, kwargs) on stand-ins
    computing: list = field(default_factory=list)  # those of them that compute (_computing)
    stand_ins: list = field(default_factory=list)
    result: object = None                        # what the call returned, on stand-ins
    tensor_vars: list = field(default_factory=list)  # capture's values for the stand-ins

    @property
    def draws_random_numbers(self) -> bool:
        """An operator the call reached is tagged `nondeterministic_seeded` (bernoulli, randperm)."""
        return any(_SEEDED in op.tags for op, _, _ in self.trace)

    @property
    def written(self) -> list[int]:
        return sorted({w.arg for w in self.writes})

    def functional_form(self):
        """(functional OpOverload, args, kwargs, written arg) reproducing a call that is one ATen
        operator writing one whole argument: args hold `Arg(i)` where the stand-in of tensor
        argument i was passed. None when the call is anything else."""
        computing = self.computing
        if len(computing) != 1 or len(self.writes) != 1 or not self.writes[0].whole:
            return None
        op, args, kwargs = computing[0]
        functional = functional_overload(op)
        if functional is None:
            return None
        ids = {id(s): i for i, s in enumerate(self.stand_ins)}
        out_names = {a.name for a in op._schema.arguments if a.is_out}
        ok = True

        def sub(v):
            nonlocal ok
            if isinstance(v, torch.Tensor):
                if id(v) not in ids:
                    ok = False  # a tensor the call made itself (a wrapped scalar): not ours to name
                    return v
                return Arg(ids[id(v)])
            if isinstance(v, (list, tuple)):
                return type(v)(sub(x) for x in v)
            return v
        # tensors by position (an extern's gradient flows to its positional tensors), the rest by
        # their schema names: the backend decomposes an ATen overload with its Python binding's
        # rule, whose positions may differ (`F.log_softmax(input, dim, _stacklevel, dtype)` against
        # `log_softmax.int(self, dim, dtype)`)
        names = [a.name for a in op._schema.arguments]
        filled = [sub(a) for a in args]
        last = max([i for i, a in enumerate(args) if _flat_tensors(a)] or [0])
        # (a schema name that is a Python keyword, `uniform(self, from, to)`, no code could write)
        last = max([last] + [i for i, n in enumerate(names[:len(filled)]) if keyword.iskeyword(n)])
        fargs = tuple(filled[:last + 1])
        fkwargs = {names[i]: a for i, a in enumerate(filled) if i > last}
        fkwargs.update({k: sub(v) for k, v in kwargs.items() if k not in out_names})
        return (functional, fargs, fkwargs, self.writes[0].arg) if ok else None


@dataclass(frozen=True)
class Arg:
    """Placeholder for the call's i-th tensor argument in a functional form."""
    index: int


def functional_overload(op):
    """The out-of-place ATen overload of an in-place (`foo_.ov`) or `out=` (`foo.out`) operator,
    from its schema: the same arguments (less the `out` ones), nothing written. None if ATen
    has none."""
    schema = op._schema
    name = schema.name.split("::")[1]
    if any(a.is_out for a in schema.arguments):
        packet = getattr(torch.ops.aten, name, None)
        want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    elif name.endswith("_") and not name.endswith("__"):
        packet = getattr(torch.ops.aten, name[:-1], None)
        want = [(a.name, str(a.type)) for a in schema.arguments]
    else:
        return None
    if packet is None:
        return None
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        s = cand._schema
        if s.is_mutable or any(a.is_out for a in s.arguments):
            continue
        if [(a.name, str(a.type)) for a in s.arguments] == want:
            return cand
    return None


def aten_packet(fn):
    """The ATen operator a torch Python binding (`torch.nonzero`, `torch.Tensor.unique`) is
    generated from: bindings carry their operator's name."""
    name = getattr(fn, "__name__", None)
    return getattr(torch.ops.aten, name, None) if isinstance(name, str) and name.isidentifier() else None


def has_dynamic_output_shape(fn) -> bool:
    """Every overload of the operator behind `fn` has a data-dependent result shape."""
    packet = aten_packet(fn)
    if packet is None:
        return False
    ovs = [getattr(packet, o) for o in packet.overloads()]
    return bool(ovs) and all(_DYNAMIC_SHAPE in o.tags for o in ovs)


def returns_sequence(fn, n_args: int, kwargs) -> bool:
    """The operator behind `fn`, called with `n_args` positional arguments (self included) and
    these keyword names, returns several tensors or a list of them (`x.max(1)`, not `x.max()`):
    every overload those arguments can bind to says so in its schema."""
    packet = aten_packet(fn)
    if packet is None:
        return False
    fits = []
    for ov in packet.overloads():
        sch = getattr(packet, ov)._schema
        if any(a.is_out for a in sch.arguments) or not sch.returns:
            continue
        positional = [a for a in sch.arguments if not a.kwarg_only]
        names = {a.name for a in sch.arguments}
        required = [a for a in sch.arguments if not a.has_default_value()]
        if n_args <= len(positional) and set(kwargs) <= names and \
                all(i < n_args or a.name in kwargs for i, a in enumerate(required)):
            fits.append(sch)
    return bool(fits) and all(len(s.returns) > 1 or str(s.returns[0].type).endswith("[]") for s in fits)


@functools.lru_cache(maxsize=None)
def returns_bool(fn, args: tuple) -> bool:
    """`fn(*args)` gives a bool tensor (comparisons, `isnan`, `&` of bools), where a `torch.dtype`
    in args stands for a tensor of that dtype: asked of torch by running it on empty tensors
    (not meta ones: a meta kernel written in Python imports torch._dynamo at its first call,
    ~2 s before the editor's first diagnostics). For the editor, which knows no shapes."""
    try:
        with warnings.catch_warnings():  # torch's notes on the user's code are not this question's
            warnings.simplefilter("ignore")
            out = fn(*[torch.empty(0, dtype=a) if isinstance(a, torch.dtype) else a
                       for a in args])
    except Exception:  # noqa: BLE001 (these arguments do not fit it: not known to be bool)
        return False
    return isinstance(out, torch.Tensor) and out.dtype == torch.bool


def failed_on_dynamic_shape(trace) -> bool:
    """The call failed in an operator whose result's shape depends on the data (`nonzero`)."""
    return bool(trace) and _DYNAMIC_SHAPE in trace[-1][0].tags


# -- running a call on stand-ins -------------------------------------------------------------------
class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls, self.results = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        out = func(*args, **kwargs)
        self.results.append(out)
        return out


def stand_ins(args):
    """Fresh meta tensors for the call's tensor arguments, each given as (meta, root_meta,
    root_key, root_leaf): arguments with the same `root_key` (the tensor they are views of, whose
    meta is `root_meta`) share one storage, at their own sizes, strides and offsets. `root_leaf`
    says whether that tensor is a leaf: autograd refuses writes into a leaf that requires grad
    and into views of it, so the stand-ins are leaves and views of leaves too."""
    out, storage = [], {}
    for m, root_meta, key, root_leaf in args:
        if key not in storage:
            n = max(_extent(mm) for mm, _, k, _ in list(args) + [(root_meta, None, key, None)] if k == key)
            if root_meta.requires_grad and root_leaf:
                raw = torch.empty(n, dtype=root_meta.dtype, device="meta")
                root = raw.as_strided(root_meta.size(), root_meta.stride(),
                                      root_meta.storage_offset()).requires_grad_()
            elif root_meta.requires_grad:  # a non-leaf: it and its views may be written
                raw = torch.empty(n, dtype=root_meta.dtype, device="meta", requires_grad=True).clone()
                root = None
            else:
                raw, root = torch.empty(n, dtype=root_meta.dtype, device="meta"), None
            storage[key] = (raw, root)
        raw, root = storage[key]
        if m.dtype != raw.dtype:  # a dtype view (`x.view(torch.int32)`, `view_as_complex`): its own storage,
            # requiring grad as the view does (a non-leaf: it may be written)
            s = torch.empty(_extent(m), dtype=m.dtype, device="meta", requires_grad=m.requires_grad)
            s = (s.clone() if m.requires_grad else s).as_strided(m.size(), m.stride(), m.storage_offset())
        elif root is not None:  # the leaf itself, or a view of it
            s = root if m is root_meta else root.as_strided(m.size(), m.stride(), m.storage_offset())
        else:
            s = raw.as_strided(m.size(), m.stride(), m.storage_offset())
        if s.requires_grad and not m.requires_grad:
            s = s.detach()
        out.append(s)
    return out


def _extent(m) -> int:
    if m.numel() == 0:
        return m.storage_offset()
    return m.storage_offset() + sum((n - 1) * s for n, s in zip(m.size(), m.stride())) + 1


def run(fn, args, kwargs, tensors: list[torch.Tensor]):
    """Run `fn(*args, **kwargs)`, where the meta tensors in `tensors` are the call's stand-ins
    (already placed in args/kwargs), recording the ATen operators. Returns (result, Effects).
    Raises what the call raises, and OverlapError where eager would refuse the memory a write
    shares."""
    rec = _Recorder()
    before = [(t.size(), t.stride()) for t in tensors]  # (an `out=` is checked as it was, not as resized)
    try:
        with rec:
            result = fn(*args, **kwargs)
    except Exception as e:
        e.fl_dynamic_shape = failed_on_dynamic_shape(rec.calls)
        raise
    result = _returned(result, kwargs.get("out"))
    eff = Effects(trace=rec.calls, computing=_computing(rec.calls, rec.results, result), stand_ins=list(tensors),
                  result=result)
    storages = [_storage_key(t) for t in tensors]
    for op, a, k in rec.calls:
        schema = _WRITES_ANNOTATED.get(op, op)._schema
        if op in _WRITES_ANNOTATED and not _bind(schema, a, k)[5]:
            continue  # native_batch_norm writes its running statistics only when training
        for arg, val in zip(schema.arguments, _bind(schema, a, k)):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            for w in (val if isinstance(val, (list, tuple)) else (val,)):
                if not isinstance(w, torch.Tensor):
                    continue
                idx = _which(w, tensors, storages)
                if idx is None:
                    continue  # a tensor the call made itself
                metadata = _INPLACE_VIEW in op.tags
                if not metadata:
                    _check_overlap(op, w, a, k, before[idx])
                eff.writes.append(Write(idx, op, metadata, any(w is t for t in tensors)))
    # torch's Python API writes every `out=` tensor, whatever operators that took below the
    # dispatcher (linalg.matrix_rank's out= shows none)
    for w in _flat_tensors(kwargs.get("out")):
        idx = _which(w, tensors, storages)
        if idx is not None and not any(x.arg == idx for x in eff.writes):
            eff.writes.append(Write(idx, None, False, True))
    for r in _flat_tensors(result):
        eff.returns_arg.append(next((i for i, t in enumerate(tensors) if r is t), None))
        key = _storage_key(r)
        eff.aliases.append(next((i for i, s in enumerate(storages) if s == key), None))
        eff.multi_output_views.append(r._is_view() and _creation_meta(r) == _MULTI_OUTPUT_NODE)
    return result, eff


# how autograd made a view: asked of it, not read from schemas (`chunk` is one operator of
# several views, `tensor_split` several operators of one view each)
_creation_meta = torch._C._autograd._get_creation_meta
_MULTI_OUTPUT_NODE = torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE


# ATen operators whose schema leaves out what they write, with the operator of the same
# arguments whose schema says it (PyTorch's own functionalization treats them the same way)
_WRITES_ANNOTATED = {torch.ops.aten.native_batch_norm.default: torch.ops.aten._native_batch_norm_legit.default}


def _only_aliases(op) -> bool:
    """An operator that computes nothing: every result aliases an argument (`detach`, views)."""
    rets = op._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _computing(calls, results, result) -> list:
    """The calls (of a trace) that compute: less autograd's aliases (`detach`) and its copy of an
    argument that an in-place op's derivative reads as it was (`mul_`, `silu_`: saved for the
    backward, read by no operator of the call and not returned)."""
    read = {id(t) for _, a, k in calls for t in _flat_tensors([a, list(k.values())])} | \
        {id(t) for t in _flat_tensors(result)}
    return [c for c, r in zip(calls, results) if not _only_aliases(c[0]) and (
        _writes(c[0]) or any(id(t) in read for t in _flat_tensors(r)))]


def _writes(op) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _bind(schema, args, kwargs):
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out.append(args[i])
        else:
            out.append(kwargs.get(a.name))
    return out


def _which(w, tensors, storages):
    for i, t in enumerate(tensors):
        if w is t:
            return i
    key = _storage_key(w)
    for i, s in enumerate(storages):
        if s == key:
            return i
    return None


def _storage_key(t):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _flat_tensors(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _flat_tensors(x)]
    return []


def _returned(result, out):
    """What a call given `out=` returns: torch's Python API returns the `out=` tensors themselves;
    some meta paths return other tensors of the same values (linalg.matrix_rank), which the real
    run does not."""
    outs = _flat_tensors(out)
    if outs and len(_flat_tensors(result)) == len(outs):
        return _refill(result, iter(outs))
    return result


def _refill(v, it):
    """`v` with its tensors replaced, in order, by those of `it` (a named tuple keeps its type)."""
    if isinstance(v, torch.Tensor):
        return next(it)
    if isinstance(v, (list, tuple)):
        items = [_refill(x, it) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)  # structseqs take a list
    return v


def _byte_range(t):
    if t.numel() == 0:
        return None
    start = t.storage_offset()
    return start, start + sum((n - 1) * s for n, s in zip(t.size(), t.stride())) + 1


def _check_overlap(op, written, args, kwargs, layout):
    """ATen's TensorIterator checks, which meta kernels skip: a written tensor may not have
    elements that share memory (checked in its `layout` before the call: an `out=` is resized
    after), nor partially overlap a tensor the same operator reads."""
    if any(s == 0 and n > 1 for n, s in zip(*layout)):
        raise OverlapError("unsupported operation: more than one element of the written-to tensor "
                           "refers to a single memory location. Please clone() the tensor before "
                           "performing the operation.")
    wr = _byte_range(written)
    key = _storage_key(written)
    for other in _flat_tensors(list(args) + list(kwargs.values())):
        if other is written or _storage_key(other) != key:
            continue
        orange = _byte_range(other)
        if wr is None or orange is None or orange == wr and other.stride() == written.stride():
            continue
        if orange[0] < wr[1] and wr[0] < orange[1]:
            raise OverlapError("unsupported operation: some elements of the input tensor and the "
                               "written-to tensor refer to a single memory location. Please clone() "
                               "the tensor before performing the operation.")


class OnCopies:
    """`fn(*args, **kwargs)` run on copies of the tensor arguments it writes (their indices among
    its distinct tensor arguments, in argument order): returns the copies, now the written
    values, then the tensors of its result that are none of them. The graph form of a write that
    has no functional ATen overload (`F.dropout(inplace=True)`, BatchNorm's running statistics,
    an `out=` that resizes)."""

    def __init__(self, fn, written: tuple):
        self.fn, self.written = fn, written
        self.__name__ = self.__qualname__ = f"{getattr(fn, '__name__', 'call')}_on_copies"

    def __call__(self, *args, **kwargs):
        distinct = []
        for t in _flat_tensors(list(args) + list(kwargs.values())):
            if not any(t is d for d in distinct):
                distinct.append(t)
        copies = {id(distinct[i]): distinct[i].clone() for i in self.written}

        def sub(v):
            if isinstance(v, torch.Tensor):
                return copies.get(id(v), v)
            if isinstance(v, (list, tuple)):
                return type(v)(sub(x) for x in v)
            return v
        kwargs = {k: sub(v) for k, v in kwargs.items()}
        result = _returned(self.fn(*[sub(a) for a in args], **kwargs), kwargs.get("out"))
        written = tuple(copies[id(distinct[i])] for i in self.written)
        return written + tuple(t for t in _flat_tensors(result) if not any(t is w for w in written))

    def __repr__(self):
        return self.__name__

    def __eq__(self, other):  # a value: equal calls of it are remembered as one (capture/meta_memo.py)
        return type(other) is OnCopies and (self.fn, self.written) == (other.fn, other.written)

    def __hash__(self):
        return hash((OnCopies, self.fn, self.written))


class _UnrecordedWrite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, v):
        return v.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def unrecorded_write(t, v):
    """`t` after a write that autograd does not record (in place under no_grad, or through a
    detached alias): the values `v`, with t's gradient path, as eager leaves t's history as it was
    (its gradient reaches t's inputs through every element, those written included)."""
    return _UnrecordedWrite.apply(t, v)


def no_grad_view(t):
    """A view taken under no_grad of a tensor that requires grad, as eager has it: it requires
    grad, as a leaf whose gradient reaches nothing (`with no_grad(): c = x[0]`, then `c * 2` has a
    grad_fn and its backward leaves x.grad None). Capture holds it detached (what no_grad computes
    from it records nothing) and reads it through this in grad mode. An alias autograd does not
    track, not one of eager's no-grad views: the graph runs in grad mode, where eager's checks on
    those would refuse the functional form of a write made under no_grad (capture itself refuses
    what eager refuses)."""
    return t.detach().requires_grad_()


@functools.lru_cache(maxsize=None)
def tensor_property(name: str):
    """A tensor-valued property of torch.Tensor (`H`, `mH`, `real`) as a function, for the graph."""
    def get(t):
        return getattr(t, name)
    get.__name__ = get.__qualname__ = f"tensor_{name}"
    return get
