"""Decode attention: fuselens's own Triton kernel for an `sdpa` call with few query rows (a decode
step's one token, grouped-query heads folded into rows by ops/attention.py `_fold_groups`).

cuDNN's and flash attention's kernels tile the queries by 64 or 128 rows: with 4 rows a head they
compute mostly padding, and cuDNN's pick for a 1B Llama's decode step took 10.3 us a layer on an
H200 (bench/NOTES.md). Here one program holds every query row of one (batch, head) pair, reads
that head's keys and values once in blocks of BLOCK_S positions and keeps an online softmax
(running max and sum, in fp32) with the weighted sum of values; the mask (an additive bias or a
boolean one, broadcast as given) is read per block. No L x S scores in memory, no mask copy.

`applies` decides from the call's operands (shapes, strides, dtypes: known when the wrapper is
written); `decode_attention` allocates the result in the layout the lowering predicted and
launches the kernel through launcher.TritonKernel (cubins compiled and cached as the generated
kernels' are; Triton's interpreter on a CPU under FUSELENS_INTERPRET=1).
"""
from __future__ import annotations

import functools
import math

import torch

from .. import settings
from .launcher import TritonKernel

# query rows of one (batch, head) pair at most (tl.dot's blocks hold at least 16)
MAX_ROWS = 16
BLOCK_S = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def applies(q, k, v, mask, is_causal, out) -> bool:
    """Whether sdpa(q, k, v, mask) with result `out` runs this kernel: 4-d q, k, v of one float
    dtype and equal batch and head dims, their last dims and the result's contiguous, at most
    MAX_ROWS query rows, a head dim that is a power of two from 16 to 256, no causal flag (torch
    aligns its mask top-left: not a decode step's), a mask (bool, or of q's dtype) that broadcasts
    to (B, H, L, S). Operands are the lowering's Views, `out` its buffer."""
    views = [q, k, v] + ([mask] if mask is not None else [])
    if is_causal or not all(len(t.shape) == 4 for t in (q, k, v)) or len(mask.shape if mask is not None else ()) > 4 \
            or not all(isinstance(n, int) for t in views for n in (*t.shape, *t.stride)):
        return False
    (b, h, rows, d), (kb, kh, s, kd), (vb, vh, vs, dv) = (tuple(t.shape) for t in (q, k, v))
    if not rows or q.buf.dtype not in _DTYPES or {k.buf.dtype, v.buf.dtype} != {q.buf.dtype} or \
            (b, h) != (kb, kh) or (b, h) != (vb, vh) or s != vs or kd != d or dv != d or \
            rows > MAX_ROWS or not s or d < 16 or d > 256 or d & (d - 1) or \
            any(t.stride[-1] != 1 for t in (q, k, v)) or tuple(out.shape) != (b, h, rows, d) or out.stride[-1] != 1:
        return False
    if mask is not None:
        if mask.buf.dtype not in (torch.bool, q.buf.dtype):
            return False
        shape = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        if any(m not in (1, n) for m, n in zip(shape, (b, h, rows, s))):
            return False
    return True


_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def {name}(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, scale, H, L, S, CHUNK, qsb, qsh, qsl, ksb, ksh, kss, vsb, vsh, vss, msb, msh, msl, mss, osb, osh, osl, xnumel, XBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bh = pid // {splits}
    b = bh // H
    h = bh % H
    rows = tl.arange(0, {rows})
    cols = tl.arange(0, {d})
    row_mask = rows < L
    q = tl.load(q_ptr + b * qsb + h * qsh + rows[:, None] * qsl + cols[None, :], mask=row_mask[:, None], other=0.0)
    m_i = tl.full([{rows}], float("-inf"), tl.float32)
    l_i = tl.zeros([{rows}], tl.float32)
    acc = tl.zeros([{rows}, {d}], tl.float32)
    first = (pid % {splits}) * CHUNK
    for start in range(first, tl.minimum(S, first + CHUNK), {block_s}):
        pos = start + tl.arange(0, {block_s})
        pos_mask = pos < S
        k = tl.load(k_ptr + b * ksb + h * ksh + pos[:, None] * kss + cols[None, :], mask=pos_mask[:, None], other=0.0)
        scores = tl.dot(q{operand}, tl.trans(k){operand}{precision}) * scale
        {mask}
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row masked so far: no inf - inf)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * vsb + h * vsh + pos[:, None] * vss + cols[None, :], mask=pos_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype){operand}, v{operand}{precision})
        m_i = m_new
    {store}
'''
# one split: the result (a row hiding every key is 0, as in torch's kernels); more: the split's
# partial [rows, d + 2] (weighted sum of values, running max, sum) into out_ptr, a workspace
_STORES = {
    True: '''out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    tl.store(out_ptr + b * osb + h * osh + rows[:, None] * osl + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])''',
    False: '''part = out_ptr + (pid * {rows} + rows) * ({d} + 2)
    tl.store(part[:, None] + cols[None, :], acc)
    tl.store(part + {d}, m_i)
    tl.store(part + {d} + 1, l_i)''',
}
# the partials of one (batch, head) pair's splits combined, each weighted by exp(its max - the max)
_COMBINE = '''
import triton
import triton.language as tl


@triton.jit
def {name}(ws_ptr, out_ptr, H, L, osb, osh, osl, xnumel, XBLOCK: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    rows = tl.arange(0, {rows})
    cols = tl.arange(0, {d})
    m = tl.full([{rows}], float("-inf"), tl.float32)
    for i in range({splits}):
        m = tl.maximum(m, tl.load(ws_ptr + ((bh * {splits} + i) * {rows} + rows) * ({d} + 2) + {d}))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([{rows}, {d}], tl.float32)
    total = tl.zeros([{rows}], tl.float32)
    for i in range({splits}):
        part = ws_ptr + ((bh * {splits} + i) * {rows} + rows) * ({d} + 2)
        w = tl.exp(tl.load(part + {d}) - m_safe)
        total += tl.load(part + {d} + 1) * w
        acc += tl.load(part[:, None] + cols[None, :]) * w[:, None]
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)
    tl.store(out_ptr + b * osb + h * osh + rows[:, None] * osl + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=(rows < L)[:, None])
'''
_MASKS = {
    None: "",
    "bias": "scores += tl.load(mask_ptr + b * msb + h * msh + rows[:, None] * msl + pos[None, :] * mss, "
            "mask=row_mask[:, None] & pos_mask[None, :], other=0.0).to(tl.float32)",
    "bool": "scores = tl.where(tl.load(mask_ptr + b * msb + h * msh + rows[:, None] * msl + pos[None, :] * mss, "
            "mask=row_mask[:, None] & pos_mask[None, :], other=0) != 0, scores, float(\"-inf\"))",
}
def _kernel(rows, d, dtype, mask_kind, splits, programs) -> TritonKernel:
    """One call site's kernel (its launch, bound on the first call, is reused by the next)."""
    # fp32 operands: products in fp32, as eager's (tl.dot would take TF32). Triton's interpreter
    # multiplies bf16 blocks wrong (3.9: errors of 1e10): there they are fp32 (products of bf16
    # values are exact in fp32 either way)
    upcast = settings.INTERPRET and dtype == torch.bfloat16
    precision = ', input_precision="ieee"' if dtype == torch.float32 or upcast else ""
    name = "fl_decode_attention_0"
    source = _SOURCE.format(name=name, rows=rows, d=d, block_s=BLOCK_S, precision=precision, splits=splits,
                            operand=".to(tl.float32)" if upcast else "", mask=_MASKS[mask_kind],
                            store=_STORES[splits == 1].format(rows=rows, d=d))
    return _bound(TritonKernel(name, source, "template", itemsize=dtype.itemsize), programs)


def _combine(rows, d, splits, pairs) -> TritonKernel:
    name = "fl_decode_attention_combine_0"
    return _bound(TritonKernel(name, _COMBINE.format(name=name, rows=rows, d=d, splits=splits), "template"), pairs)


def _bound(kernel, programs):
    kernel.call_sizes = (programs,)
    return kernel


def splits_for(pairs, length, programs) -> int:
    """Splits of the positions for `pairs` (batch x head) programs on a GPU of `programs` SMs: as
    many as fill its SMs once, each at least BLOCK_S positions."""
    return max(1, min(-(-programs // pairs), -(-length // BLOCK_S)))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Plan:
    """How one call site's attention runs: kernels, their scalar arguments, the workspace."""

    def __init__(self, q, k, v, mask, scale, out_stride, splits):
        b, h, rows, d = q.shape
        length = k.shape[2]
        kind = None if mask is None else "bool" if mask.dtype == torch.bool else "bias"
        masks = mask.expand(b, h, rows, length).stride() if mask is not None else (0,) * 4
        splits = splits or (splits_for(b * h, length, _sm_count(q.device)) if q.is_cuda else 1)
        chunk = -(-length // (splits * BLOCK_S)) * BLOCK_S
        splits = -(-length // chunk)
        block_rows = max(16, 1 << (rows - 1).bit_length())
        self.programs, self.pairs = b * h * splits, b * h
        self.kernel = _kernel(block_rows, d, q.dtype, kind, splits, self.programs)
        self.scalars = (1.0 / math.sqrt(d) if scale is None else float(scale), h, rows, length, chunk,
                        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *masks, *out_stride[:3])
        self.combine = _combine(block_rows, d, splits, self.pairs) if splits > 1 else None
        self.combine_scalars = (h, rows, *out_stride[:3])
        self.workspace = self.programs * block_rows * (d + 2)


_PLANS: dict = {}


def decode_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, *, shape, stride, splits=None):
    """sdpa(q, k, v, attn_mask, scale) (`applies`: not causal), its result allocated as (shape,
    stride); the positions split `splits` ways (default: splits_for on a GPU, none elsewhere). A
    call costs a dict lookup of its layouts, the result's allocation and the launches (a decode
    step makes one a layer)."""
    mask = attn_mask
    key = (shape, stride, q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, scale, splits,
           None if mask is None else (mask.shape, mask.stride(), mask.dtype))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan(q, k, v, mask, scale, stride, splits)
    out = torch.empty_strided(shape, stride, dtype=q.dtype, device=q.device)
    ws = out if plan.combine is None else torch.empty(plan.workspace, dtype=torch.float32, device=q.device)
    args = (q, k, v, mask if mask is not None else q, ws, *plan.scalars)
    plan.kernel.launch(*args) or plan.kernel.run(*args, xnumel=plan.programs)
    if plan.combine is not None:
        plan.combine.launch(ws, out, *plan.combine_scalars) or \
            plan.combine.run(ws, out, *plan.combine_scalars, xnumel=plan.pairs)
    return out
