"""Primitive FX graph -> LoweredGraph (buffers and the loop bodies that fill them)."""
from __future__ import annotations

import functools
import math
import os

import sympy
import torch
import torch.fx as fx
from torch.fx.node import map_aggregate

from .. import settings
from ..ops import primitives as prim
from ..ops.contract import verify
from .contract import check_lowered
from .indexing import reshape_index
from .ir import (ComputedBuffer, ExternBuffer, ExternCall, InputBuffer, Lazy, LoweredGraph, ReadRecorder, SizeVars,
                 TensorValue, View, buffer_view, compute_dtype, contiguous_strides, loop_ranges, loop_vars, ops,
                 use_handler)

# A lazy value that inlines more operations than this is stored instead of recomputed in every
# consumer (it also bounds the work of re-walking deep expression chains).
INLINE_COST_LIMIT = 48
# A reshape of a lazy value is taken from memory instead when a load of it would index with more
# operations than this: reshapes that regroup dims across a transpose do not simplify, and each
# one multiplies the index of every reshape after it (compile time exponential in their number)
INDEX_OPS_LIMIT = 200
# A lazy value used more than once is stored when a load of it reads this many times its own
# elements or more: each consumer kernel would read all of that again, where storing it costs one
# write and a read per consumer (none for a consumer fused into the kernel that computes it). A
# transformer's residual stream, x + f(x) block after block, left lazy made every layer norm
# re-read every earlier block's output (ViT-B's took 1 ms each on an H100). Less is recomputed:
# softmax's exp(x - max), layer norm's (x - mean) * rstd in its backward (per-row vectors are small).
# In elements and in bytes (stored where both reach it): an fp32 value of bf16 inputs (autocast's GroupNorm backward, from the bf16
# convolution gradient and input) reads no more than a stored copy of it would, which would also
# hold 4 bytes an element (a UNet's backward peaked on such copies: 1.14x Inductor's memory).
REALIZE_READS = 2
# A lazy value that inlines a heavy primitive (prim.Primitive.heavy: sin, cos, tanh, ...), or reads
# more bytes than it holds, is stored where a user (through views) broadcasts it to this many times
# its elements or more: Llama's rotary cos and sin, (B, S, D), recomputed for each of 32 query heads
# and each layer made every rotary kernel compute-bound (an H100: 56 us a layer at 470 GB/s,
# Inductor's 35); a matrix-vector product's vector (a decode step's SwiGLU product of two fp32
# vectors, its RMSNorm's x * rstd * weight) recomputed by each of the product's programs read
# several times its bytes from L2 in each.
BROADCAST_REALIZE = 4
# ... as is one that inlines this many operations: DeBERTa's relative positions (log buckets of
# position differences, clamped, (S, S)) recomputed for every batch and head inside the gather's
# index reached INLINE_COST_LIMIT there, so the gather's index was stored at (B*H, S, S) int64,
# 25 MB a layer, twice, where (S, S) is 2 MB
BROADCAST_COST = INLINE_COST_LIMIT // 4
# ... and its users have this many elements in all, by device type: below, computing it again
# costs less than a kernel of its own. A GPU's launch buys millions of elements (a scalar gate's
# tanh, ALiBi's per-head slopes on short sequences); a C++ kernel's call (ctypes, an OpenMP region:
# microseconds) buys thousands on a CPU core, where a decode step's SwiGLU product recomputed for
# each of the 512 rows of its down projection took 0.5 ms a layer on 2 threads (stored: 0.1 ms)
RECOMPUTE_MIN = {"cuda": 1 << 22, "cpu": 1 << 15}
# Convolutions run channels-last on CUDA, as Inductor's layout optimization runs them: cuDNN's NHWC
# kernels are the fast ones, and its NCHW path transposes in and out (0.67 ms of eager's ResNet-50
# inference step on an H100; fuselens's step 4.12 -> 3.34 ms, Inductor's 3.15; in training 222
# transposes a step). Their operands are stored so (a graph input, a weight: copied once a call),
# their results are, and the pointwise ops between convolutions follow (Lazy.order); a graph
# output is stored in eager's layout, the values a training forward saves for its backward in
# their own (lower_graph's free_outputs), and reductions read their operands in memory order
# (_memory_order). Not in float64 (eager's stays NCHW). Elsewhere eager's layouts
# (FUSELENS_CONV_LAYOUT=channels_last|eager decides instead).
CHANNELS_LAST = [0, 2, 3, 1]
# on a CPU, channels-last convolutions where their activations are more than this many times the
# weights it copies each call (Lowering._nhwc_pays; measured: ResNet-18 at batch 8, ratio 3.3, 25%
# faster channels-last; ResNet-50 at batch 1, ratio 0.9, 60% slower)
NHWC_MIN_RATIO = 2


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _meta_result(p, corrected=None):
    """The result of extern `p` for meta operands: its meta run (`corrected(result, *args)` where
    the meta kernel's layout is not the device kernel's), None where it has no meta kernel."""
    def result(device, *args, **kwargs):
        try:
            val = p.impl(*args, **kwargs)
        except Exception:  # no meta kernel: the result is checked against the traced layout at run time
            return None
        return val if corrected is None else corrected(val, *args)
    return result


# externs whose results' layouts follow their operands', predicted again for operands stored
# otherwise than traced: extern -> `result(device, *meta args, **meta kwargs)`, the layout the
# device's kernel returns (None: as traced)
RELAYOUT = {
    prim.conv2d: _meta_result(prim.conv2d, lambda out, x, weight, *_: prim.conv2d_result_layout(out, x, weight)),
    prim.conv2d_backward: _meta_result(prim.conv2d_backward),
    # the kernel torch picks for these layouts (meta's math path returns another)
    prim.sdpa: lambda device, *args, **kwargs: prim.sdpa_meta(*args, **kwargs, device=device),
}
# how many leading operands a convolution takes channels-last: (grad,) x, weight
_CONV_OPERANDS = {prim.conv2d: 2, prim.conv2d_backward: 3}


# Lowering rules by primitive: `rule(ctx, node, args, kwargs)` -> the node's value, `ctx` the
# Lowering, `args` and `kwargs` its operands lowered (lower/rules.py says more). A primitive without
# one is lowered by its kind (`Lowering.lower_<kind>`): pointwise by its spelling for the kernel's
# target, a reduction by its combine, an extern as a call of its `impl`, random numbers by philox.
LOWERINGS: dict = {}


def lowering(*prims):
    """`fn` is the lowering rule of `prims` (LOWERINGS)."""
    def deco(fn):
        for p in prims:
            LOWERINGS[p] = fn
        return fn
    return deco


def _broadcast_by_users(node: fx.Node, numel, device) -> bool:
    """Pointwise ops and views reading `node`'s value (of `numel` elements), directly or through
    views, that have BROADCAST_REALIZE times its elements or more (each would compute them that
    often) have RECOMPUTE_MIN elements in all."""
    return isinstance(numel, int) and \
        read_many_times(numel, _broadcast_elements(node, BROADCAST_REALIZE * max(numel, 1)), device)


def costly_to_recompute(v: Lazy) -> bool:
    """Whether each load of lazy `v` computes enough to store it where it is read many times over
    (BROADCAST_REALIZE): it inlines a heavy primitive or BROADCAST_COST operations, or reads more
    bytes than it holds."""
    return v.heavy or v.cost >= BROADCAST_COST or \
        sum(n * size for _, n, size in v.reads) > math.prod(v.shape) * v.dtype.itemsize


def read_many_times(numel, reads, device) -> bool:
    """Whether `reads` loads of a value of `numel` elements are BROADCAST_REALIZE of each element
    or more, and RECOMPUTE_MIN in all (below, computing it again costs less than a kernel)."""
    least = RECOMPUTE_MIN.get(device.type, RECOMPUTE_MIN["cuda"])
    return isinstance(numel, int) and isinstance(reads, int) and reads >= max(least, BROADCAST_REALIZE * max(numel, 1))


def _broadcast_elements(node: fx.Node, least: int) -> int:
    total = 0
    for u in node.users:
        kind = getattr(u.target, "kind", None)
        if kind not in ("pointwise", "view"):
            continue
        val = u.meta.get("val")
        n = math.prod(val.shape) if isinstance(val, torch.Tensor) else None
        if kind == "view":
            total += _broadcast_elements(u, least)
        elif isinstance(n, int) and n >= least:
            total += n
    return total


def _broadcast_only(v) -> bool:
    """Whether `v` has no layout of its own: a broadcast of a smaller value, or computed from them."""
    if isinstance(v, View):
        return any(st == 0 and n > 1 for n, st in zip(v.shape, v.stride))
    return isinstance(v, Lazy) and v.broadcast_only


def _consumers(node: fx.Node) -> int:
    """The nodes reading `node`'s value, directly or through views: each would recompute a lazy
    value (OPT's residual stream is flattened to rows before its layer norm and its next residual
    add: one user, a reshape, with two readers)."""
    return sum(_consumers(u) if getattr(u.target, "kind", None) == "view" else 1 for u in node.users)


def _output_viewed_by_extern(node: fx.Node) -> bool:
    """Whether `node`'s value is a graph output (stored anyway) that an extern reads through
    views: stored first, the extern reads views of it, as eager's; left lazy, each view was stored
    again for the extern (nn.MultiheadAttention's packed q, k, v, saved for the backward and each
    copied for the attention: written twice a layer)."""
    def viewed_by_extern(n):
        return any(getattr(u.target, "kind", None) == "extern" or
                   getattr(u.target, "kind", None) == "view" and viewed_by_extern(u) for u in n.users)
    return any(u.op == "output" for u in node.users) and \
        any(getattr(u.target, "kind", None) == "view" and viewed_by_extern(u) for u in node.users)


# torch functions that read their first argument's memory, not its elements (lower_extern)
READS_MEMORY = (torch.as_strided, torch.Tensor.as_strided)


def reads_of(values) -> frozenset:
    """The buffers loads of these values read, as (name, elements, bytes of an element) (lazy
    values' reads, views' buffers)."""
    out = set()
    for v in values:
        if isinstance(v, (list, tuple)):
            out |= reads_of(v)
        elif isinstance(v, View):
            out.add((v.buf.name, v.buf.numel(), v.buf.dtype.itemsize))
        elif isinstance(v, Lazy):
            out |= v.reads
    return frozenset(out)


class _Seed:
    """The graph's seed input: kernels that draw random numbers take it as an argument."""


class _ExternTuple:
    def __init__(self, call, val=None):
        self.call = call
        self.val = val  # its items' meta values where not as traced (Lowering._result_layout)


class Items:
    """A tuple-valued primitive lowered to values, not to an extern call: its items."""
    def __init__(self, items):
        self.items = items


def order_of(v) -> list | None:
    """The dense layout `v` is (or will be) stored in, outermost dim first; None: row-major or
    not dense (a broadcast). A permutation of a lazy value is its base's layout permuted (its
    stored form is the base's, viewed), as the trace lays out a pointwise op on it."""
    if isinstance(v, View):
        order = dense_order(v.shape, v.stride)
    elif isinstance(v, Lazy) and v.order is None and v.permute_of is not None:
        base, dims = v.permute_of
        base_order = order_of(base) or [d for d in range(len(base.shape)) if base.shape[d] != 1]
        order = [dims.index(d) for d in base_order]
    else:
        order = v.order if isinstance(v, Lazy) else None
    return None if order is None or order == sorted(order) else order


def _memory_order(x) -> list | None:
    """The dims of `x` in memory order (its `order_of`), where that is not the logical order and
    every size is static: a reduction of x runs over its elements in this order, each lane's
    neighbour its neighbour in memory (a channels-last BatchNorm's statistics, reduced over N, H
    and W with C innermost: a column reduction, which schedule/fusion.py splits into coalesced
    partials; a channels-last GroupNorm's, over H, W and a group's channels, those channels
    innermost) instead of at a stride of C."""
    order = order_of(x)
    return order if order is not None and all(isinstance(n, int) for n in x.shape) else None


def in_order(shape, order):
    """(`shape` with its dims in `order`, outermost first, and the size-1 dims it leaves out; the
    position there of each dim): the domain of a value stored or reduced in memory order, which
    `viewed_back` shows in its own. A size-1 dim goes where ATen's dense layout of that order puts
    it (`_memory_format_order`), else outermost: ATen reads those strides to pick a layout, and
    misreads others. Innermost (stride 1), a batch of one stored channels-last looked contiguous
    to oneDNN's convolution, which copied it first; outermost, a grouped convolution's
    channels-last weight of a conv1d (its size-1 height's stride its numel, not K x C) made
    oneDNN's convolution of a channels-last input compute wrong values."""
    full = _memory_format_order(shape, order)
    if full is None:
        full = [d for d in range(len(shape)) if d not in order] + list(order)
    return tuple(shape[d] for d in full), [full.index(d) for d in range(len(shape))]


def _memory_format_order(shape, order):
    """The order of every dim of ATen's contiguous or channels-last format whose dims of other
    sizes than 1 are in `order` (contiguous first), or None."""
    n = len(shape)
    formats = [list(range(n))] + ([[0, *range(2, n), 1]] if n >= 3 else [])
    for full in formats:
        if [d for d in full if d in order] == list(order) and len(order) + sum(
                1 for d in range(n) if d not in order and shape[d] == 1) == n:
            return full
    return None


def viewed_back(buf, shape, where) -> View:
    """`buf`, computed over `in_order`'s domain, as the value of `shape` it holds."""
    return View(buf, shape, tuple(buf.stride[k] for k in where), 0)


def strides_in(shape, order) -> tuple:
    """Dense strides of `shape` laid out in `order` (outermost first; the dims it leaves out, of
    size 1, placed outermost: `in_order`)."""
    shape_in, where = in_order(shape, order)
    stride = contiguous_strides(shape_in)
    return tuple(stride[k] for k in where)


def broadcast_index(idx, out_shape, in_shape):
    lead = len(out_shape) - len(in_shape)
    return [sympy.Integer(0) if s == 1 else i for i, s in zip(idx[lead:], in_shape)]


def dense_order(shape, stride):
    """The dims of a dense, non-overlapping, static layout outermost first, size-1 dims left out
    (their strides say nothing); None for other layouts."""
    if not all(isinstance(x, int) for x in (*shape, *stride)):
        return None
    order = [d for d in sorted(range(len(shape)), key=lambda d: (-stride[d], d)) if shape[d] != 1]
    expected = 1
    for d in reversed(order):
        if stride[d] != expected:
            return None
        expected *= shape[d]
    return order


def view_strides(old_shape, old_stride, new_shape):
    """Strides for viewing a strided tensor as `new_shape` without a copy, or None (torch's rule)."""
    if math.prod(old_shape) <= 1:
        return contiguous_strides(new_shape)
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = old_stride[-1]
    tensor_numel = view_numel = 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[d]
        if d == 0 or (old_shape[d - 1] != 1 and old_stride[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = old_stride[d - 1]
                tensor_numel = view_numel = 1
    return tuple(new_stride) if view_d == -1 else None


class Lowering:
    def __init__(self, graph: fx.Graph, device, input_vals=None, free_outputs=None):
        self.graph = graph
        self.input_vals = input_vals
        self.free_outputs = free_outputs
        self.device = torch.device(device)
        self.sv = SizeVars()
        self.steps: list = []
        self.env: dict = {}
        self.names = 0

    def new_name(self):
        self.names += 1
        return f"buf{self.names - 1}"

    def realize(self, v, layout=None) -> View:
        """The value in memory. `layout`: a dense layout as (shape, stride) to store it in (a graph
        output's traced, eager's, layout: a later view in Python may depend on it); a view in
        another layout is copied. Without one, a lazy value is stored in its own `order`."""
        if isinstance(v, View):
            if layout is None or dense_order(*layout) in (None, dense_order(v.shape, v.stride)):
                return v  # (strides of size-1 dims aside: they address nothing)
            v = Lazy(v.shape, v.dtype, v.load, reads=reads_of([v]))
        order = dense_order(*layout) if layout is not None else v.order
        if v.realized is None and v.permute_of is not None:
            base, dims = v.permute_of
            if order is None or base.realized is not None:
                b = self.realize(base)
                view = View(b.buf, v.shape, tuple(b.stride[d] for d in dims), b.offset)
                if order is None or dense_order(view.shape, view.stride) == order:
                    v.realized = view
        base = v.reshape_of
        # (a permutation's stored form is a permuted view, and so is a value stored in its operand's
        # permuted layout: a reshape cannot view them, and the base would be stored for nothing)
        if v.realized is None and base is not None and order is None and \
                (base.realized is not None or base.permute_of is None and base.order is None):
            b = self.realize(base)
            stride = view_strides(b.shape, b.stride, v.shape)
            if stride is not None:
                v.realized = View(b.buf, v.shape, stride, b.offset)
        stored_in = v.realized and dense_order(v.realized.shape, v.realized.stride)
        if order is not None and (stored_in != order if v.realized else order != sorted(order)):
            # stored as the value permuted to `order` (row-major), viewed back; read from where it
            # is stored already if it is (in another layout)
            fn = v.realized.load if v.realized is not None else v.fn
            shape, where = in_order(v.shape, order)
            buf = ComputedBuffer(self.new_name(), shape, contiguous_strides(shape), v.dtype,
                                 body=lambda idx: fn([idx[k] for k in where]), loc=v.loc)
            self.steps.append(buf)
            stored = viewed_back(buf, v.shape, where)
            v.realized = v.realized or stored
            return stored
        if v.realized is None:
            buf = ComputedBuffer(self.new_name(), v.shape, contiguous_strides(v.shape), v.dtype, body=v.fn, loc=v.loc)
            self.steps.append(buf)
            v.realized = buffer_view(buf)
        return v.realized

    def operand(self, a):
        """A node's value as its users see it now: once a lazy value is stored, later users read
        it where it is (recomputing it would keep its inputs in memory too: a ResNet block's
        pre-ReLU sum was stored only for the next block to apply the ReLU again)."""
        if not isinstance(a, fx.Node):
            return a
        v = self.env[a]
        return v.realized if isinstance(v, Lazy) and v.realized is not None else v

    def run(self) -> LoweredGraph:
        inputs, outputs = [], []
        for node in self.graph.nodes:
            if node.op == "placeholder":
                if node.meta.get("seed"):
                    self.env[node] = _Seed()
                    inputs.append(None)
                    continue
                val = self.input_vals[len(inputs)] if self.input_vals is not None else node.meta["val"]
                buf = InputBuffer(f"arg{len(inputs)}", tuple(val.shape), tuple(val.stride()), val.dtype,
                                  index=len(inputs), held=bool(node.meta.get("held")))
                inputs.append(buf)
                self.env[node] = buffer_view(buf)
            elif node.op == "call_function":
                args = map_aggregate(node.args, self.operand)
                kwargs = map_aggregate(dict(node.kwargs), self.operand)
                self.env[node] = self.lower(node, node.target, args, kwargs)
            elif node.op == "output":
                for i, o in enumerate(node.args[0]):
                    v = self.env[o] if isinstance(o, fx.Node) else o
                    val = o.meta.get("val") if isinstance(o, fx.Node) else None
                    layout = (tuple(val.shape), tuple(val.stride())) if isinstance(val, torch.Tensor) else None
                    if self.free_outputs is not None and i >= self.free_outputs and layout is not None and \
                            all(isinstance(n, int) for n in val.shape):
                        # read by the backward only, compiled for the layout it gets: where it is
                        # stored already (a user's output too), read there rather than stored again
                        layout = None
                        if isinstance(v, Lazy) and v.realized is not None:
                            v = v.realized
                    outputs.append(self.realize(v, layout) if isinstance(v, TensorValue) else v)
        return LoweredGraph(inputs, self.steps, outputs, self.sv, self.device, has_seed=None in inputs)

    def lower(self, node, p, args, kwargs):
        """The value of `node`, a call of primitive `p`: by its rule (LOWERINGS), else by its kind."""
        rule = LOWERINGS.get(p)
        if rule is not None:
            return rule(self, node, args, kwargs)
        by_kind = getattr(self, f"lower_{p.kind}", None)
        if by_kind is None:
            raise NotImplementedError(f"no lowering for {p} (a {p.kind}): register one in lower/rules.py")
        return by_kind(node, p, args, kwargs)

    # --- pointwise --------------------------------------------------------------------------------
    def lower_pointwise(self, node, p, args, kwargs, compute=None, scalars_like=None):
        """A pointwise primitive's lazy value: each element `p`'s spelling of the operands' elements
        (or `compute(values)`); Python scalars among `args` as values of the first tensor's dtype
        among `scalars_like` (default: `args`), in compute precision where `p` takes them so."""
        val = node.meta["val"]
        shape, dtype, loc = tuple(val.shape), val.dtype, node.meta.get("loc")
        if node.meta.get("alone") and p.alone is not None:  # the user's op itself (Primitive.alone)
            p = p.alone
        tensor_dtypes = [a.dtype for a in (args if scalars_like is None else scalars_like) if isinstance(a, TensorValue)]
        const_dtype = tensor_dtypes[0] if tensor_dtypes else dtype
        if self.device.type in p.opmath_scalars:
            const_dtype = compute_dtype(const_dtype)

        def fn(idx):
            vals = [a.load(broadcast_index(idx, shape, a.shape)) if isinstance(a, TensorValue)
                    else ops().constant(a, const_dtype) for a in args]
            return compute(vals) if compute is not None else ops().pointwise(p, vals, dtype)
        # laid out as ATen's TensorIterator does: after its first operand of the full shape (a
        # `where`'s condition included), but one broadcast from smaller operands (a cross
        # entropy's one-hot pick: SegFormer's channels-last logits, picked in NCHW order, were
        # stored in fp32 for a kernel of their own)
        full = [a for a in args if isinstance(a, TensorValue) and tuple(a.shape) == shape]
        laid_out = [a for a in full if not _broadcast_only(a)]
        order = order_of((laid_out or full)[0]) if full else None
        if kwargs.get("memory_format") not in (None, torch.preserve_format):
            # `.contiguous()` (or a copy to channels-last): the layout it asks for, which its users'
            # views were traced on (nn.MultiheadAttention's attention output, permuted, made
            # contiguous and flattened for the out-projection: laid out as its input, it was copied
            # again for the projection, in the forward and in the backward)
            traced = dense_order(shape, tuple(val.stride()))
            order = None if traced is None or traced == sorted(traced) else traced
        v = self.lazy(shape, dtype, loc, fn, args, order=order, heavy=p.heavy)
        if not isinstance(v, Lazy):
            return v
        v.broadcast_only = not laid_out and kwargs.get("memory_format") in (None, torch.preserve_format)
        if _output_viewed_by_extern(node):
            return self.realize(v)
        read_bytes = sum(n * size for _, n, size in v.reads)
        if _consumers(node) > 1 and sum(n for _, n, _ in v.reads) >= REALIZE_READS * math.prod(shape) and \
                read_bytes >= REALIZE_READS * math.prod(shape) * dtype.itemsize:
            return self.realize(v)
        return self.stored_if_broadcast(node, v)

    def stored_if_broadcast(self, node, v):
        """Lazy `v` (`node`'s value), stored where it is costly to recompute or reads no tensor
        (a constant of the program, made once by its first call: bilinear resampling's weights)
        and its users broadcast it (BROADCAST_REALIZE): each broadcast element would compute it
        again."""
        if isinstance(v, Lazy) and (costly_to_recompute(v) or not v.reads) and \
                _broadcast_by_users(node, math.prod(v.shape), self.device):
            return self.realize(v)
        return v

    def lazy(self, shape, dtype, loc, fn, inputs, order=None, heavy=False):
        """The lazy value `fn(idx)`, its kernel lines located at `loc`, reading `inputs`; stored at
        once if it inlines more than INLINE_COST_LIMIT operations."""
        def located(idx):  # kernel lines of this op carry its source location
            with ops().at(loc):
                return fn(idx)
        lazies = [a for a in inputs if isinstance(a, Lazy)]
        cost = 1 + sum(a.cost for a in lazies)
        v = Lazy(shape, dtype, located, cost, loc, reads=reads_of(inputs), order=order,
                 heavy=heavy or any(a.heavy for a in lazies))
        return self.realize(v) if cost > INLINE_COST_LIMIT else v

    def index_ops(self, x, out_shape):
        """The operations of the largest index a load of lazy `x` reshaped to `out_shape` makes (the
        reshape rule reads such a value from memory past INDEX_OPS_LIMIT)."""
        recorder = ReadRecorder(self.sv, loop_ranges(out_shape, ()))
        with use_handler(recorder):
            x.load(reshape_index(loop_vars(out_shape, ()), out_shape, x.shape, recorder))
        return max((sympy.count_ops(index) for _, index in recorder.reads), default=0)

    # --- reductions -------------------------------------------------------------------------------
    def lower_reduction(self, node, p, args, kwargs):
        x, dims = args
        val, loc = node.meta["val"], node.meta.get("loc")

        def body(idx):
            with ops().at(loc):
                return x.load(idx)
        order = _memory_order(x)
        if order is not None:  # over x in memory order, viewed back (as `realize` stores a permuted value)
            in_shape, where = in_order(x.shape, order)
            red = tuple(sorted(where[d] for d in dims))
            shape = tuple(1 if d in red else n for d, n in enumerate(in_shape))
            buf = ComputedBuffer(self.new_name(), shape, contiguous_strides(shape), val.dtype,
                                 body=lambda idx: body([idx[k] for k in where]), kind="reduction",
                                 in_shape=in_shape, red_dims=red, reduce=p.reduce, loc=loc)
            self.steps.append(buf)
            return viewed_back(buf, tuple(val.shape), where)
        buf = ComputedBuffer(self.new_name(), tuple(val.shape), contiguous_strides(val.shape), val.dtype, body=body,
                             kind="reduction", in_shape=tuple(x.shape), red_dims=tuple(dims), reduce=p.reduce, loc=loc)
        self.steps.append(buf)
        return buffer_view(buf)

    def lower_random(self, node, p, args, kwargs):
        val, loc = node.meta["val"], node.meta.get("loc")
        shape, stream = tuple(val.shape), kwargs["stream"]
        strides = contiguous_strides(shape)
        sv = self.sv

        def fn(idx):
            with ops().at(loc):
                flat = sum((i * sv(s) for i, s in zip(idx, strides)), sympy.Integer(0))
                return ops().random(p.name, stream, flat)
        # philox is a pure function of (seed, stream, element): recomputing it in several kernels
        # gives the same numbers, so random values inline like any pointwise value
        return Lazy(shape, val.dtype, fn, loc=loc)

    # --- extern calls -----------------------------------------------------------------------------
    def lower_extern(self, node, p, args, kwargs):
        def arg(a):
            return self.realize(a) if isinstance(a, TensorValue) else a
        n = _CONV_OPERANDS.get(p)
        if n and self._channels_last(args[n - 2]):  # (x)
            args = tuple(self.realize(a, (a.shape, strides_in(a.shape, CHANNELS_LAST))) for a in args[:n]) + tuple(args[n:])
        if p is prim.call_torch and args[0] in READS_MEMORY and isinstance(args[1][0], TensorValue):
            # `as_strided` reads its operand's memory, not its elements: a value the graph computed
            # is given it alone in a buffer, in eager's layout (capture lets in only values whose
            # eager memory is all theirs: Tensors.op); an input is the caller's tensor itself
            x, meta = args[1][0], node.args[1][0].meta["val"]
            if not (isinstance(x, View) and isinstance(x.buf, InputBuffer)):
                x = self.realize(x, (tuple(meta.shape), meta.stride()))
                if x.offset != 0 or math.prod(x.buf.shape) != math.prod(x.shape):  # (a view of a larger buffer)
                    x = self.realize(Lazy(x.shape, x.dtype, x.load, reads=reads_of([x])), (tuple(meta.shape), meta.stride()))
            args = (args[0], (x, *args[1][1:]), *args[2:])
        args, kwargs = map_aggregate(args, arg), map_aggregate(kwargs, arg)
        call = ExternCall(self.new_name(), p, args, kwargs, None, loc=node.meta.get("loc"))
        self.steps.append(call)
        val = self._result_layout(node, p, args, kwargs)
        if isinstance(val, torch.Tensor):
            call.result = ExternBuffer(call.name, tuple(val.shape), tuple(val.stride()), val.dtype, call=call)
            return buffer_view(call.result)
        return _ExternTuple(call, val if val is not node.meta["val"] else None)

    def _channels_last(self, x) -> bool:
        """Whether a convolution of `x` runs channels-last (CHANNELS_LAST): by default on CUDA
        (cuDNN) and on a CPU whose graphs run as C++ kernels where that pays (`_nhwc_pays`; the
        Triton interpreter's tests keep eager's)."""
        fast = self.device.type == "cuda" or (self.device.type == "cpu" and settings.CPU_BACKEND == "cpp"
                                              and self._nhwc_pays)
        mode = os.environ.get("FUSELENS_CONV_LAYOUT") or ("channels_last" if fast else "eager")
        if mode not in ("channels_last", "eager"):
            raise ValueError(f"FUSELENS_CONV_LAYOUT={mode!r}: set it to channels_last or eager, or unset it")
        return mode == "channels_last" and len(x.shape) == 4 and x.dtype != torch.float64

    @functools.cached_property
    def _nhwc_pays(self) -> bool:
        """On a CPU: whether this graph's convolutions gain from channels-last. oneDNN's NHWC
        convolutions save the reorders of activations its NCHW path makes (a ResNet-18 at batch 8:
        320 -> 240 ms on 2 threads), but a weight that comes in NCHW (a parameter) is copied to
        NHWC on every call; where the weights outweigh the activations that cost more than it saves
        (ResNet-50 inference at batch 1, 94 MB of weights and 87 MB of activations: 32 -> 51 ms).
        Channels-last where the convolutions' activations (operands and results) are more than
        NHWC_MIN_RATIO times the bytes of the weights copied."""
        acts = weights = 0
        for n in self.graph.nodes:
            if n.op != "call_function" or n.target not in _CONV_OPERANDS:
                continue
            *acts_in, w = n.args[:_CONV_OPERANDS[n.target]]
            out = n.meta.get("val")
            outs = out if isinstance(out, tuple) else (out,)
            acts += sum(_nbytes(a.meta.get("val")) for a in acts_in) + sum(map(_nbytes, outs))
            wv = w.meta.get("val")
            if w.op == "placeholder" and isinstance(wv, torch.Tensor) and wv.dim() == 4 and \
                    not wv.is_contiguous(memory_format=torch.channels_last):
                weights += _nbytes(wv)
        return acts > NHWC_MIN_RATIO * weights

    def _result_layout(self, node, p, args, kwargs):
        """The extern's result (meta): as traced, unless a tensor operand is stored in another
        layout than traced (channels-last convolutions, a pointwise result following its input's
        layout, a broadcast mask stored whole) and `p` is one of RELAYOUT, then what it returns
        for the operands as stored. (Others' results are checked against the traced layout at
        run time.)"""
        result = RELAYOUT.get(p)
        if result is None:
            return node.meta["val"]
        traced = [a.meta["val"] for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        stored = [a for a in (*args, *kwargs.values()) if isinstance(a, View)]
        if len(traced) != len(stored) or all(tuple(t.stride()) == v.stride for t, v in zip(traced, stored)):
            return node.meta["val"]

        def meta(a):
            return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device="meta") if isinstance(a, View) else a
        val = result(self.device, *map_aggregate(args, meta), **map_aggregate(kwargs, meta))
        return node.meta["val"] if val is None else val

    def lower_item(self, node, p, args, kwargs):
        tup, index = args
        if isinstance(tup, Items):
            return tup.items[index]
        buf = next((b for b in tup.call.items if b.item == index), None)
        if buf is None:  # (a graph may take an item twice: the forward's output and a saved value)
            val = tup.val[index] if tup.val is not None else node.meta["val"]
            buf = ExternBuffer(f"{tup.call.name}_{index}", tuple(val.shape), tuple(val.stride()), val.dtype,
                               call=tup.call, item=index)
            tup.call.items.append(buf)
        return buffer_view(buf)


def lower_graph(graph: fx.Graph, device, input_vals=None, free_outputs=None) -> LoweredGraph:
    """`input_vals` (tensors, meta or real) override the placeholders' example strides. Outputs
    from index `free_outputs` on (a training forward's saved values) are stored in their own
    layouts (a value following a channels-last convolution's, say), not the traced ones: static
    sizes only."""
    lowered = Lowering(graph, device, input_vals, free_outputs).run()
    verify(check_lowered, lowered)
    return lowered
