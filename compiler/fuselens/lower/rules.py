"""The lowering rules of the primitives their kind's lowering does not cover (lowering.py
`Lowering.lower_<kind>` lowers a pointwise primitive by its spelling, a reduction by its combine,
an extern as a call of its `impl`): views, index-computed values, sources, identities, and the
externs lowered to kernels (max pooling, in-place writes into graph inputs). Each is registered for its primitive with
`@lowering(prim.X)` and called as `rule(ctx, node, args, kwargs)`: `ctx` the Lowering running,
`node` the primitive's FX node (its `meta["val"]` is the result's shape and dtype), `args` and
`kwargs` its operands lowered (View, Lazy, or Python values). It returns the node's value.
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import settings
from ..ops import primitives as prim
from .indexing import floor_div, mod_index, reshape_index
from .ir import ComputedBuffer, InputBuffer, Lazy, View, buffer_view, compute_dtype, ops
from .lowering import (INDEX_OPS_LIMIT, Items, broadcast_index, costly_to_recompute, dense_order, lowering, order_of,
                       read_many_times, reads_of, strides_in, view_strides)


@lowering(prim.stop_gradient, prim.with_vjp)
def _identity(ctx, node, args, kwargs):
    # autograd is done before lowering: here a detach is its input (as in eager, which aliases
    # it), not a kernel copying an extern's result before the next extern reads it
    return args[0]


@lowering(prim.convert)
def _convert(ctx, node, args, kwargs):
    # (no spelling of its own: the writer knows its target's type names)
    return ctx.lower_pointwise(node, prim.convert, args, kwargs,
                               compute=lambda vals: ops().to_dtype(vals[0], kwargs["dtype"]))


@lowering(prim.where)
def _where(ctx, node, args, kwargs):
    # Python scalars take the dtype of the values chosen between, not of the condition
    return ctx.lower_pointwise(node, prim.where, args, kwargs, scalars_like=args[1:])


# --- index-computed values: pointwise with masked loads -------------------------------------------
@lowering(prim.slice_backward)
def _slice_backward(ctx, node, args, kwargs):
    src, _shape, dim, start, end, step = args
    val = node.meta["val"]
    shape, dtype, loc = tuple(val.shape), val.dtype, node.meta.get("loc")

    def fn(idx):
        i = idx[dim]
        conds = [sympy.Ge(i, start), sympy.Lt(i, end)]
        if step != 1:
            conds.append(sympy.Eq(mod_index(i - start, step, ops()), 0))
        src_idx = list(idx)
        src_idx[dim] = floor_div(i - start, step, ops())
        return ops().masked(conds, lambda: src.load(src_idx), 0, dtype)
    return ctx.lazy(shape, dtype, loc, fn, args)


@lowering(prim.cat)
def _cat(ctx, node, args, kwargs):
    tensors, dim = args
    val = node.meta["val"]
    shape, dtype, loc = tuple(val.shape), val.dtype, node.meta.get("loc")

    def fn(idx):
        i, result, offset = idx[dim], None, 0
        parts = []
        for t in tensors:
            parts.append((t, offset))
            offset += t.shape[dim]
        for t, start in reversed(parts):
            src_idx = list(idx)
            src_idx[dim] = i - start
            conds = [sympy.Ge(i, start), sympy.Lt(i, start + t.shape[dim])]
            result = ops().masked(conds, lambda t=t, src_idx=src_idx: t.load(src_idx),
                                  result if result is not None else 0, dtype)
        return result
    # laid out as eager's cat lays it out (channels-last where its pieces are: a segmentation
    # head's upsampled maps, concatenated for a 1x1 convolution, had been copied to NCHW)
    return ctx.lazy(shape, dtype, loc, fn, tensors, order=dense_order(shape, tuple(val.stride())))


# --- views: index expressions over their operand (a view of a buffer is a View of it) -----------
@lowering(prim.permute)
def _permute(ctx, node, args, kwargs):
    x, dims = args
    out_shape = tuple(node.meta["val"].shape)
    if isinstance(x, View):
        return View(x.buf, out_shape, tuple(x.stride[d] for d in dims), x.offset)
    inverse = [dims.index(d) for d in range(len(dims))]
    return Lazy(out_shape, x.dtype, lambda idx: x.load([idx[i] for i in inverse]), x.cost, x.loc,
                permute_of=(x, tuple(dims)), reads=x.reads, heavy=x.heavy)


@lowering(prim.expand)
def _expand(ctx, node, args, kwargs):
    x = args[0]
    out_shape = tuple(node.meta["val"].shape)
    if isinstance(x, View):
        lead = len(out_shape) - len(x.shape)
        stride = (0,) * lead + tuple(0 if s == 1 and o != 1 else st for s, o, st in
                                      zip(x.shape, out_shape[lead:], x.stride))
        return View(x.buf, out_shape, stride, x.offset)
    return Lazy(out_shape, x.dtype, lambda idx: x.load(broadcast_index(idx, out_shape, x.shape)), x.cost,
                x.loc, reads=x.reads, heavy=x.heavy, broadcast_only=math.prod(out_shape) != math.prod(x.shape))


@lowering(prim.slice)
def _slice(ctx, node, args, kwargs):
    x, dim, start, end, step = args
    out_shape = tuple(node.meta["val"].shape)
    if isinstance(x, View):
        stride = list(x.stride)
        stride[dim] *= step
        return View(x.buf, out_shape, tuple(stride), x.offset + start * x.stride[dim])

    def fn(idx):
        src = list(idx)
        src[dim] = start + step * idx[dim]
        return x.load(src)
    return Lazy(out_shape, x.dtype, fn, x.cost, x.loc, reads=x.reads, heavy=x.heavy)


@lowering(prim.reshape)
def _reshape(ctx, node, args, kwargs):
    x = args[0]
    out_shape = tuple(node.meta["val"].shape)
    if isinstance(x, Lazy) and ctx.index_ops(x, out_shape) > INDEX_OPS_LIMIT:
        x = ctx.realize(x)
    if isinstance(x, View):
        stride = view_strides(x.shape, x.stride, out_shape)
        if stride is not None:
            return View(x.buf, out_shape, stride, x.offset)
    return Lazy(out_shape, x.dtype, lambda idx: x.load(reshape_index(idx, out_shape, x.shape, ops())),
                getattr(x, "cost", 1), getattr(x, "loc", None), reads=reads_of([x]),
                reshape_of=x if isinstance(x, Lazy) and not _broadcast(x) else None,
                order=_reshaped_order(x, out_shape), heavy=getattr(x, "heavy", False))


def _reshaped_order(x, out_shape):
    """The memory order of `x` reshaped, where the reshape views x laid out in its order (splits of
    a dim, dims adjacent in memory merged): a channels-last activation split into GroupNorm's
    groups stays channels-last, and the group's statistics are read in memory order."""
    order = order_of(x)
    if order is None or not all(isinstance(n, int) for n in (*x.shape, *out_shape)):
        return None
    stride = view_strides(x.shape, strides_in(x.shape, order), out_shape)
    return None if stride is None else dense_order(out_shape, stride)


def _broadcast(x: Lazy) -> bool:
    """`x` has more elements than any buffer it reads (GQA's keys repeated per head): stored as it is
    reshaped, it joins the kernel of its reshaped neighbours rather than a kernel of its own."""
    numel = math.prod(x.shape)
    return not isinstance(numel, int) or max((n for _, n, _ in x.reads), default=0) < numel


# --- sources ----------------------------------------------------------------------------------------
@lowering(prim.full)
def _full(ctx, node, args, kwargs):
    val, loc = node.meta["val"], node.meta.get("loc")
    shape, dtype, value = tuple(val.shape), val.dtype, args[1]

    def fn(idx):
        with ops().at(loc):
            return ops().constant(value, dtype)
    return Lazy(shape, dtype, fn, loc=loc)


@lowering(prim.iota)
def _iota(ctx, node, args, kwargs):
    val, loc = node.meta["val"], node.meta.get("loc")
    shape, dtype = tuple(val.shape), val.dtype
    _, start, step = args

    def fn(idx):
        with ops().at(loc):
            return ops().index_value(start + step * idx[0], dtype)
    return Lazy(shape, dtype, fn, loc=loc)


# --- 2-d max pooling: externs lowered to window loops over the output -----------------------------
@lowering(prim.max_pool2d)
def _max_pool2d(ctx, node, args, kwargs):
    """(values, offsets) of max pooling: each output's maximum over the window's elements in
    bounds, and its position in the window as ATen picks it (the first maximum, a NaN over
    any number, the last NaN), pointwise values over the output fused with their neighbours
    (after a ResNet's stem, the BatchNorm-ReLU they read)."""
    x, kernel_size, stride, padding, dilation, ceil_mode = args
    val, offsets_val = node.meta["val"]
    shape, dtype, loc = tuple(val.shape), val.dtype, node.meta.get("loc")
    cdtype, odtype = compute_dtype(dtype), offsets_val.dtype
    kernel_w = kernel_size[1]

    def window(idx):  # (offset, value or -inf, whether in bounds) of each element, in order
        for k in range(kernel_size[0] * kernel_w):
            src, conds = list(idx), []
            for d, kd in ((-2, k // kernel_w), (-1, k % kernel_w)):
                src[d] = idx[d] * stride[d] - padding[d] + kd * dilation[d]
                conds += [sympy.Ge(src[d], 0), sympy.Lt(src[d], x.shape[d])]
            yield k, ops().masked(conds, lambda src=src: x.load(src), -math.inf, dtype), conds

    def values(idx):
        result = None
        for _, v, _ in window(idx):
            result = v if result is None else ops().pointwise(prim.maximum, [result, v], dtype)
        return result

    def offsets(idx):
        def op(p, *args, dtype=torch.bool):
            return ops().pointwise(p, list(args), dtype)
        # ATen's loop: the first element in bounds, then one greater than the best so far or NaN
        best, offset, found = ops().constant(-math.inf, cdtype), ops().constant(0, odtype), None
        for k, v, conds in window(idx):
            valid = ops().masked(conds, lambda: ops().constant(True, torch.bool), False, torch.bool)
            better = op(prim.logical_or, op(prim.gt, v, best), op(prim.ne, v, v))
            take = valid if found is None else op(prim.logical_and, valid,
                                                  op(prim.logical_or, op(prim.logical_not, found), better))
            offset = op(prim.where, take, ops().constant(k, odtype), offset, dtype=odtype)
            best = op(prim.where, take, v, best, dtype=cdtype)
            found = valid if found is None else op(prim.logical_or, found, valid)
        return offset
    reads = [x] * (kernel_size[0] * kernel_w)
    return Items([ctx.lazy(shape, dtype, loc, values, reads, order=order_of(x)),
                  ctx.lazy(shape, odtype, loc, offsets, reads, order=order_of(x))])


@lowering(prim.max_pool2d_backward)
def _max_pool2d_backward(ctx, node, args, kwargs):
    """The gradient at each input element: the sum of the gradients of the outputs whose window
    holds it at their maximum's offset, in ATen's order (outputs by row, then column)."""
    g, offsets, _, _, kernel_size, stride, padding, dilation, ceil_mode = args
    val = node.meta["val"]
    shape, dtype, loc = tuple(val.shape), val.dtype, node.meta.get("loc")
    cdtype, odtype, kernel_w = compute_dtype(dtype), offsets.dtype, kernel_size[1]

    def fn(idx):
        total = ops().constant(0.0, cdtype)
        for k in reversed(range(kernel_size[0] * kernel_w)):  # (a later offset: an earlier output)
            out, conds = list(idx), []
            for d, kd in ((-2, k // kernel_w), (-1, k % kernel_w)):
                start = idx[d] + padding[d] - kd * dilation[d]  # the output's window's first row / column
                conds.append(sympy.Ge(start, 0))
                if stride[d] != 1:
                    conds.append(sympy.Eq(mod_index(start, stride[d], ops()), 0))
                out[d] = floor_div(start, stride[d], ops())
                conds.append(sympy.Lt(out[d], g.shape[d]))

            def term(out=out, k=k):
                hit = ops().pointwise(prim.eq, [offsets.load(out), ops().constant(k, odtype)], torch.bool)
                return ops().pointwise(prim.where, [hit, g.load(out), ops().constant(0.0, cdtype)], cdtype)
            total = ops().pointwise(prim.add, [total, ops().masked(conds, term, 0.0, cdtype)], cdtype)
        return ops().to_dtype(total, dtype)
    return ctx.lazy(shape, dtype, loc, fn, [g, offsets] * (kernel_size[0] * kernel_w),
                    order=dense_order(shape, val.stride()))


# --- gathers: loads at positions read from a tensor -------------------------------------------------
@lowering(prim.embedding)
def _embedding(ctx, node, args, kwargs):
    """Rows of `weight` at the positions `indices` holds, as a lazy value: each element loaded where
    its consumer needs it (an embedding summed with positions and normalized, a relative position
    bias added to attention scores, GPT-J's sin/cos rows), not an ATen call writing the gathered
    rows first. An index out of range reads 0 (its load masked: nothing outside the table is read)
    where eager's CUDA kernel asserts, as a scatter's store is masked (`_scatter_`); the C++
    kernels keep ATen's call, which raises eager's error."""
    indices, weight, _padding_idx = args
    return _gathered(ctx, node, args, weight, 0, indices, lambda idx: idx[:-1],
                     lambda idx, row: [row, idx[-1]], order=None)


@lowering(prim.gather)
def _gather(ctx, node, args, kwargs):
    """x's elements at `index` along `dim` (torch.gather: DeBERTa's position scores, bilinear
    resampling's neighbours and gradient), the other dims at the element's own position, laid out
    as ATen's result: loads in the consumer's kernel (`_gathered`), with no flat offset to
    divide back into x's dims (x read as a table of single elements at flat positions: ten 64-bit
    divisions and remainders an element of SegFormer's loss gradient)."""
    x, dim, index = args
    val = node.meta["val"]
    order = dense_order(tuple(val.shape), tuple(val.stride()))
    return _gathered(ctx, node, args, x, dim, index, lambda idx: idx, lambda idx, row: [*idx[:dim], row, *idx[dim + 1:]],
                     order=None if order is None or order == sorted(order) else order)


def _gathered(ctx, node, args, table, dim, positions, position_at, table_at, order):
    """`table` read at the positions along `dim` that `positions` holds: element `idx` loads
    table[table_at(idx, row)], row = positions[position_at(idx)], 0 where row is outside the
    table (its load masked). ATen's call where gathers are not loads in kernels
    (settings.gathers_in_kernels)."""
    if not settings.gathers_in_kernels(ctx.device, positions.shape, table.shape):
        return ctx.lower_extern(node, node.target, args, {})
    val, loc = node.meta["val"], node.meta.get("loc")
    if isinstance(table, Lazy) and costly_to_recompute(table) and \
            read_many_times(math.prod(table.shape), math.prod(val.shape), ctx.device):
        # a table the graph computes, each entry gathered many times (BEiT's bilinearly resampled
        # relative position table, read at every (head, query, key)): stored once, as a value its
        # users broadcast is, not recomputed by every gathered element (its bias kernel: 1.98 ms a
        # step on an H100, Inductor's 0.53)
        table = ctx.realize(table)
    size = ctx.sv(table.shape[dim])

    def fn(idx):
        with ops().at(loc):
            position = positions.load(position_at(idx))
            if positions.dtype != torch.int64:  # (offsets into a large table need 64 bits)
                position = ops().to_dtype(position, torch.int64)
            row = ops().indirect(position)
            return ops().masked([sympy.Ge(row, 0), sympy.Lt(row, size)], lambda: table.load(table_at(idx, row)), 0,
                                val.dtype)
    return ctx.stored_if_broadcast(node, ctx.lazy(tuple(val.shape), val.dtype, loc, fn, [positions, table],
                                                  order=order))


# --- in-place writes into graph inputs ------------------------------------------------------------
@lowering(prim.scatter_)
def _scatter_(ctx, node, args, kwargs):
    """src written into `target`, a view of x, a graph input written in place (runtime/reinplace.py):
    a scatter buffer (ir.ComputedBuffer) over src's elements, each stored at target's element of its
    own position, but `index[i]` along `dim`, so src's producer (a KV cache's RoPE) is computed in
    the write's kernel: no temporary, no ATen call. Readers of the result read x's memory after that
    kernel. An index out of range writes nothing (its store is masked: nothing outside x is
    written); the C++ kernels then raise, and eager's error is raised (ATen raises on a CPU), the
    Triton kernels do not (ATen's CUDA kernel device-asserts). Duplicate indices: one of their
    sources is stored (which one is not defined, as in eager's CUDA kernels). Elsewhere (x not a
    whole input, symbolic sizes), ATen's call."""
    x, target, dim, index, src = args
    if not (isinstance(x, View) and isinstance(x.buf, InputBuffer) and x.is_whole() and isinstance(target, View)
            and target.buf is x.buf) or \
            not all(isinstance(n, int) for n in (*x.shape, *x.stride, *target.shape, *target.stride, *src.shape)):
        return ctx.lower_extern(node, prim.scatter_, args, kwargs)
    loc = node.meta.get("loc")

    def body(idx):
        with ops().at(loc):
            value = src.load(idx)
        if index is None:
            return value, target.index(idx, ops()), []
        position = index.load([idx[dim]] if index.shape else [])
        if index.dtype != torch.int64:  # (an int32 index: offsets into a large input need 64 bits)
            position = ops().to_dtype(position, torch.int64)
        position = ops().indirect(position)
        at = [position if d == dim else i for d, i in enumerate(idx)]
        return value, target.index(at, ops()), [sympy.Ge(position, 0), sympy.Lt(position, ctx.sv(target.shape[dim]))]
    buf = ComputedBuffer(ctx.new_name(), x.shape, x.stride, x.dtype, body=body, kind="scatter",
                         in_shape=tuple(src.shape), loc=loc, into=x.buf)
    ctx.steps.append(buf)
    return buffer_view(buf)
