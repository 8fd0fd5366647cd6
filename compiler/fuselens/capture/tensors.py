"""Calls into torch: tensor attributes and methods, torch functions recorded as graph ops (`op`),
in-place writes functionalized from the ops' schemas (`functionalize`, `rebind`: the base and
every live view get the new value), autocast."""
from __future__ import annotations

import inspect
import operator
import types

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch._library.custom_ops import CustomOpDef as _CustomOpDef

from . import breaks as B
from ..ops import effects as E
from . import autocast as AC
from . import bounds
from . import calls as C
from .guards import SRC
from .graph import MetaEvalError, _map
from .symbolic import SymbolicShapes
from .values import NUMPY_SCALARS, UNKNOWN, SymInt, SymShape, TensorVar, leaves, torch_number
from .frames import AbstractSeq


# torch's questions about autocast: answered from the walk's state (`autocast_state`), not by torch,
# whose answer would be the caller's (capture enters none of torch's autocast blocks):
# fn -> (the device type it asks about where the call names none, 0: enabled / 1: dtype)
AUTOCAST_QUERIES = {fn: how for name, how in (("is_autocast_enabled", ("cuda", 0)), ("get_autocast_dtype", (None, 1)),
                                              ("is_autocast_cpu_enabled", ("cpu", 0)),
                                              ("get_autocast_cpu_dtype", ("cpu", 1)),
                                              ("get_autocast_gpu_dtype", ("cuda", 1)))
                    if (fn := getattr(torch, name, None)) is not None}


def _memory_all_its_own(t: TensorVar) -> bool:
    """Whether what `as_strided` may read of `t` is `t`'s own elements: a graph input's view (the
    caller's memory itself), or a computed value whose eager memory it fills, densely from the
    start (Longformer's chunked query: a view of a reshape)."""
    root = t
    while root.view_of is not None:
        root = root.view_of[0]
    if root.source is not None:
        return True
    m = t.meta
    dims = sorted((d for d in range(m.dim()) if m.shape[d] != 1), key=lambda d: m.stride()[d])
    expected = 1
    for d in dims:
        if m.stride()[d] != expected:
            return False
        expected *= m.shape[d]
    return m.storage_offset() == 0 and m.untyped_storage().nbytes() == m.numel() * m.element_size()


def _python_numbers(v) -> bool:
    """Whether the leaves of `v` are Python numbers (or tensors made of them: TensorVar.number),
    strings and None, one number at least."""
    values = list(leaves(v))
    if any(isinstance(x, TensorVar) and x.number is None for x in values):
        return False
    values = [x.number if isinstance(x, TensorVar) else x for x in values]
    return any(type(x) in (int, bool) for x in values) and \
        all(type(x) in (int, float, bool, str) or x is None for x in values)


class Tensors:
    """Mixin of `Evaluator` (evaluator.py)."""

    def input(self, t: torch.Tensor, src: str) -> TensorVar:
        """A tensor from outside the graph: a graph input (domains.py)."""
        return self.domain.input(self, t, src)

    def tensor_attr(self, t: TensorVar, attr, e, scope):
        if attr in C.META_ATTRS:
            if t.meta is None:
                return UNKNOWN
            if attr == "shape":
                return self.sizes(t)
            if attr == "ndim":
                return t.meta.dim()
            if attr == "device":
                return t.device
            return getattr(t.meta, attr)
        if attr == "T":
            return self.op(torch.Tensor.permute, [t, list(range(t.meta.dim()))[::-1]] if t.meta is not None
                           else [t, 1, 0], {}, e, scope)
        if attr == "mT":
            return self.op(torch.Tensor.transpose, [t, -2, -1], {}, e, scope)
        if attr == "data":
            return self.op(torch.Tensor.detach, [t], {}, e, scope)
        if attr in ("real", "imag"):  # (views of a complex tensor: aliasing by their schemas, as any op's)
            return self.op(getattr(torch, attr), [t], {}, e, scope)
        if attr == "grad":
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"Tensor.{attr}")
        if attr.startswith("is_") and isinstance(inspect.getattr_static(torch.Tensor, attr, None),
                                                 types.GetSetDescriptorType):
            # a flag of the tensor's kind (`is_nested`, `is_sparse`, `is_cpu`...): what an empty
            # tensor of its dtype on its device says (the meta tensor would say `is_meta`)
            if t.meta is None:
                return UNKNOWN
            return getattr(torch.empty(0, dtype=t.meta.dtype, device=t.device), attr)
        if isinstance(inspect.getattr_static(torch.Tensor, attr, None), types.GetSetDescriptorType) \
                and not callable(getattr(torch.Tensor, attr, None)):
            return self.op(E.tensor_property(attr), [t], {}, e, scope)  # `x.H`, `x.mH`, `x.real`...
        # a method: bound lazily
        return TensorMethod(t, attr)

    def sizes(self, t: TensorVar):
        """`t.shape` as a tuple of ints, with SymInts for its sizes that follow dynamic dims of the
        graph's inputs (an input's own dims; an intermediate's, from the symbolic run)."""
        shape = tuple(t.meta.shape)
        src = t.source
        if src is None and self.dynamic:
            return self._intermediate_sizes(t, shape)
        dyn = self.dynamic.get(src, ()) if src is not None else ()
        if not dyn:
            return torch.Size(shape)
        out = []
        for d, n in enumerate(shape):
            if d in dyn:
                out.append(SymInt(n, f"{src}.shape[{d}]",
                                  lambda d=d: self.g.sym_node(torch.ops.aten.sym_size.int, (t, d), shape[d])))
            else:
                out.append(n)
        return SymShape(out)

    def _symbolic(self) -> SymbolicShapes | None:
        """The symbolic run of the graph's sizes, where an input has dynamic dims."""
        if self.symbolic is None and self.dynamic and any(self.dynamic.get(s) for s, _ in self.g.inputs):
            self.symbolic = SymbolicShapes(self.g, self.dynamic)
        return self.symbolic

    def _intermediate_sizes(self, t: TensorVar, shape):
        if self._symbolic() is None:
            return torch.Size(shape)
        sym = self.symbolic.sizes(t.node, shape) if t.node is not None else None
        if sym is None:
            self.pin_dynamic("an intermediate's size is read, of no symbolic shape")
            return torch.Size(shape)
        if all(isinstance(d, int) for d in sym):
            return torch.Size(shape)
        return SymShape(n if isinstance(d, int) else
                        SymInt(n, d[1], lambda d=i: self.g.sym_node(torch.ops.aten.sym_size.int, (t, d), shape[d]))
                        for i, (n, d) in enumerate(zip(shape, sym)))

    def guard_symbolic(self):
        """Guard what the symbolic run's shape rules assumed of the dynamic dims (the intermediates'
        size expressions hold where these do); one no guard spells pins the dims."""
        if self.symbolic is None:
            return
        for text, why in self.symbolic.guards():
            if text is None:
                self.pin_dynamic(why)
            else:
                self.sources.guard(text, f"{text[1:-1] if text.startswith('(') else text}: {why}")

    def strides(self, t: TensorVar, dim=None):
        """`t.stride()`: where they follow dynamic dims, this call's strides, guarded (the graph
        has no node for a stride: capture's uses of one are few, a size's are many)."""
        strides = t.meta.stride()
        if self._symbolic() is not None:
            sym = self.symbolic.strides(t.node, strides) if t.node is not None else None
            if sym is None or not all(isinstance(d, int) for d in sym):
                self.pin_dynamic("a stride is read", strides=True)
        return strides if dim is None else strides[dim]

    def pin_dynamic(self, why: str, strides=False):
        """Guard every dynamic dim of the graph's inputs on this call's size (`strides`: and each
        such input's strides): what capture knows of a size only as a number (a meta shape) is
        baked into the graph."""
        for s, obj in self.g.inputs:
            dims = self.dynamic.get(s, ())
            for d in dims:
                if isinstance(obj, torch.Tensor) and d < obj.dim():
                    self.sources.guard(f"{SRC}.shape[{d}] == {obj.shape[d]}", f"{s}.shape[{d}] ({why})", s)
            if strides and dims and isinstance(obj, torch.Tensor):
                self.sources.guard(f"{SRC}.stride() == {tuple(obj.stride())}", f"{s}.stride() ({why})", s)

    # ----------------------------------------------------------------- tensor ops
    def torch_call(self, fn, args, kwargs, e, scope):
        if isinstance(fn, _CustomOpDef):  # `@torch.library.custom_op`: a call of its operator
            fn = fn._opoverload
        if self.abstract and E.has_dynamic_output_shape(fn) and any(isinstance(a, TensorVar) for a in args):
            self.brk(B.DYNAMIC_SHAPE, e, scope, detail=name_of(fn))
        if fn in (torch.is_tensor,):
            return isinstance(args[0], TensorVar)
        name = getattr(fn, "__name__", None)
        if name in C.META_METHODS and getattr(torch, name, None) is fn and args and isinstance(args[0], TensorVar):
            # `torch.is_floating_point(t)`, `torch.numel(t)`: the method's question, answered so
            return self.tensor_method(args[0], name, list(args[1:]), kwargs, e, scope)
        hashable = type(fn).__hash__ is not None  # (an object of torch's Python may not be)
        if hashable and fn in C.STATE_QUERIES:
            return fn(*args)
        if hashable and fn in AUTOCAST_QUERIES:
            default, answer = AUTOCAST_QUERIES[fn]
            return self.autocast_state(args[0] if args else kwargs.get("device_type", default))[answer]
        if self.abstract and not args and not kwargs:
            return UNKNOWN  # a query of the process's state (`_get_deterministic_algorithms()`)
        if fn is torch.Size:
            return torch.Size(args[0])
        return self.op(fn, args, kwargs, e, scope)

    def tensor_method(self, t: TensorVar, name, args, kwargs, e, scope):
        if name in C.DATA_READS:
            self.brk(C.DATA_READS[name], e, scope, detail=f"Tensor.{name}()")
        if self.abstract and E.has_dynamic_output_shape(getattr(torch.Tensor, name, None)):
            self.brk(B.DYNAMIC_SHAPE, e, scope, detail=f"Tensor.{name}()")
        if name in C.META_METHODS:
            if t.meta is None:
                return UNKNOWN
            if name == "size":
                s = self.sizes(t)
                return s if not args and "dim" not in kwargs else s[args[0] if args else kwargs["dim"]]
            if name == "dim" or name == "ndimension":
                return t.meta.dim()
            if name in ("numel", "nelement"):
                s = self.sizes(t)
                n = 1
                for d in s:
                    n = self.sym_arith(operator.mul, [n, d], e, scope) if isinstance(d, SymInt) \
                        or isinstance(n, SymInt) else n * d
                return n
            if name == "stride":
                return self.strides(t, *args, **kwargs)
            if name == "get_device":
                return -1 if t.device.type == "cpu" else t.device.index
            return getattr(t.meta, name)(*args, **kwargs)
        if name == "backward":
            self.brk(B.BACKWARD, e, scope, detail="Tensor.backward()", whole_stmt=True)
        if name in ("register_hook", "retain_grad", "requires_grad_", "share_memory_",
                    "resize_", "set_", "storage", "untyped_storage", "__array__", "data_ptr"):
            self.brk(B.UNSUPPORTED_EXPR, e, scope, detail=f"Tensor.{name}()", whole_stmt=True)
        if name in ("__bool__", "__int__", "__float__", "__index__"):
            self.brk(B.TENSOR_TO_PY, e, scope, detail=f"Tensor.{name}()")
        method = getattr(torch.Tensor, name, None)
        if method is None:
            raise AttributeError(f"'Tensor' object has no attribute '{name}'")
        return self.op(method, [t] + list(args), kwargs, e, scope)

    def op(self, fn, args, kwargs, e, scope):
        """Record `fn(*args, **kwargs)` on tensors into the graph. What the call writes and which
        arguments its results view come from ATen's schemas (ops/effects.py), whatever its
        spelling; a call that writes is functionalized (`functionalize`)."""
        # views taken under no_grad of tensors that require grad, read here in grad mode (one scan)
        no_grad_views = [a.node.meta for a in leaves([args, kwargs]) if isinstance(a, TensorVar) and
                         a.node is not None and a.node.meta.get("no_grad_view")] \
            if self.grad_enabled and not self.deriving_views else ()
        if any(m.get("no_grad_view_written") for m in no_grad_views):
            # eager refuses; capture stops, the eager run it falls back to raises that
            raise RuntimeError("a view created in no_grad mode is used in grad mode after a write into its base")
        if not self.abstract and any(on for _, on, _ in self.autocast):
            cast = self.autocast_args(fn, args, kwargs, e, scope)
            if cast is None:  # torch's Python that autocast runs in several dtypes: its calls one by one
                return self.inline(fn, args, kwargs, e, scope)
            if isinstance(cast, AC.AtenCalls):
                return self.replay(cast, args, kwargs, e, scope)
            args, kwargs = cast
        if isinstance(kwargs.get("dtype"), type):  # `dtype=int` (torch reads Python's types): the torch dtype,
            # which a graph's code can name
            kwargs = {**kwargs, "dtype": torch.empty(0, dtype=kwargs["dtype"]).dtype}
        if fn in (torch.as_strided, torch.Tensor.as_strided) and args and isinstance(args[0], TensorVar) \
                and not self.abstract and not _memory_all_its_own(args[0]):
            # as_strided reads memory: a computed value's is the backend's (lower_extern gives it
            # a buffer of eager's layout), unless eager's memory holds more than the value
            self.brk(B.UNSUPPORTED_OP, e, scope, detail="as_strided of a computed view of a larger tensor: its "
                     "memory is read, as eager lays it out")
        if fn is torch.from_numpy:  # (torch.tensor(array) copies it: a constant of the graph, read each run)
            self.brk(B.UNKNOWN_CALL, e, scope, detail="torch.from_numpy: the tensor shares the array's memory, "
                     "made in Python")
        try:
            if _has_numpy((args, kwargs)):
                args, kwargs = self.numbers_for_torch(fn, args, kwargs)
            out_meta, device, eff = self.g.evaluate(fn, args, kwargs)
            if eff is not None and eff.writes:
                return self.functionalize(fn, args, kwargs, eff, e, scope, out_meta, device)
            if no_grad_views:
                args, kwargs = self.grad_leaves(args, e, scope), self.grad_leaves(kwargs, e, scope)
                out_meta, device, eff = self.g.evaluate(fn, args, kwargs)
            r = self.g.add(fn, args, kwargs, self.user_loc(e, scope), out_meta, device,
                           aten=None if eff is None else tuple(op for op, _, _ in eff.trace))
        except MetaEvalError as err:
            if any(isinstance(a, TensorVar) and a.number is not None for a in leaves([args, kwargs])):
                # a tensor of Python numbers alone where the op needs a number (a size of
                # `view`, `new_zeros`: eager calls its __index__): its value, as eager reads it
                number = lambda a: a.number if isinstance(a, TensorVar) and a.number is not None else a  # noqa: E731
                return self.op(fn, _map(args, number), _map(kwargs, number), e, scope)
            if getattr(err, "not_a_tensor", False) and isinstance(fn, types.FunctionType):
                # torch's Python code answering a question (`_check_arg_device(x)`): interpreted
                return self.inline(fn, args, kwargs, e, scope)
            self.brk(B.DYNAMIC_SHAPE if err.dynamic_shape else B.UNSUPPORTED_OP, e, scope,
                     detail=name_of(fn) if err.dynamic_shape else str(err)[:300])
        if isinstance(r, TensorVar):
            r.bounds = bounds.of_result(fn, r.meta.dtype if r.meta is not None else None)
            r.known = bounds.decided(fn, args)
            if not self.abstract and r.meta.numel() == 1 and not r.meta.dtype.is_floating_point \
                    and r.device.type == "cpu" and _python_numbers((args, kwargs)):
                real = lambda a: torch.tensor(a.number, dtype=a.meta.dtype).reshape(a.meta.shape) \
                    if isinstance(a, TensorVar) else a  # noqa: E731
                r.number = fn(*_map(args, real), **_map(kwargs, real)).item()
        if self.abstract:
            if E.returns_sequence(fn, len(args), kwargs):
                return AbstractSeq()
            return r
        outs = r if isinstance(r, (tuple, list)) else (r,)
        tvs = eff.tensor_vars
        for i, o in enumerate(outs):
            if not isinstance(o, TensorVar):
                continue
            if eff.returns_arg[i] is not None and o is r:
                return tvs[eff.returns_arg[i]]  # `x.float()` of a float tensor, `.contiguous()`...: x itself
            a = eff.aliases[i]
            if a is not None and args and tvs[a] is args[0]:
                o.view_of = (args[0], fn, tuple(args[1:]), dict(kwargs), i if o is not r else None)
            if eff.multi_output_views[i]:
                o.node.meta["multi_output_view"] = True
        if not self.grad_enabled and isinstance(r, TensorVar) and any(
                isinstance(a, TensorVar) and a.meta.requires_grad for a in list(args) + list(kwargs.values())):
            # the graph runs with grad mode on: results computed under no_grad are detached
            d = self._detached(r, self.user_loc(e, scope))
            if r.view_of is not None and r.view_of[1] not in _DETACH and r.view_of[0].meta.requires_grad:
                # a view: eager's still requires grad (grad_leaves), a write into it in grad mode raises
                d.node.meta["no_grad_view"] = True
            r = d
        elif not self.grad_enabled and isinstance(r, TensorVar) and r.view_of is not None and \
                r.view_of[1] not in _DETACH and r.view_of[0].node is not None and \
                r.view_of[0].node.meta.get("no_grad_view"):
            r.node.meta["no_grad_view"] = True  # a view of one, so is it
        return r

    def numbers_for_torch(self, fn, args, kwargs):
        """`args` and `kwargs` with each NumPy scalar the number torch reads it as
        (values.torch_number), so that the graph computes with eager's numbers. A tensor made
        from NumPy data (`torch.tensor(np.float64(0.1))`) keeps the dtype NumPy's gives it, now
        written out. (A np.bool_ where torch takes a bool is eager's TypeError: as a float, the
        call is refused here too, and runs in Python.)"""
        if fn in _FROM_DATA and "dtype" not in kwargs and not self.abstract:
            kwargs = dict(kwargs, dtype=self.g.evaluate(fn, args, kwargs)[0].dtype)
        return _numbers((args, kwargs))

    def grad_leaves(self, v, e, scope):
        """`v` with each view taken under no_grad of a tensor that requires grad read as eager
        has it in grad mode: requiring grad, its gradient reaching nothing (E.no_grad_view)."""
        if isinstance(v, TensorVar) and v.node is not None and v.node.meta.get("no_grad_view"):
            leaf = self.g.call(E.no_grad_view, [v], {}, self.user_loc(e, scope))
            leaf.view_of = (v, E.no_grad_view, (), {}, None)  # an alias: writes through its views reach v's base
            return leaf
        if isinstance(v, dict):
            return {k: self.grad_leaves(x, e, scope) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(self.grad_leaves(x, e, scope) for x in v)
        return v

    def _detached(self, r, loc):
        d = self.g.call(torch.Tensor.detach, [r], {}, loc)
        d.view_of = (r, torch.Tensor.detach, (), {}, None)
        return d

    def functionalize(self, fn, args, kwargs, eff, e, scope, out_meta, device):
        """A call that writes into tensor arguments, as out-of-place graph ops: each written
        argument gets its new value (`rebind` writes it back into the tensor it views and
        derives that tensor's other live views again), and the call returns what it returned
        in eager (the written argument, as it is now)."""
        tvs, loc = eff.tensor_vars, self.user_loc(e, scope)
        form = eff.functional_form()
        if any(w.metadata for w in eff.writes):  # squeeze_, t_, transpose_...: a new view
            t = tvs[eff.writes[0].arg]
            if form is None or len(eff.writes) != 1 or self.reaches_caller(t, scope):
                self.brk(B.INPLACE_VIEW, e, scope, whole_stmt=True,
                         detail=f"`{name_of(fn)}` changes the shape of a tensor the caller holds")
            new = self.op(form[0], *self.fill_args(form, tvs), e, scope)
            self._replace(t, new, scope)
            return new
        news = {}
        if form is not None and not has_symint([args, kwargs]):
            k = form[3]
            new = self.op(form[0], *self.fill_args(form, tvs), e, scope)
            if isinstance(new, TensorVar) and new.node is not None and new.node.target is form[0] and \
                    new.node.args[:1] == (tvs[k].node,):
                new.node.meta["in_place"] = True  # eager wrote its first argument (autograd/facts.py)
            if isinstance(new, TensorVar) and new.meta.shape == tvs[k].meta.shape:
                if not torch.can_cast(new.meta.dtype, tvs[k].meta.dtype):
                    # eager refuses (`logit_` of an int tensor): Python runs it and raises that
                    self.brk(B.UNSUPPORTED_OP, e, scope, whole_stmt=True, detail=(
                        f"result type {new.meta.dtype} can't be cast to {tvs[k].meta.dtype}"))
                if new.meta.dtype != tvs[k].meta.dtype:  # in-place results keep the tensor's dtype
                    new = self.op(torch.Tensor.to, [new, tvs[k].meta.dtype], {}, e, scope)
                news[k] = new
        fresh = []  # tensors of the result that are no argument (BatchNorm's output)
        if not news:  # any other write: the call itself, run on copies of what it writes
            written = eff.written
            out = self.g.add_on_copies(fn, eff, args, kwargs, loc, out_meta, device)
            news = dict(zip(written, out))
            fresh = list(out[len(written):])
            if not self.grad_enabled and any(t.meta.requires_grad for t in tvs):
                fresh = [self._detached(f, loc) for f in fresh]  # (as `op` detaches its results)
        for k, new in news.items():
            t = tvs[k]
            if new is t:  # an identity on these values: nothing changes
                continue
            self.rebind(t, new, scope, e)
        if len(fresh) != eff.returns_arg.count(None):
            self.brk(B.UNSUPPORTED_OP, e, scope, whole_stmt=True,
                     detail=f"`{name_of(fn)}` writes into an argument and returns a new tensor")
        fresh = iter(fresh)
        results = [self.tensor_writes.latest(tvs[k]) if k is not None else next(fresh) for k in eff.returns_arg]
        if isinstance(eff.result, torch.Tensor):
            return results[0]
        if isinstance(eff.result, (tuple, list)) and len(results) == len(eff.result):
            return type(eff.result)(results)  # a tuple, list or named tuple (torch.return_types)
        return None

    def fill_args(self, form, tvs):
        """A functional form's (args, kwargs), its argument placeholders filled with TensorVars."""
        def fill(v):
            if isinstance(v, E.Arg):
                return tvs[v.index]
            if isinstance(v, (list, tuple)):
                return type(v)(fill(x) for x in v)
            return v
        return [fill(a) for a in form[1]], {k: fill(v) for k, v in form[2].items()}

    def reaches_caller(self, t: TensorVar, scope) -> bool:
        """`t` is (a view of) a graph input: a change of its metadata would have to reach the
        caller's tensor object."""
        while t is not None:
            if t.source is not None:
                return True
            t = t.view_of[0] if t.view_of is not None else None
        return False

    def autocast_state(self, device_type) -> tuple:
        """(enabled, dtype) of autocast on `device_type` where the walk is: the innermost
        `with torch.autocast` for it, else the caller's (guarded). Device types capture does not
        model (xpu, mps) answer as torch does; those autocast has no key for (meta) as off."""
        if not torch.amp.is_autocast_available(device_type):
            return False, None
        for d, on, dtype in reversed(self.autocast):
            if d == device_type:
                return on, dtype
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)

    def autocast_args(self, fn, args, kwargs, e, scope):
        """The arguments as autocast hands them to `fn`: the graph has no autocast, so capture
        casts them (what to, torch's autocast answers: capture/autocast.py). None: `fn` is a
        Python function to interpret instead."""
        devices = {a.device.type for a in tree_leaves((args, kwargs)) if isinstance(a, TensorVar) and a.meta is not None}
        if not devices:
            return args, kwargs
        # (ATen's autocast key is the tensors' device's; a CPU scalar tensor beside a GPU's is not it)
        device_type = next((d for d in sorted(devices) if d != "cpu"), "cpu")
        on, dtype = self.autocast_state(device_type)
        if not on:
            return args, kwargs
        target = AC.cast_to(fn, args, kwargs, device_type, dtype)
        if isinstance(target, AC.AtenCalls):
            if not any(isinstance(v, SymInt) for v in tree_leaves((args, kwargs))):
                return target
            target = AC.REFUSED  # (its steps' sizes are the hints: the call runs in Python)
        if target is AC.REFUSED:
            if isinstance(fn, types.FunctionType):
                return None
            self.brk(B.UNSUPPORTED_OP, e, scope, detail=(
                f"`{name_of(fn)}` under autocast raises, or computes in several dtypes: it runs in Python"))
        if target is None:
            return args, kwargs

        def cast(a):
            if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
                return type(a)(cast(x) for x in a)
            if isinstance(a, TensorVar) and a.meta is not None and a.meta.dtype in AC.CASTS \
                    and a.meta.dtype != target and a.device.type == device_type:
                return self.g.call(torch.Tensor.to, [a, target], {}, self.loc(e, scope))
            return a
        return [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}

    def replay(self, calls, args, kwargs, e, scope):
        """A call recorded as the ATen ops autocast ran it as: each op a graph node."""
        loc = self.user_loc(e, scope)
        values = {-1: [v for v in tree_leaves((args, kwargs)) if isinstance(v, TensorVar)]}
        resolve = lambda v: values[v.step][v.index] if isinstance(v, AC.Ref) else v  # noqa: E731
        for step, (_, _, step_args, step_kwargs) in enumerate(calls.steps):
            try:
                out = self.g.call(calls.op(step), tree_map(resolve, step_args), tree_map(resolve, step_kwargs), loc)
            except MetaEvalError as err:
                self.brk(B.UNSUPPORTED_OP, e, scope, detail=str(err)[:300])
            values[step] = [v for v in tree_leaves(out) if isinstance(v, TensorVar)]
        return tree_map(resolve, calls.result)

    def rebind(self, old: TensorVar, new: TensorVar, scope, node):
        """An in-place op gave `old` the value `new`. In-place ops are functionalized: the
        base `old` views (if any) gets the new values written back (`functional_setitem` and friends),
        every live view of that base is derived again from its new value, and every variable
        holding an old TensorVar (in any live frame) now holds the new one. Graph inputs
        mutated this way are written back by the runtime.
        A write autograd does not record (under no_grad, or into a detached alias) leaves the
        base its history: its new value is `unrecorded_write(base, values)`."""
        if self.abstract:
            self._replace(old, new, scope)
            return
        new.node.meta["writes"] = old.node  # eager wrote `old` in place: autograd's version check
        chain, root = [], old
        while root.view_of is not None:
            chain.append(root)
            root = root.view_of[0]
        recorded = self.grad_enabled and not any(_untracked(v) for v in chain)
        if self.grad_enabled:
            for v in chain:  # up to a detach of the user's, after which autograd sees no view
                if v.node.meta.get("no_grad_view") or v.view_of[1] is E.no_grad_view:
                    # eager refuses; capture stops, the eager run it falls back to raises that
                    raise RuntimeError("a view created in no_grad mode is modified in place with grad mode enabled")
                if v.view_of[1] in _DETACH:
                    break
        if recorded:
            refused = _refused_by_autograd(chain, root, old, new)
            if refused:  # the statement runs in Python and raises eager's error there
                self.brk(B.UNSUPPORTED_OP, node, scope, whole_stmt=True, detail=refused)
        if root.source is not None:
            self.check_no_alias(root, node, scope)
        new_root = new
        # an alias of its parent (`detach`, `x[:]`, `view` to the same shape): the same elements
        chain = [v for v in chain if not _same_layout(v.meta, v.view_of[0].meta)]
        if all(v.view_of[1] in _SCATTER and v.view_of[4] is None
               and v.meta.dtype == v.view_of[0].meta.dtype for v in chain):
            for v in chain:  # write back level by level: view → its parent → ... → root
                new_root = _SCATTER[v.view_of[1]](self, v.view_of[0], v.view_of, new_root, node, scope)
        else:  # any other view (narrow, select, diagonal, an item of split...): by its strides
            new_root = self.scatter_strided(root, old, new, node, scope)
        if not recorded and root.meta.requires_grad:
            new_root = self.g.call(E.unrecorded_write, [root, new_root], {}, self.user_loc(node, scope))
            new_root.meta.requires_grad_(True)
        elif not recorded and new_root.meta.requires_grad:
            new_root = self.g.call(torch.Tensor.detach, [new_root], {}, self.user_loc(node, scope))
        replaced = {id(root): (root, new_root)}
        # the views are derived again as eager's view tracking does, in grad mode: those autograd
        # does not track hold their `detach` (a view taken under no_grad has one, `op`)
        grad_mode, deriving = self.grad_enabled, self.deriving_views
        self.grad_enabled = self.deriving_views = True
        try:
            with torch.enable_grad():
                for v in self.live_views(root, scope, also=old):
                    parent, fn, args, kwargs, item = v.view_of
                    p_new = replaced[id(parent)][1]
                    derived = self.op(fn, [p_new, *args], kwargs, node, scope)
                    if item is not None:
                        derived = derived[item]
                    if v.node.meta.get("no_grad_view"):  # eager also refuses to read it in grad mode now
                        derived.node.meta.update(no_grad_view=True, no_grad_view_written=True)
                    replaced[id(v)] = (v, derived)
        finally:
            self.grad_enabled, self.deriving_views = grad_mode, deriving
        if old is not root:
            new = replaced[id(old)][1]
        for tv, tv_new in replaced.values():
            self._replace(tv, tv_new, scope)

    def scatter_strided(self, root: TensorVar, view: TensorVar, new: TensorVar, node, scope):
        """`root` with `view`'s elements replaced by `new`, placed by the view's sizes, strides and
        offset in root's storage (root dense, so that a copy of it keeps that layout)."""
        r, v = root.meta, view.meta
        if has_symint([self.sizes(root), self.sizes(view)]) or v.dtype != r.dtype \
                or not _dense(r):
            self.brk(B.INPLACE_VIEW, node, scope, whole_stmt=True,
                     detail=f"through `{getattr(view.view_of[1], '__name__', view.view_of[1])}`")
        # as_strided_scatter places by the strides of a contiguous copy of its input: scatter
        # into root with its dims in memory order (a contiguous view), then put them back
        order = sorted(range(r.dim()), key=lambda d: -r.stride(d))
        base = self.op(torch.permute, [root, order], {}, node, scope) if order != list(range(r.dim())) else root
        out = self.op(torch.as_strided_scatter, [base, new, tuple(v.size()), tuple(v.stride()),
                                                 v.storage_offset() - r.storage_offset()], {}, node, scope)
        if base is root:
            return out
        return self.op(torch.permute, [out, sorted(range(r.dim()), key=lambda d: order[d])], {}, node, scope)

    def check_no_alias(self, inp: TensorVar, node, scope):
        """An input written in place must not share memory with another input: the graph
        reads each input once, so it would not see the write through the other name."""
        for src in self.g.sharing(inp.source):
            self.brk(B.INPLACE_VIEW, node, scope, whole_stmt=True,
                     detail=f"`{inp.source}` shares memory with `{src}`")
        self.sources.written.append(inp.source)  # guarded with all inputs at once (guards.py)

    def _replace(self, old, new, scope):
        if new is old:  # the functional form gave its input back (`conj_physical` of a real tensor)
            return
        s = scope
        while s is not None:
            _replace_in(s.vars, old, new)
            s = s.parent if s.parent is not None else s.enclosing
        self.tensor_writes.replaced(old, new)

    def live_views(self, root, scope, also=None) -> list:
        """TensorVars in live frames (and `also`) that view `root` (directly or through other
        views), parents before their views."""
        found: dict[int, TensorVar] = {}

        def visit(value):
            for v in leaves(value):
                if isinstance(v, TensorVar):
                    chain, p = [], v
                    while p.view_of is not None:
                        chain.append(p)
                        p = p.view_of[0]
                    if p is root:
                        for c in chain:
                            found[id(c)] = c
        visit(also)
        s = scope
        while s is not None:
            for v in s.vars.values():
                visit(self.tensor_writes.latest(v))
            s = s.parent if s.parent is not None else s.enclosing

        def depth(v):
            d = 0
            while v.view_of is not None:
                v, d = v.view_of[0], d + 1
            return d
        return sorted(found.values(), key=depth)


class TensorMethod:
    __slots__ = ("t", "name")

    def __init__(self, t, name):
        self.t, self.name = t, name


def _scatter_getitem(ev, base, view_of, new, node, scope):
    _, _, (idx,), _, _ = view_of
    return ev.op(functional_setitem, [base, idx, new], {}, node, scope)


def _scatter_reshape(ev, base, view_of, new, node, scope):
    return ev.op(torch.Tensor.reshape, [new, tuple(ev.sizes(base))], {}, node, scope)  # dynamic sizes stay symbolic


def _scatter_transpose(ev, base, view_of, new, node, scope):
    _, fn, args, kwargs, _ = view_of
    return ev.op(fn, [new, *args], kwargs, node, scope)  # its own inverse


def _scatter_permute(ev, base, view_of, new, node, scope):
    dims = view_of[2][0] if len(view_of[2]) == 1 and isinstance(view_of[2][0], (list, tuple)) \
        else view_of[2]
    dims = [d % base.meta.dim() for d in dims]
    inverse = sorted(range(len(dims)), key=lambda k: dims[k])
    return ev.op(torch.Tensor.permute, [new, inverse], {}, node, scope)


# how an in-place write through a view reaches its base (other views: a graph break)
_SCATTER = {
    operator.getitem: _scatter_getitem,
    **{f: _scatter_reshape for f in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                                     torch.Tensor.flatten, torch.flatten, torch.Tensor.squeeze,
                                     torch.squeeze, torch.Tensor.unsqueeze, torch.unsqueeze,
                                     torch.Tensor.view_as, torch.Tensor.unflatten)},
    **{f: _scatter_transpose for f in (torch.Tensor.transpose, torch.transpose, torch.Tensor.t,
                                       torch.t)},
    torch.Tensor.permute: _scatter_permute, torch.permute: _scatter_permute,
}


def functional_setitem(x, idx, v):
    """Functional `x[idx] = v` (capture functionalizes in-place writes)."""
    out = x.clone()
    out[idx] = v
    return out


def _refused_by_autograd(chain, root: TensorVar, old: TensorVar, new: TensorVar) -> str | None:
    """Why autograd refuses a write it records (grad mode, no detach between) into `old`, a view
    of `root` through `chain` (`old` first; empty: `old` is `root`), giving it the value `new`:
    a leaf that requires grad and its views are never written in place; one of several views an
    operator returned (or a view of one) is not written by anything that requires grad (eager's
    check_inplace). Capture's functional forms (`x[i] = v` as a setitem on a copy) and meta
    stand-ins rebuilt by strides do not run these checks, so they are made here, for every write."""
    placeholder = root.node is not None and root.node.op == "placeholder"
    leaf = root.node.meta.get("is_leaf", True) if placeholder else root.meta.is_leaf
    if leaf and root.meta.requires_grad and old.meta.requires_grad:
        return ("a view of a leaf Variable that requires grad is being used in an in-place operation"
                if chain else "a leaf Variable that requires grad is being used in an in-place operation")
    if (old.meta.requires_grad or new.meta.requires_grad) and \
            any(v.node.meta.get("multi_output_view") for v in chain):
        return ("one of several views an operator returned (split, chunk, unbind), or a view of "
                "one, is modified in place: autograd refuses it (use an out-of-place op)")
    return None


def _untracked(view: TensorVar) -> bool:
    """A view autograd does not track: a write into it is not recorded on its base (`detach`,
    a view taken under no_grad, of another dtype)."""
    parent, fn = view.view_of[0], view.view_of[1]
    return fn in _DETACH or (parent.meta.requires_grad and not view.meta.requires_grad)


_DETACH = (torch.Tensor.detach, torch.detach, E.no_grad_view)


def _same_layout(a, b) -> bool:
    return a.dtype == b.dtype and tuple(a.size()) == tuple(b.size()) and a.stride() == b.stride() \
        and a.storage_offset() == b.storage_offset()


def _dense(t) -> bool:
    """Non-overlapping and dense: its elements fill storage[offset : offset + numel]."""
    dims = sorted((st, n) for n, st in zip(t.size(), t.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)  # the dtype from the data's


def _has_numpy(v) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_has_numpy(x) for x in v)
    if isinstance(v, dict):
        return any(_has_numpy(x) for x in v.values())
    if isinstance(v, slice):
        return _has_numpy((v.start, v.stop, v.step))
    return isinstance(v, NUMPY_SCALARS)


def _numbers(v):
    """`v` with its NumPy scalars as torch reads them."""
    if isinstance(v, NUMPY_SCALARS):
        return torch_number(v)
    if type(v) in (list, tuple):
        return type(v)(_numbers(x) for x in v)
    if type(v) is dict:
        return {k: _numbers(x) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(*(_numbers(x) for x in (v.start, v.stop, v.step)))
    return v


def name_of(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or str(fn)


def has_symint(v) -> bool:
    return any(isinstance(x, SymInt) for x in leaves(v))


def _replace_in(d, old, new):
    for k, v in list(d.items()):
        if v is old:
            d[k] = new
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if x is old:
                    v[i] = new
        elif isinstance(v, tuple) and any(x is old for x in v):
            d[k] = tuple(new if x is old else x for x in v)
        elif isinstance(v, dict):
            _replace_in(v, old, new)
