"""Matrix products, convolution and embedding: extern primitives (cuBLAS, cuDNN), with their
operands brought to one dtype and, for large half-precision GEMMs, to cuBLAS's alignment."""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from .. import builder as P
from .. import primitives as prim
from ..builder import TVal, emit
from .conventions import is_half, pair
from .registry import Unsupported, register, spellings, tensor_method


def _same_dtype(a, b):
    dtype = P.result_type(a, b)
    return P.cast(a, dtype), P.cast(b, dtype)


# GEMMs at least this large (M*N*K) get their unaligned dims padded (`_gemm`)
PAD_GEMM_MIN = 1 << 30


def _gemm_alignment(dtype):
    """Elements per 16 bytes where cuBLAS needs 16-byte aligned leading dims for its fast kernels
    (half precision on a GPU: an odd vocabulary size runs SIMT/`align1` kernels 3-5x slower);
    None: no padding."""
    return 8 if P.builder().device.type == "cuda" and is_half(dtype) else None


def _gemm(p, a, b, bias=None):
    """`p` (mm or addmm) of a (M, K) and b (K, N), each dim zero-padded to cuBLAS's alignment when
    it is not aligned and the product is large: padded K columns meet only zeros, padded M rows
    and N columns are sliced off, so values are the GEMM's own. The pads are pointwise ops that fuse
    into the kernels producing the operands, and the VJPs through pad and slice keep the
    backward's GEMMs aligned too (the gradient arrives padded)."""
    (m, k), n = a.shape, b.shape[1]
    if _as_reduction(a, b):
        return _matrix_vector(a, b, bias)
    align = _gemm_alignment(a.dtype)
    pm, pk, pn = ((-m) % align, (-k) % align, (-n) % align) if align else (0, 0, 0)
    if not (pm or pk or pn) or m * n * k < PAD_GEMM_MIN:
        return emit(p, *([] if bias is None else [bias]), a, b)
    a = _zero_pad(a, (m + pm, k + pk))  # (m: the backward's weight gradient sums over it)
    b = _zero_pad(b, (k + pk, n + pn))
    bias = None if bias is None else _zero_pad(bias, (n + pn,))
    return P.slice(P.slice(emit(p, *([] if bias is None else [bias]), a, b), 0, 0, m), 1, 0, n)


# products with at most this many rows in `a` are reductions (`_matrix_vector`)
GEMV_MAX_ROWS = 1


def _as_reduction(a, b) -> bool:
    """Whether a (M, K) @ b (K, N) is a generated reduction kernel rather than an extern GEMM
    (cuBLAS, MKL): no gradient, at most GEMV_MAX_ROWS rows, b's K dim contiguous (a Linear's
    weight, transposed). There the product reads b once and is bound by memory bandwidth:
    decoding's weight reads, where cuBLAS's kernels for one row reach 38-67% of an H200's bandwidth
    on a 1B decoder's projections, and MKL's are slower than a C++ kernel (bench/NOTES.md 70); the
    kernel fuses what comes before and after it (bias, activation, the residual add, both halves
    of a SwiGLU reading the same x)."""
    return a.shape[0] <= GEMV_MAX_ROWS and b.val.stride(0) == 1 and b.val.stride(1) >= b.shape[0] and \
        a.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
        not (a.val.requires_grad or b.val.requires_grad) and 0 not in (*a.shape, b.shape[1])


def _matrix_vector(a, b, bias=None):
    """a (M, K) @ b (K, N) (+ bias) as cuBLAS computes it, products and sums in fp32 rounded once at
    the end (bf16 x bf16 products are exact in fp32), as sum over K of a[m, None, :] * b^T[None]:
    rows (m, n) of one reduction along b's contiguous K (`_as_reduction`)."""
    (m, k), n = a.shape, b.shape[1]
    wide = torch.float32 if a.dtype != torch.float64 else a.dtype
    rows = P.expand(P.reshape(P.cast(a, wide), (m, 1, k)), (m, n, k))
    weight = P.expand(P.reshape(P.cast(P.transpose(b, 0, 1), wide), (1, n, k)), (m, n, k))
    out = P.sum(P.mul(rows, weight), -1)
    if bias is not None:
        out = P.add(out, P.cast(bias, wide))
    return P.cast(out, a.dtype)


def _zero_pad(x, shape):
    """`x` with zeros after its end in each dim to make `shape`; a transposed matrix (a linear's
    weight) padded in its own layout, then transposed: a copy, not a transposing copy."""
    if x.node.target is prim.permute and x.node.args[1] == (1, 0):
        src = x.node.args[0]
        return P.transpose(_zero_pad(TVal(src, src.meta["val"]), shape[::-1]), 0, 1)
    for dim, size in enumerate(shape):
        if size != x.shape[dim]:
            grown = x.shape[:dim] + (size,) + x.shape[dim + 1:]
            x = emit(prim.slice_backward, x, grown, dim, 0, x.shape[dim], 1)
    return x


@register(*spellings("mm"))
def mm(a, b):
    return _gemm(prim.mm, *_same_dtype(a, b))


@register(*spellings("bmm"))
def bmm(a, b):
    return emit(prim.bmm, *_same_dtype(a, b))


@register(*spellings("matmul"), operator.matmul, tensor_method("__matmul__"))
def matmul(a, b):
    a, b = _same_dtype(a, b)
    if a.ndim == 1 and b.ndim == 1:
        return P.reshape(emit(prim.mm, P.reshape(a, (1, -1)), P.reshape(b, (-1, 1))), ())
    if a.ndim == 1:
        return P.squeeze_dims(matmul(P.unsqueeze(a, 0), b), (b.ndim - 2,))
    if b.ndim == 1:
        return P.squeeze_dims(matmul(a, P.unsqueeze(b, 1)), (a.ndim - 1,))
    if b.ndim == 2:
        out = _gemm(prim.mm, P.reshape(a, (-1, a.shape[-1])), b)
        return P.reshape(out, a.shape[:-1] + (b.shape[-1],))
    batch = P.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = P.reshape(P.expand(a, batch + a.shape[-2:]), (-1,) + a.shape[-2:])
    b3 = P.reshape(P.expand(b, batch + b.shape[-2:]), (-1,) + b.shape[-2:])
    return P.reshape(emit(prim.bmm, a3, b3), batch + (a.shape[-2], b.shape[-1]))


def _biased_gemm(bias, a, b):
    """a @ b + bias, a (M, K) and b (K, N). A bias row (N,) of a's and b's half precision goes
    into one extern call as eager's (`F.linear`, `torch.addmm`): cuBLAS adds it in its epilogue
    before the product rounds, at no cost (a separate add costs a pass over the output where no
    kernel fuses with it: the attention's QKV projection, whose reader is SDPA). In fp32 the
    epilogue makes cuBLAS pick slower kernels (H100, BERT-base's 3072 -> 768 projection: 500 us
    with the bias, 418 without), so there the add is pointwise and fuses with what follows (GeLU,
    the residual add before a layer norm)."""
    if tuple(bias.shape) == (b.shape[1],) and a.dtype == b.dtype == bias.dtype and is_half(a.dtype):
        return _gemm(prim.addmm, a, b, bias)
    return P.add(mm(a, b), bias)


@register(F.linear)
def linear(x, weight, bias=None):
    if bias is None or x.ndim < 2 or weight.ndim != 2 or tuple(bias.shape) != (weight.shape[0],):
        out = matmul(x, P.transpose(weight, 0, 1))  # (a bias may broadcast over x's leading dims)
        return out if bias is None else P.add(out, bias)
    out = _biased_gemm(bias, P.reshape(x, (-1, x.shape[-1])), P.transpose(weight, 0, 1))
    return P.reshape(out, x.shape[:-1] + (weight.shape[0],))


def _scaled_sum(product, x, beta, alpha):
    """beta * x + alpha * product, as torch's add-GEMMs define it: beta == 0 ignores x (its NaNs
    and infinities too)."""
    if alpha != 1:
        product = P.mul(product, alpha)
    if beta == 0:
        return P.add(product, P.full(tuple(x.shape), 0, dtype=x.dtype))  # x's broadcast and dtype
    return P.add(product, x if beta == 1 else P.mul(x, beta))


@register(*spellings("addmm"))
def addmm(bias, a, b, *, beta=1, alpha=1):
    if alpha == 1 and beta == 1:
        return _biased_gemm(bias, a, b)
    return _scaled_sum(mm(a, b), bias, beta, alpha)


@register(*spellings("baddbmm"))
def baddbmm(x, a, b, *, beta=1, alpha=1):
    """(MultiheadAttention's masked scores, BLOOM's ALiBi): the product a GEMM, the scaled sum
    pointwise work that fuses with its readers (the softmax)."""
    return _scaled_sum(bmm(a, b), x, beta, alpha)


def _in_eager_layout(out, x, weight):
    """A convolution's result `out` predicted in eager's layout (prim.conv2d_result_layout):
    predicted wrong, it would be copied into the predicted layout on every call."""
    out.val = out.node.meta["val"] = prim.conv2d_result_layout(out.val, x.val, weight.val)
    return out


def _bias_in_kernel() -> bool:
    """Whether eager's half-precision convolution adds its bias inside the kernel, before the
    result rounds once (oneDNN on a CPU): the bias goes into the extern call. cuDNN computes no
    bias ("Bias is handled outside", ATen's cudnn/ConvShared.cpp): ATen adds it to the rounded
    result in a kernel of its own, which is what a pointwise add is, and that add fuses with the
    result's readers instead of costing a pass over the output (a ConvNeXt block's depthwise
    convolution, every biased convolution of a UNet). (ATen's own depthwise kernel, which a GPU
    runs for some NCHW depthwise convolutions, adds the bias before rounding: one rounding apart.)"""
    return P.builder().device.type != "cuda"


@register(F.conv2d, torch.conv2d)
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    if isinstance(padding, str):
        raise Unsupported("string padding")
    x, weight = _same_dtype(x, weight)
    with_bias = bias is not None and is_half(x.dtype) and _bias_in_kernel()
    out = _in_eager_layout(emit(prim.conv2d, x, weight, bias if with_bias else None, pair(stride), pair(padding),
                                pair(dilation), groups), x, weight)
    if with_bias:
        return out
    # an unbatched input (C, H, W) gives an unbatched result: the bias broadcasts over (C, 1, 1)
    return out if bias is None else P.add(out, P.reshape(bias, (-1, 1, 1) if x.ndim == 3 else (1, -1, 1, 1)))


@register(F.conv1d, torch.conv1d)
def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A convolution over one dim as one over (1, L), as ATen runs it for cuDNN and oneDNN."""
    if isinstance(padding, str) or x.ndim not in (2, 3) or weight.ndim != 3:
        raise Unsupported("string padding or unexpected ranks")  # (the torch call raises eager's errors)
    one = lambda v: (1, v[0] if isinstance(v, (tuple, list)) else v)  # noqa: E731
    zero = lambda v: (0, v[0] if isinstance(v, (tuple, list)) else v)  # noqa: E731
    out = conv2d(P.unsqueeze(x, -2), P.unsqueeze(weight, -2), bias, one(stride), zero(padding), one(dilation), groups)
    return P.squeeze_dims(out, (out.ndim - 2,))


@register(F.embedding)
def embedding(indices, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise Unsupported("embedding options")
    return emit(prim.embedding, indices, weight, -1 if padding_idx is None else padding_idx % weight.shape[0])


@register(torch.embedding)
def aten_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return embedding(indices, weight, None if padding_idx < 0 else padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                     sparse=sparse)


@register(torch.einsum)
def einsum(equation, *operands, path=None):
    """torch.einsum as its views, sums, products and matrix products, as ATen computes it
    (operands contracted pairwise from the left; `path` orders only which pair first, so is
    ignored): the permutes and reshapes are views or copies the lowering fuses with the operands'
    producers, where ATen's call copies them in kernels of its own (MaxViT's relative position
    bias: two einsums a block). A label repeated within one operand (a diagonal) and the sublist
    form are the torch call's."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or not operands or not all(isinstance(o, TVal) for o in operands):
        raise Unsupported("einsum's sublist form")
    terms, out = _einsum_labels(equation.replace(" ", ""), [o.ndim for o in operands])
    if any(len(set(t)) != len(t) for t in terms) or len(set(out)) != len(out) or \
            not set(out) <= set().union(*map(set, terms)):
        raise Unsupported("einsum diagonal or malformed equation")  # (the torch call raises eager's errors)
    sizes: dict = {}
    for op, term in zip(operands, terms):
        for label, size in zip(term, op.shape):
            if sizes.get(label, 1) == 1:
                sizes[label] = size
            elif size not in (1, sizes[label]):
                raise Unsupported("einsum operands' sizes do not broadcast")
    dtype = P.result_type(*operands)
    values = [(P.cast(op, dtype), term) for op, term in zip(operands, terms)]
    value, labels = values[0]
    for i, (other, other_labels) in enumerate(values[1:], 1):
        later = set(out).union(*(set(t) for t in terms[i + 1:]))
        value, labels = _contract(value, labels, other, other_labels, later, sizes)
    value, labels = _sum_labels(value, labels, set(out))
    return P.permute(value, [labels.index(label) for label in out])


def _einsum_labels(equation, ranks):
    """(each operand's labels, the result's labels) of an einsum equation, '...' spelled out as one
    label per broadcast dim (right-aligned across operands; characters no equation uses)."""
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported("einsum operand count")
    width = max((rank - len(t.replace("...", "")) for t, rank in zip(terms, ranks) if "..." in t), default=0)
    ellipsis = [chr(0x100 + i) for i in range(width)]
    spelled = []
    for t, rank in zip(terms, ranks):
        if "..." in t:
            n = rank - len(t.replace("...", ""))
            t = t.replace("...", "".join(ellipsis[width - n:]))
        if len(t) != rank:
            raise Unsupported("einsum labels do not match an operand's rank")
        spelled.append(t)
    if arrow:
        if "..." not in rhs and width:
            raise Unsupported("einsum result without the operands' '...'")
        out = rhs.replace("...", "".join(ellipsis))
    else:  # the labels used once, alphabetically, after the broadcast dims (torch's implicit result)
        counts = "".join(lhs.replace("...", "").split(","))
        out = "".join(ellipsis) + "".join(sorted(c for c in set(counts) if counts.count(c) == 1))
    return spelled, out


def _sum_labels(value, labels, keep):
    """`value` with the dims whose labels are not in `keep` summed out."""
    dims = [i for i, label in enumerate(labels) if label not in keep]
    if not dims:
        return value, labels
    return P.sum(value, dims), "".join(label for label in labels if label in keep)


def _contract(a, la, b, lb, keep, sizes):
    """The product of einsum operands a and b (labels la, lb), summed over the labels they share
    that `keep` has not: a batched matrix product over (shared kept, a's own, shared summed) and
    (shared kept, shared summed, b's own), or a broadcast product where nothing is summed."""
    a, la = _sum_labels(a, la, keep | set(lb))
    b, lb = _sum_labels(b, lb, keep | set(la))
    batch = [x for x in la if x in lb and x in keep]
    summed = [x for x in la if x in lb and x not in keep]
    own_a, own_b = [x for x in la if x not in lb], [x for x in lb if x not in la]
    if not summed:
        labels = batch + own_a + own_b
        return P.mul(_arranged(a, la, labels), _arranged(b, lb, labels)), "".join(labels)

    def grouped(x, labels, parts):  # x's dims permuted and merged into one dim per part
        dims = [d for part in parts for d in part]
        x = P.expand(P.permute(x, [labels.index(d) for d in dims]), [sizes[d] for d in dims])
        return P.reshape(x, [math.prod(sizes[d] for d in part) for part in parts])
    lead = [batch] if batch else []
    a2, b2 = grouped(a, la, lead + [own_a, summed]), grouped(b, lb, lead + [summed, own_b])
    product = bmm(a2, b2) if batch else mm(a2, b2)
    return P.reshape(product, [sizes[x] for x in batch + own_a + own_b]), "".join(batch + own_a + own_b)


def _arranged(x, labels, order):
    """`x` (dims labelled `labels`) permuted into `order`'s relative order, with size-1 dims where
    it lacks order's labels (a broadcast operand of a product)."""
    x = P.permute(x, sorted(range(len(labels)), key=lambda i: order.index(labels[i])))
    return P.reshape(x, [x.shape[sorted(labels, key=order.index).index(o)] if o in labels else 1 for o in order])
