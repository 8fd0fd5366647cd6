"""Attention as one call: softmax(Q K^T * scale) V in a primitive graph becomes one `sdpa` extern
(torch's scaled_dot_product_attention: flash attention on a GPU, no L x S scores in memory and no
Triton kernel to compile).

Matched on primitives, where torch.softmax and a softmax written by hand (amax, sub, exp, sum,
div) are the same nodes:

    bmm(reshape(probs), reshape(v))            (reshapes merge batch dims; none for 3-d inputs)
    probs  = convert*(exp(x - amax(x, -1)) / sum(exp(...), -1))
    x      = convert* / mul or div by a constant*, in any order, of
    scores = reshape(bmm(reshape(q), reshape(permute(k, last two dims swapped))))

It is rewritten only where SDPA computes the same function (up to rounding: SDPA keeps the
scores in fp32, so an fp16 Q Kᵀ that overflows in eager does not there): every node it replaces is
used only inside the pattern (no scores or probabilities returned or reused), the softmax is over
the last dim and subtracts its max, the scale is positive (flash attention subtracts the scaled
row max of the unscaled scores), q, k and v share batch dims (no broadcasting) and a dtype SDPA
takes, no size is 0, and the casts in between go to that dtype or wider floats (a cast to a
narrower type would round or overflow where SDPA does not). A mask added to the scores, dropout on the
probabilities or any other op in between is not part of the pattern: such graphs stay as they are.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import builder as P
from . import primitives as prim
from .builder import TVal, emit
from .decompositions.conventions import is_half
from .decompositions.linalg import matmul
from .decompositions.registry import Unsupported, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _NoMatch(Exception):
    pass


def _expect(cond):
    if not cond:
        raise _NoMatch


def _shape(node):
    return tuple(node.meta["val"].shape)


def _constant(a):
    return isinstance(a, (int, float)) and not isinstance(a, bool)


class _Match:
    def __init__(self):
        self.nodes: set[fx.Node] = set()  # what the rewrite removes
        self.casts: set[torch.dtype] = set()

    def op(self, node, p):
        _expect(isinstance(node, fx.Node) and node.target is p)
        self.nodes.add(node)
        return node

    def batched(self, node, ndim):
        """The ndim-d value that a bmm operand or result reshapes (batch dims merged into one)."""
        if ndim == 3:
            return node
        x = self.op(node, prim.reshape).args[0]
        _expect(isinstance(x, fx.Node) and len(_shape(x)) == ndim and _shape(x)[-2:] == _shape(node)[-2:])
        return x

    def row_reduction(self, node, p, x):
        """`node` is p(x) over the last dim, kept as (..., 1), through reshapes and casts (a half
        sum is computed in fp32)."""
        _expect(isinstance(node, fx.Node))
        shape = _shape(node)
        while node.target in (prim.reshape, prim.convert, prim.stop_gradient):  # (softmax's max has none)
            node = self.casts_of(node) if node.target is prim.convert else self.op(node, node.target).args[0]
        self.op(node, p)
        _expect(self.casts_of(node.args[0]) is self.casts_of(x) and node.args[1] == (len(shape) - 1,)
                and _shape(node) == shape)

    def casts_of(self, node):
        while isinstance(node, fx.Node) and node.target is prim.convert:
            self.casts.add(node.meta["val"].dtype)
            node = self.op(node, prim.convert).args[0]
        return node


def _match(pv: fx.Node):
    """(q, k, v, scale, root, nodes) if bmm `pv` ends an attention SDPA computes exactly."""
    m = _Match()
    m.op(pv, prim.bmm)
    probs3, v3 = pv.args
    ndim = len(_shape(probs3.args[0])) if isinstance(probs3, fx.Node) and probs3.target is prim.reshape else 3
    ndim = max(ndim, 3)
    probs, v = m.batched(probs3, ndim), m.batched(v3, ndim)
    root = pv
    if ndim > 3:
        _expect(len(pv.users) == 1)
        root = m.op(next(iter(pv.users)), prim.reshape)

    div = m.op(m.casts_of(probs), prim.div)
    e, total = div.args
    m.row_reduction(total, prim.sum, m.op(e, prim.exp))
    x, row_max = m.op(e.args[0], prim.sub).args
    _expect(isinstance(x, fx.Node))
    m.row_reduction(row_max, prim.amax, x)

    scale, node = 1.0, m.casts_of(x)
    while node.target in (prim.mul, prim.div):
        a, b = node.args
        if node.target is prim.mul and _constant(a) != _constant(b):
            c, rest = (a, b) if _constant(a) else (b, a)
            scale *= c
        elif node.target is prim.div and _constant(b) and b != 0 and isinstance(a, fx.Node):
            rest, scale = a, scale / b
        else:
            break
        m.nodes.add(node)
        node = m.casts_of(rest)
    scores = node
    qk = m.op(scores, prim.reshape).args[0] if ndim > 3 else scores
    q3, kt3 = m.op(qk, prim.bmm).args
    q, kt = m.batched(q3, ndim), m.batched(kt3, ndim)
    _expect(m.op(kt, prim.permute).args[1] == tuple(range(ndim - 2)) + (ndim - 1, ndim - 2))
    k = kt.args[0]

    _expect(all(isinstance(n, fx.Node) and n not in m.nodes for n in (q, k, v)))
    qv, kv, vv = vals = [n.meta["val"] for n in (q, k, v)]
    _expect(all(isinstance(t, torch.Tensor) and t.dtype == qv.dtype and t.ndim == ndim and t.numel() for t in vals))
    _expect(qv.dtype in _DTYPES and m.casts <= {qv.dtype, torch.float32, torch.float64})
    _expect(qv.shape[:-2] == kv.shape[:-2] == vv.shape[:-2] and kv.shape[-1] == qv.shape[-1]
            and vv.shape[-2] == kv.shape[-2])
    _expect(_shape(scores) == _shape(probs) == tuple(qv.shape[:-1]) + (kv.shape[-2],)
            and _shape(qk)[-2:] == _shape(scores)[-2:])
    _expect(_shape(root) == tuple(qv.shape[:-1]) + (vv.shape[-1],) and root.meta["val"].dtype == qv.dtype)
    _expect(math.isfinite(scale) and scale > 0)  # flash subtracts max(s) * scale: a row's max only if scale > 0
    _expect(all(u in m.nodes for n in m.nodes - {root} for u in n.users))
    return q, k, v, float(scale), root, m.nodes


def _differentiated(graph: fx.Graph, requires_grad) -> set:
    """The nodes of `graph` a gradient flows through (`requires_grad`: per placeholder)."""
    grad = {n for n, rg in zip((n for n in graph.nodes if n.op == "placeholder"), requires_grad) if rg}
    for n in graph.nodes:
        if n.op == "call_function" and any(a in grad for a in n.all_input_nodes):
            grad.add(n)
    return grad


def rewrite_attention(graph: fx.Graph, device, requires_grad=()) -> None:
    """Replace every attention in `graph` (a graph for `device`, `requires_grad` per placeholder
    where it is differentiated) that SDPA computes exactly by one `sdpa` node.

    Not where a gradient flows through a half-precision one: the fused backward's row term
    sum(dO * O) reads the output rounded to half, an error common to every key of the row that
    dQ = sum_j dS_j k_j sums coherently where keys share a mean (LayerNorm'd tokens, a key bias):
    dQ 10-60x further from float64 than eager's softmax backward, whose sum(P * dP) is exact
    to the same rounded dP (MobileViT's query/key gradients)."""
    grad = _differentiated(graph, requires_grad)
    removed: set[fx.Node] = set()
    for pv in [n for n in graph.nodes if n.target is prim.bmm]:
        if pv in removed:
            continue
        try:
            q, k, v, scale, root, nodes = _match(pv)
        except _NoMatch:
            continue
        if q.meta["val"].dtype in (torch.float16, torch.bfloat16) and grad.intersection((q, k, v)):
            continue
        with graph.inserting_before(root):
            new = graph.call_function(prim.sdpa, (q, k, v), {"scale": scale})
        new.meta["val"] = prim.sdpa_meta(q.meta["val"], k.meta["val"], v.meta["val"], scale=scale, device=device)
        new.meta["loc"] = pv.meta.get("loc")
        root.replace_all_uses_with(new)
        for n in reversed([n for n in graph.nodes if n in nodes]):
            graph.erase_node(n)
        removed |= nodes


def save_attention_statistics(graph: fx.Graph, device, requires_grad) -> None:
    """A graph to be differentiated (`requires_grad`: per placeholder): each `sdpa` that a fused
    CUDA kernel runs becomes `sdpa_saving`, whose logsumexp the backward reads
    (F.scaled_dot_product_attention returns none, and its backward ran the forward again: GPT-2's
    12 layers, ~0.7 ms of host a layer through torch's autograd). A mask with a gradient of its
    own (a trained relative position bias) takes torch's kernel for a mask that requires grad; only
    efficient attention's backward gives it (the others run as torch's autograd does)."""
    grad = _differentiated(graph, requires_grad)
    for n in [n for n in graph.nodes if n.target is prim.sdpa]:
        q, k, v = (a.meta["val"] for a in n.args)
        options = dict(n.kwargs)
        metas = {name: o.meta["val"] if isinstance(o, fx.Node) else o for name, o in options.items()}
        mask_grad = options.get("attn_mask") in grad
        backend = prim.saving_backend(q, k, v, metas.get("attn_mask"), metas.get("is_causal", False),
                                      metas.get("scale"), device, mask_grad=mask_grad)
        if backend is None or mask_grad and backend != 2:
            continue
        with graph.inserting_before(n):
            saving = graph.call_function(prim.sdpa_saving, n.args, {**options, "backend": backend})
            out = graph.call_function(prim.item, (saving, 0))
        saving.meta.update(val=prim.sdpa_saving(q, k, v, **metas, backend=backend), loc=n.meta.get("loc"))
        out.meta.update(val=saving.meta["val"][0], loc=n.meta.get("loc"))
        n.replace_all_uses_with(out)
        graph.erase_node(n)


@register(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """One `sdpa` call, its result and gradients predicted in the layouts the device's kernel
    returns. A boolean mask enters as the additive bias torch makes of it (_bias_of); an additive
    (float) mask of the query's dtype as it is (a relative position bias: with a gradient of its
    own, ops/vjp.py). Grouped-query heads (enable_gqa, or K and V repeated by HF's repeat_kv): the
    query heads of each key/value head folded into rows of one head (_fold_groups), else each
    key/value head repeated for its group (as torch's math path does). Dropout stays a plain call
    of torch's function."""
    if dropout_p or not all(isinstance(t, TVal) for t in (query, key, value)) or \
            attn_mask is not None and not (isinstance(attn_mask, TVal) and attn_mask.dtype in (torch.bool, query.dtype)):
        raise Unsupported("dropout, or a mask of another dtype")
    groups = None
    if enable_gqa and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
        if query.shape[-3] % key.shape[-3] or key.shape[-3] != value.shape[-3]:
            raise Unsupported("grouped-query heads that do not divide the query's")  # (eager raises)
        groups = key, value, query.shape[-3] // key.shape[-3]
    elif (repeated := _repeated_heads(key)) and (rv := _repeated_heads(value)) and repeated[1] == rv[1]:
        groups = repeated[0], rv[0], repeated[1]  # HF's repeat_kv of both
    unfold = None
    if groups is not None:
        folded = _fold_groups(query, *groups, attn_mask, is_causal)
        if folded is not None:
            query, key, value, attn_mask, unfold = folded
        elif enable_gqa:
            key, value = (_repeat_heads(t, groups[2]) for t in groups[:2])
    if attn_mask is not None:
        if attn_mask.shape[-1] > 1 and attn_mask.val.stride(-1) == 0:
            # a mask broadcast along its rows (HF's come so) is stored whole for the kernel, and
            # torch picks its kernel by the mask's layout (CUDA's efficient attention takes none
            # whose rows are not contiguous): decided, and the result predicted, for the layout
            # the kernel gets. (One broadcast over batch or heads only is taken as it is.)
            whole = P.builder().memo.setdefault("attention_mask", {})  # (one for every layer)
            if attn_mask.node not in whole:
                whole[attn_mask.node] = P.copy(attn_mask, torch.contiguous_format)
            attn_mask = whole[attn_mask.node]
        if attn_mask.dtype == torch.bool:
            attn_mask = _bias_of(attn_mask, query, key, value, is_causal, scale)
    options = {name: o for name, o in (("attn_mask", attn_mask), ("is_causal", is_causal), ("scale", scale))
               if o is not None and o is not False}
    meta = {name: o.val if isinstance(o, TVal) else o for name, o in options.items()}
    b = P.builder()
    mask_grad = attn_mask is not None and b.needs_grad(attn_mask)
    if (mask_grad or b.needs_grad(query, key, value)) and prim.sdpa_choice(
            query.val, key.val, value.val, meta.get("attn_mask"), is_causal, scale, b.device, True, mask_grad) == 0:
        out = _math_attention(query, key, value, attn_mask, is_causal, scale)
    else:
        out = emit(prim.sdpa, query, key, value, **options,
                   _val=prim.sdpa_meta(query.val, key.val, value.val, **meta, device=b.device))
    return out if unfold is None else P.reshape(out, unfold)


def _math_attention(q: TVal, k: TVal, v: TVal, mask, is_causal, scale):
    """A trained attention that torch's chooser gives its math path (a mask with a gradient of its
    own, T5's relative position bias, on an H200), as that path computes it (ATen's
    _scaled_dot_product_attention_math): half inputs in fp32 unless torch allows half reductions,
    q and k each scaled by the scale's square root, the mask added, a softmax that gives a row of
    only -inf zeros (_safe_softmax), the product with v rounded once. Its gradients are then the
    primitives' own, in fp32 as eager's: a fused kernel's backward rounds P and dS to half (mT5's
    q and k gradients twice as far from float64 as eager's)."""
    dtype = q.dtype
    if is_half(dtype) and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = (P.cast(t, torch.float32) for t in (q, k, v))
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    scores = matmul(P.mul(q, root), P.mul(P.transpose(k, -2, -1), root))
    if is_causal:
        rows, cols = q.shape[-2], k.shape[-2]
        mask = P.ge(P.reshape(P.iota(rows), (rows, 1)), P.reshape(P.iota(cols), (1, cols)))
    if mask is not None:
        if mask.dtype == torch.bool:  # (ATen's convert_boolean_attn_mask, in the scores' dtype)
            mask = P.where(mask, P.full((), 0.0, scores.dtype), P.full((), -math.inf, scores.dtype))
        scores = P.add(scores, mask)
    fixed = emit(prim.stop_gradient, scores)  # (the probabilities' value; their gradient below)
    row_max = P.amax(fixed, -1, True)
    e = P.exp(P.sub(fixed, row_max))
    probs = P.where(P.eq(row_max, -math.inf), 0.0, P.div(e, P.sum(e, -1, True)))
    # softmax's VJP from its result alone, as eager's _softmax_backward_data: p (g - sum(g p)) is the
    # VJP of p x - p sum(p x) at x = scores, p held fixed. The backward then reads the probabilities
    # that the product with v saves anyway, not the fp32 scores as well ([B, H, L, S] each: T5-small
    # training's peak 2707 -> 3096 MB with both)
    p = emit(prim.stop_gradient, probs)
    route = P.sub(P.mul(p, scores), P.mul(p, P.sum(P.mul(p, scores), -1, True)))
    return P.cast(matmul(emit(prim.with_value, route, probs), v), dtype)


def _repeated_heads(t: TVal):
    """(x, n) where `t` is x [..., H, S, D] with each head repeated n times in place, as HF's
    repeat_kv spells it (x[:, :, None].expand(..., H, n, S, D).reshape(..., H * n, S, D)), else None."""
    r = t.node
    if r.target is not prim.reshape or not isinstance(e := r.args[0], fx.Node) or e.target is not prim.expand:
        return None
    x = e.args[0]
    xs, es = tuple(x.meta["val"].shape), tuple(e.meta["val"].shape)
    if len(xs) < 5 or len(es) != len(xs) or xs[-3] != 1 or xs[:-3] != es[:-3] or xs[-2:] != es[-2:] \
            or t.shape != (*es[:-4], es[-4] * es[-3], *es[-2:]):
        return None
    shape = (*xs[:-3], *xs[-2:])
    if x.target is prim.reshape and tuple((base := x.args[0]).meta["val"].shape) == shape:
        return TVal(base, base.meta["val"]), es[-3]
    return P.reshape(TVal(x, x.meta["val"]), shape), es[-3]


def _viewable(t: TVal, shape) -> bool:
    try:
        t.val.view(shape)
        return True
    except RuntimeError:
        return False


def _fold_groups(query: TVal, key: TVal, value: TVal, n: int, mask, is_causal):
    """Grouped-query attention without repeating K and V: query [..., H * n, L, D] read as
    [..., H, n * L, D] (each key/value head's n query heads as more rows) against key and value
    [..., H, S, D]; the mask folded the same way. (query, key, value, mask, the result's shape) or
    None where that is not the same function (a causal mask aligns rows by position: folding moves
    them) or materialises more than the repeat would (a copy of q that is no view, a mask expanded
    over the group: bytes against the n-fold copies of K and V)."""
    *lead, hq, rows, _ = query.shape
    h = hq // n
    if is_causal or query.ndim < 3 or key.shape[:-3] != tuple(lead) or value.shape[:-3] != tuple(lead):
        return None
    q_shape = (*lead, h, n * rows, query.shape[-1])
    cost = 0 if _viewable(query, q_shape) else query.numel() * query.val.element_size()
    if mask is not None:
        m = (1,) * (query.ndim - mask.ndim) + mask.shape
        *mlead, mh, ml, s = m
        if mh == 1 and ml == 1:
            shape = None  # the same row for every query row: it broadcasts as it is
        elif mh == 1 or mh == hq:
            shape = (*mlead, 1 if mh == 1 else h, n * rows, s)
            if not (mh == hq and ml == rows and _viewable(mask, shape)):
                cost += math.prod(shape) * mask.val.element_size()
        else:
            return None
    if cost >= n * (key.numel() * key.val.element_size() + value.numel() * value.val.element_size()):
        return None
    if mask is not None and shape is not None:
        folds = P.builder().memo.setdefault("grouped_mask", {})  # (one for every layer)
        if (mask.node, shape) not in folds:
            whole = P.reshape(mask, m)
            grouped = (*mlead, 1, n, rows, s) if mh == 1 else (*mlead, h, n, rows, s)
            folds[mask.node, shape] = P.reshape(
                P.expand(P.reshape(whole, (*mlead, 1 if mh == 1 else h, 1 if mh == 1 else n, ml, s)), grouped), shape)
        mask = folds[mask.node, shape]
    return P.reshape(query, q_shape), key, value, mask, (*lead, hq, rows, value.shape[-1])


def _repeat_heads(t: TVal, n: int) -> TVal:
    """t [..., H, S, D] with each head repeated n times in place: [..., H * n, S, D]."""
    *lead, h, s, d = t.shape
    return P.reshape(P.expand(P.unsqueeze(t, -3), (*lead, h, n, s, d)), (*lead, h * n, s, d))


def _bias_of(mask: TVal, q: TVal, k: TVal, v: TVal, is_causal, scale):
    """The additive bias F.scaled_dot_product_attention makes of the boolean `mask` on each call
    (0 where a key is kept, -inf where hidden, in q's dtype; cuDNN's attention has a fill of its
    own, prim._cudnn_mask_fill), made once in the graph instead: one pass fused with the mask's
    own computation and shared by every layer, where torch's conversion was three kernel launches
    a layer on a GPU. Kept boolean where the kernel torch picks could differ: a bias that changes
    torch's choice, or fills that differ between an inference's and a training's choice."""
    b = P.builder()
    bias_meta = torch.empty_like(mask.val, dtype=q.dtype)  # (laid out as the `where` below lays it out)
    fills = set()
    for grad in (False, True):
        backends = {prim.sdpa_backend(q.val, k.val, v.val, m, is_causal, scale, b.device, grad=grad)
                    for m in (mask.val, bias_meta)}
        if len(backends) > 1:
            return mask
        fills.add(prim._cudnn_mask_fill(b.device) if backends == {3} else -math.inf)
    if len(fills) > 1:
        return mask
    (fill,) = fills
    biases = b.memo.setdefault("attention_bias", {})
    if (mask.node, q.dtype, fill) not in biases:
        biases[mask.node, q.dtype, fill] = P.where(mask, P.full((), 0.0, q.dtype), P.full((), fill, q.dtype))
    return biases[mask.node, q.dtype, fill]
