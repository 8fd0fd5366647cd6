"""Views and indexing: reshapes, permutations, expansions, slices and selections, size queries,
copies, joins (cat, stack) and zero padding."""
from __future__ import annotations

import builtins
import math
import operator

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from ... import settings
from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from ..effects import no_grad_view
from .conventions import shape_arg, upcast
from .registry import Unsupported, register, spellings, tensor_method


@register(tensor_method("view"), *spellings("reshape"))
def reshape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], torch.dtype):
        raise Unsupported("view as another dtype")
    return P.reshape(x, shape_arg(shape))


@register(tensor_method("view_as"), *spellings("reshape_as"))
def view_as(x, other):
    return P.reshape(x, other.shape)


@register(*spellings("flatten"))
def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return P.reshape(x, (1,))
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return P.reshape(x, x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:])


@register(*spellings("unflatten"))
def unflatten(x, dim, sizes):
    dim = dim % x.ndim
    return P.reshape(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:])


@register(*spellings("permute"))
def permute(x, *dims):
    return P.permute(x, shape_arg(dims))


@register(*spellings("transpose", "swapaxes", "swapdims"))
def transpose(x, d0, d1):
    return P.transpose(x, d0, d1)


@register(*spellings("t"))
def t(x):
    return P.transpose(x, 0, 1)


@register(*spellings("movedim", "moveaxis"))
def movedim(x, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src, dst = [s % x.ndim for s in src], [d % x.ndim for d in dst]
    rest = [d for d in range(x.ndim) if d not in src]
    order = [None] * x.ndim
    for s, d in zip(src, dst):
        order[d] = s
    it = iter(rest)
    return P.permute(x, [o if o is not None else next(it) for o in order])


@register(tensor_method("expand"))
def expand(x, *shape):
    return P.expand(x, shape_arg(shape))


@register(tensor_method("expand_as"))
def expand_as(x, other):
    return P.expand(x, other.shape)


@register(*spellings("broadcast_to"))
def broadcast_to(x, shape):
    return P.expand(x, shape)


@register(*spellings("squeeze"))
def squeeze(x, dim=None):
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(d % builtins.max(x.ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim))
    return P.squeeze_dims(x, dims)


@register(*spellings("unsqueeze"))
def unsqueeze(x, dim):
    return P.unsqueeze(x, dim)


@register(*spellings("contiguous"))
def contiguous(x, memory_format=torch.contiguous_format):
    return x if x.val.is_contiguous(memory_format=memory_format) else P.copy(x, memory_format)


@register(*spellings("clone"))
def clone(x, memory_format=torch.preserve_format):
    return P.copy(x, memory_format)


@register(*spellings("detach"), no_grad_view)
def detach(x):
    return emit(prim.stop_gradient, x)


@register(*spellings("narrow"))
def narrow(x, dim, start, length):
    return P.slice(x, dim, start, start + length)


@register(*spellings("select"))
def select(x, dim, index):
    return P.select(x, dim, index)


@register(*spellings("split"))
def split(x, split_size_or_sections, dim=0):
    size = x.shape[dim % x.ndim]
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        bounds = list(range(0, size, step)) or [0]
        sizes = [builtins.min(step, size - b) for b in bounds]
    else:
        sizes = list(split_size_or_sections)
    out, start = [], 0
    for s in sizes:
        out.append(P.slice(x, dim, start, start + s))
        start += s
    return tuple(out)


@register(*spellings("chunk"))
def chunk(x, chunks, dim=0):
    size = x.shape[dim % x.ndim]
    return split(x, builtins.max(-(-size // chunks), 1), dim)


@register(*spellings("unbind"))
def unbind(x, dim=0):
    return tuple(P.select(x, dim, i) for i in range(x.shape[dim % x.ndim]))


@register(*spellings("repeat"))
def repeat(x, *sizes):
    sizes = shape_arg(sizes)
    lead = len(sizes) - x.ndim
    base = P.reshape(x, (1,) * lead + x.shape)
    inter = []
    for r, s in zip(sizes, base.shape):
        inter += [r, s]
    expanded = P.expand(P.reshape(base, [v for s in base.shape for v in (1, s)]), inter)
    return P.reshape(expanded, [r * s for r, s in zip(sizes, base.shape)])


def _triangle(x, diagonal, lower):
    rows, cols = x.shape[-2], x.shape[-1]
    r = P.reshape(P.iota(rows), (rows, 1))
    c = P.reshape(P.iota(cols), (1, cols))
    keep = P.le(P.sub(c, r), diagonal) if lower else P.ge(P.sub(c, r), diagonal)
    return P.where(keep, x, P.cast(0, x.dtype))


register(*spellings("tril"))(lambda x, diagonal=0: _triangle(x, diagonal, True))
register(*spellings("triu"))(lambda x, diagonal=0: _triangle(x, diagonal, False))


@register(operator.getitem)
def getitem(x, index):
    if not isinstance(x, TVal):
        return x[index]
    index = index if isinstance(index, tuple) else (index,)
    if builtins.any(isinstance(i, (TVal, list)) for i in index):
        return _gather(x, index)
    n_real = builtins.sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (builtins.slice(None),) * (x.ndim - n_real) + index[at + 1:]
    out, dim = x, 0
    for i in index:
        if i is None:
            out = P.unsqueeze(out, dim)
            dim += 1
        elif isinstance(i, builtins.slice):
            if i.step is not None and i.step <= 0:
                raise Unsupported("non-positive slice step")
            out = P.slice(out, dim, i.start, i.stop, i.step or 1)
            dim += 1
        else:
            out = P.select(out, dim, int(i))
    return out


def _gather(x, index):
    """x[..., i0, i1, ..., ...] for integer tensors at consecutive dims after whole slices (a
    relative position bias read from its table, CLIP's `h[arange(B), ids.argmax(-1)]`): rows of x
    viewed as a table [n0 * n1 * ..., rest], at the broadcast indices' linear positions, as an
    `embedding` (its backward adds the gradient's rows); the result's dims where numpy puts them."""
    at = next(i for i, v in enumerate(index) if isinstance(v, (TVal, list)))
    count = next((i for i, v in enumerate(index[at:]) if not isinstance(v, TVal)), len(index) - at)
    indices = index[at:at + count]
    if builtins.any(v.dtype not in (torch.int64, torch.int32) for v in indices) or at + count > x.ndim or \
            builtins.any(i != builtins.slice(None) for i in index[:at] + index[at + count:]):
        raise Unsupported("tensor indexing other than integer tensors at consecutive dims after whole slices")
    dims = tuple(range(at, at + count))
    order = dims + tuple(d for d in range(x.ndim) if d not in dims)
    table = P.reshape(P.permute(x, order), (math.prod(x.shape[d] for d in dims), -1))
    shape = tuple(torch.broadcast_shapes(*(v.shape for v in indices)))
    rows = None
    for d, v in zip(dims, indices):
        n = x.shape[d]
        v = P.where(P.lt(v, 0), P.add(v, n), v)  # (negative indices count from the end)
        rows = v if rows is None else P.add(P.mul(rows, n), v)
    rows = P.expand(rows, shape) if tuple(rows.shape) != shape else rows
    out = P.reshape(emit(prim.embedding, rows, table, -1), shape + tuple(x.shape[d] for d in order[count:]))
    k = len(shape)  # the index's dims go where `at` was
    return P.permute(out, tuple(range(k, k + at)) + tuple(range(k)) + tuple(range(k + at, out.ndim)))


@register(*spellings("gather"))
def gather(x, dim, index, *, sparse_grad=False):
    """x's elements at `index` along `dim` (DeBERTa's relative position scores): loads in its
    consumer's kernel (an index out of range of `dim` reads 0 there, where eager's CUDA kernel
    asserts; the C++ kernels call ATen's, which raises). Its gradient adds g into zeros at those
    positions, as eager's backward."""
    if sparse_grad or not isinstance(index, TVal) or index.dtype != torch.int64 or x.ndim == 0 or \
            index.ndim != x.ndim or 0 in x.shape or \
            builtins.any(index.shape[k] > x.shape[k] for k in range(x.ndim) if k != dim % x.ndim):
        raise Unsupported("gather of these arguments")  # (the torch call raises eager's errors)
    return emit(prim.gather, x, dim % x.ndim, index)


@register(*spellings("repeat_interleave"))
def repeat_interleave(x, repeats=None, dim=None, *, output_size=None):
    """Each element repeated `repeats` times along `dim` (GPT-J's sin/cos duplicated for pairs of
    dims): an expand of a new dim after `dim`, merged into it, which the reading kernel indexes.
    A tensor of repeats (a size read from data) stays torch's call."""
    if not isinstance(x, TVal) or not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 0:
        raise Unsupported("repeat_interleave of a tensor of repeats")
    if dim is None:
        x, dim = P.reshape(x, (-1,)), 0
    dim %= builtins.max(x.ndim, 1)
    if x.ndim == 0:
        x = P.reshape(x, (1,))
    spread = list(x.shape[:dim + 1]) + [repeats] + list(x.shape[dim + 1:])
    out = list(x.shape)
    out[dim] *= repeats
    return P.reshape(P.expand(P.unsqueeze(x, dim + 1), spread), out)


@register(*spellings("roll"))
def roll(x, shifts, dims=None):
    """Each dim rotated: the slices of its last `shift` elements and of the rest, concatenated
    (index arithmetic in the kernel that reads it; its VJP the opposite roll)."""
    if dims is None:
        return P.reshape(roll(P.reshape(x, (-1,)), shifts, 0), x.shape)
    shifts = tuple(shifts) if isinstance(shifts, (tuple, list)) else (shifts,)
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    if len(shifts) != len(dims) or not builtins.all(isinstance(s, int) for s in shifts):
        raise Unsupported("roll of these arguments")  # (the torch call raises eager's error)
    out = x
    for shift, dim in zip(shifts, dims):
        size = x.shape[dim]
        shift = shift % size if size else 0
        if shift:
            out = cat([P.slice(out, dim, size - shift, size), P.slice(out, dim, 0, size - shift)], dim)
    return out


@register(F.interpolate)
def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                antialias=False):
    """Nearest upsampling by whole factors that are powers of two (a UNet's decoder): each element
    repeated along each spatial dim, an expand and a reshape (torch's source index floor(i / k) is
    exact for these factors). Bilinear resampling of 4-d values where gathers are loads in Triton
    kernels (`_bilinear`). Other modes and factors stay torch's call."""
    spatial = x.ndim - 2
    if mode == "bilinear" and not antialias and x.ndim == 4 and (size is None) != (scale_factor is None) and \
            recompute_scale_factor is not True and settings.triton_kernels(P.builder().device):
        return _bilinear(x, size, scale_factor, bool(align_corners))
    if mode != "nearest" or antialias or spatial not in (1, 2, 3) or (size is None) == (scale_factor is None):
        raise Unsupported("interpolate other than nearest")
    ins = tuple(x.shape[2:])
    if size is not None:
        outs = tuple(size) if isinstance(size, (tuple, list)) else (size,) * spatial
    else:
        factors = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * spatial
        if not builtins.all(float(f).is_integer() for f in factors):
            raise Unsupported("a fractional scale factor")
        outs = tuple(n * int(f) for n, f in zip(ins, factors))
    ks = [o // n if n and o % n == 0 else 0 for o, n in zip(outs, ins)]
    if len(outs) != spatial or not builtins.all(k and k & (k - 1) == 0 for k in ks):
        raise Unsupported("upsampling by a factor other than a power of two")
    out = x
    for d, k in enumerate(ks):
        if k > 1:
            dim = 2 + d
            shape = list(out.shape)
            out = P.expand(P.unsqueeze(out, dim + 1), tuple(shape[:dim + 1]) + (k,) + tuple(shape[dim + 1:]))
            shape[dim] *= k
            out = P.reshape(out, tuple(shape))
    return out


def _bilinear(x, size, scale_factor, align_corners):
    """Bilinear resampling (a segmentation head's upsampling) as ATen's kernels compute it: each
    output's source position (ATen's `area_pixel_compute_source_index`, in fp32), the four
    neighbours read as a gather of x's pixels in the kernel that consumes the result, weighted in
    fp32. In training the forward is the same gather (SegFormer's decode head: ATen's channels-last
    forward took 7.4 ms of a 32 ms step on an H100) and the gradient is `_BilinearVJP`'s."""
    ins = x.shape[2:]
    if size is not None:
        outs, scales = (tuple(size) if isinstance(size, (tuple, list)) else (size, size)), (None, None)
    else:
        scales = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * 2
        outs = tuple(int(math.floor(n * float(f))) for n, f in zip(ins, scales))
    if len(outs) != 2 or 0 in outs or 0 in ins:
        raise Unsupported("bilinear resampling of these sizes")
    steps = [_source_step(n, out, scale, align_corners) for n, out, scale in zip(ins, outs, scales)]
    # ATen copies where an output's size is its input's, whatever the scale factor: every dim
    # where both are (CUDA's kernel), each such dim on a CPU
    same = [n == out for n, out in zip(ins, outs)]
    if all(same) or P.builder().device.type == "cpu":
        steps = [1.0 if kept else step for kept, step in zip(same, steps)]
    y0, y1, hy0, hy1 = _neighbours(P.cast(P.iota(outs[0]), _accscalar(x.dtype)), ins[0], steps[0], align_corners)
    x0, x1, wx0, wx1 = _neighbours(P.cast(P.iota(outs[1]), _accscalar(x.dtype)), ins[1], steps[1], align_corners)
    hy0, hy1 = (P.reshape(w, (outs[0], 1)) for w in (hy0, hy1))
    wx0, wx1 = (P.reshape(w, (1, outs[1])) for w in (wx0, wx1))
    pixels_last = _pixels_last(x)
    px = lambda r, i: upcast(_pixels_at(r, 3, i, pixels_last))  # noqa: E731
    top, bottom = (P.add(P.mul(wx0, px(r, x0)), P.mul(wx1, px(r, x1)))
                   for r in (_pixels_at(x, 2, y0, pixels_last), _pixels_at(x, 2, y1, pixels_last)))
    out = P.cast(P.add(P.mul(hy0, top), P.mul(hy1, bottom)), x.dtype)
    if not P.builder().needs_grad(x):
        return out
    return emit(prim.with_vjp, out, [x], _BilinearVJP(outs, x, align_corners, scales, steps))


def _source_step(n, out, scale, align_corners):
    """The distance between neighbouring outputs' source positions along a dim of n inputs, as ATen's."""
    if align_corners:
        return (n - 1) / (out - 1) if out > 1 else 0.0
    return 1.0 / float(scale) if scale is not None and float(scale) > 0 else n / out


def _accscalar(dtype):
    """The dtype ATen computes bilinear positions and weights in (its accscalar_t)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _neighbours(d, n, step, align_corners):
    """(first and second source index, their weights) of output positions `d` (in the accscalar
    dtype) along a dim of n inputs: ATen's source position, truncated (it is not negative) and
    clamped."""
    src = P.mul(d, step) if align_corners else P.maximum(P.sub(P.mul(P.add(d, 0.5), step), 0.5), 0.0)
    i0 = P.cast(src, torch.int64)
    i1 = P.minimum(P.add(i0, 1), n - 1)
    w1 = P.sub(src, P.cast(i0, d.dtype))
    return i0, i1, P.sub(1.0, w1), w1


def _readers(n, out, step, align_corners, accscalar):
    """The outputs that read each of n inputs along one dim, and the weights they read it with:
    ((n, L) output positions, (n, L) weights in `accscalar`). Input i is read by the outputs whose source
    position is in [i - 1, i + 1), about 2 / step consecutive ones from ((i - 1) + 0.5) / step - 0.5
    on: L covers them with a margin for rounding, and each output's weight is the forward's own
    (ATen's positions), zero for an output that does not read i or is past the last."""
    length = int(math.ceil(2.0 / step)) + 3
    i = P.reshape(P.iota(n), (n, 1))
    before = P.sub(P.cast(i, accscalar), 1.0)
    first = P.div(before, step) if align_corners else P.sub(P.div(P.add(before, 0.5), step), 0.5)
    first = P.maximum(P.sub(P.cast(first, torch.int64), 1), 0)
    o = P.add(first, P.reshape(P.iota(length), (1, length)))
    inside = P.lt(o, out)
    o = P.minimum(o, out - 1)
    i0, i1, w0, w1 = _neighbours(P.cast(o, accscalar), n, step, align_corners)
    w = P.add(P.where(P.eq(i0, i), w0, 0.0), P.where(P.eq(i1, i), w1, 0.0))
    return o, P.where(inside, w, 0.0)


class _BilinearVJP:
    """The gradient of bilinear resampling as two gathers, one per dim (the weights are a product
    of the dims' weights): along W, each input column sums the weighted gradients of the few
    outputs that read it (`_readers`), then along H. The gradient is read about once, written at
    the input's size, in fp32 sums, with no atomics: ATen's backward kernel (a scatter with atomic
    adds of the four neighbours, in x's dtype) took 6.7 ms of SegFormer's 28 ms training step on an
    H200. Given the gradient in x's dtype, as eager gives it. A dim resampled from or to one pixel
    with align_corners (every output reads the same inputs) keeps ATen's kernel."""

    def __init__(self, outs, x, align_corners, scales, steps):
        self.outs, self.ins, self.dtype = outs, tuple(x.shape), x.dtype
        self.align_corners, self.scales, self.steps = align_corners, scales, steps

    def __call__(self, g, x):
        g = P.cast(g, self.dtype)
        (n, c, ih, iw), (oh, ow) = self.ins, self.outs
        if 0.0 in self.steps:
            return [emit(prim.call_torch, torch.ops.aten.upsample_bilinear2d_backward.default,
                         (g, list(self.outs), list(self.ins), self.align_corners,
                          *(None if s is None else float(s) for s in self.scales)), {})]
        cols, col_weights = _readers(iw, ow, self.steps[1], self.align_corners, _accscalar(self.dtype))
        rows, row_weights = _readers(ih, oh, self.steps[0], self.align_corners, _accscalar(self.dtype))
        lx, ly = cols.shape[1], rows.shape[1]
        # summed in x's layout, where the forward's values that g reads are (SegFormer's loss
        # gradient, traced contiguous, was read along W a channel's stride apart: 13 ms on an
        # H100); laid out as eager lays it out, as g
        pixels_last = _pixels_last(x)
        picked = upcast(_pixels_at(g, 3, P.reshape(cols, (iw * lx,)), pixels_last))
        by_column = _sum_of_groups(picked, 3, iw, lx, col_weights, pixels_last)
        picked = upcast(_pixels_at(by_column, 2, P.reshape(rows, (ih * ly,)), pixels_last))
        out = P.cast(_sum_of_groups(picked, 2, ih, ly, row_weights, pixels_last), self.dtype)
        if _pixels_last(g) != pixels_last:
            out = P.copy(out, torch.channels_last if _pixels_last(g) else torch.contiguous_format)
        return [out]

    def __repr__(self):
        return (f"bilinear_vjp(outs={self.outs}, ins={self.ins}, dtype={self.dtype}, align_corners={self.align_corners}, "
                f"scales={self.scales})")


def _sum_of_groups(v, dim, count, length, weights, pixels_last):
    """(n, c, H, W) `v` whose spatial `dim` holds `count` groups of `length`: each group's sum
    weighted by `weights` (count, length), in fp32; `pixels_last`: summed in pixel-major order, a
    pixel's channels innermost, and the result channels-last."""
    if pixels_last:
        v, dim = P.permute(v, (0, 2, 3, 1)), dim - 1
    shape = v.shape[:dim] + (count, length) + v.shape[dim + 1:]
    weights = P.reshape(weights, (count, length) + (1,) * (len(shape) - dim - 2))
    out = P.sum(P.mul(P.reshape(v, shape), weights), dim + 1)
    return P.permute(out, (0, 3, 1, 2)) if pixels_last else out


def _pixels_last(x) -> bool:
    return suggest_memory_format(x.val) is torch.channels_last


def _pixels_at(x, dim, positions, pixels_last):
    """x's pixels at `positions` (1-D) along its spatial `dim`. `pixels_last`: gathered from x
    viewed as (N, H, W, C), a pixel's channels read together, the result channels-last (laid out
    as ATen lays out indexing, indexed dims outermost, DeepLabV3's four neighbours of each output
    were read from another image every C elements: 1.2 ms on an H100)."""
    if pixels_last:
        return P.permute(_pixels_at(P.permute(x, (0, 2, 3, 1)), dim - 1, positions, False), (0, 3, 1, 2))
    shape = list(x.shape)
    shape[dim] = positions.shape[0]
    index = P.reshape(positions, [n if d == dim else 1 for d, n in enumerate(shape)])
    return emit(prim.gather, x, dim, P.expand(index, tuple(shape)))


@register(builtins.getattr)
def getattr_(x, name):
    if name == "T":
        return P.permute(x, tuple(reversed(range(x.ndim))))
    if name == "mT":
        return P.transpose(x, -2, -1)
    if name == "shape":
        return x.shape
    if name == "device":
        return P.builder().device
    return getattr(x.val, name)


@register(tensor_method("size"))
def size(x, dim=None):
    return x.shape if dim is None else x.shape[dim]


@register(tensor_method("dim"))
def dim_(x):
    return x.ndim


@register(tensor_method("numel"), torch.numel)
def numel(x):
    return x.numel()


@register(torch.ops.aten.sym_size.int)
def sym_size(x, dim):
    return x.shape[dim]


@register(*spellings("cat", "concat", "concatenate"))
def cat(tensors, dim=0):
    """The pieces concatenated; those empty along `dim` take part in the result's dtype and
    layout only (a GPT-J query's pass-through part when the rotary dims are the whole head: read
    under a mask never true, in every element of the kernel). One piece left: a copy in eager's
    layout for the result."""
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors[:1])
    dtype = P.result_type(*tensors)
    dim = dim % tensors[0].ndim
    pieces = [t for t in tensors if t.shape[dim] != 0] or tensors[:1]
    layout = _cat_memory_format(tensors)
    if len(pieces) == 1:
        return P.copy(P.cast(pieces[0], dtype), layout)
    if _cat_memory_format(pieces) != layout:  # (the empty pieces decide the result's layout)
        pieces = tensors
    return emit(prim.cat, [P.cast(t, dtype) for t in pieces], dim)


def _cat_memory_format(tensors):
    """The layout of ATen's cat result: the pieces' suggested memory format where all agree, else
    contiguous."""
    formats = {suggest_memory_format(t.val) for t in tensors}
    return formats.pop() if len(formats) == 1 else torch.contiguous_format


@register(*spellings("stack"))
def stack(tensors, dim=0):
    dim = dim % (tensors[0].ndim + 1)
    return cat([P.unsqueeze(t, dim) for t in tensors], dim)


@register(F.pad)
def pad(x, pad, mode="constant", value=None):
    if mode != "constant" or (value not in (None, 0, 0.0)) or builtins.any(p < 0 for p in pad):
        raise Unsupported("pad other than zero padding")
    out = x
    for i in range(len(pad) // 2):
        dim = x.ndim - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before or after:
            shape = list(out.shape)
            shape[dim] += before + after
            out = emit(prim.slice_backward, out, tuple(shape), dim, before, before + out.shape[dim], 1)
    return out
