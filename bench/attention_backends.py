"""Which fused attention kernel each F.scaled_dot_product_attention call of a suite model takes in
eager (torch's chooser asked with the call's own tensors: strides, the mask's dtype after autocast,
requires_grad) against what fuselens predicts for a trained attention from tensors of the same
layouts (ops/primitives.py `saving_backend`). A difference means the prediction's inputs (grad
flags, the mask's dtype) are not eager's; agreement here while fuselens's step runs another kernel
(its profile) means the graph lays q, k, v or the mask out otherwise than eager does (mT5's row,
bench/NOTES.md 77).

    PYTHONPATH=compiler python bench/attention_backends.py mt5_small,swin_tiny [--batch 16] [--calls]

Backends: 0 math, 1 flash, 2 efficient, 3 cuDNN (torch's SDPBackend ids); fuselens's None: math
or torch's own call (a mask with a gradient that efficient attention does not give).
"""
from __future__ import annotations

import argparse
from collections import Counter
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from suite import build  # noqa: E402

from fuselens.ops import primitives as prim  # noqa: E402


def eager_choices(name, batch, device):
    """Per SDPA call of one eager training step: (q shape, q strides, mask facts, q grad, torch's
    choice, fuselens's prediction from those same tensors)."""
    model, args, kwargs = build(name, "train", "bf16", device, batch)
    calls, original = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None
        cast = (lambda t: t.to(dtype) if t is not None and t.is_floating_point() and dtype else t)  # noqa: E731
        q2, k2, v2, m2 = (cast(t) for t in (q, k, v, attn_mask))
        eager = int(torch._fused_sdp_choice(q2, k2, v2, m2, dropout_p, is_causal, scale=scale))
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if t is not None else None
                for t in (q2, k2, v2, m2)]
        predicted = prim.saving_backend(*meta, is_causal, scale, device,
                                        mask_grad=m2 is not None and m2.requires_grad)
        calls.append((tuple(q.shape), tuple(q2.stride()), None if m2 is None else (tuple(m2.shape), tuple(m2.stride()),
                      str(m2.dtype), m2.requires_grad), q.requires_grad, eager, predicted))
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = torch.nn.functional.scaled_dot_product_attention = recorded
    try:
        model(*args, **kwargs)
    finally:
        F.scaled_dot_product_attention = original
    return calls


def fuselens_choices(name, batch, device):
    """The backend of each trained attention of fuselens's graphs of one training step (from the
    graph's own layouts: ops/attention.py save_attention_statistics)."""
    import fuselens
    from suite import Step
    model, args, kwargs = build(name, "train", "bf16", device, batch)
    chosen, original = [], prim.saving_backend

    def spy(q, k, v, mask, *a, **kw):
        backend = original(q, k, v, mask, *a, **kw)
        chosen.append((None if mask is None else (tuple(mask.stride()), kw.get("mask_grad")), backend))
        return backend

    prim.saving_backend = spy
    try:
        Step(fuselens.compile(model), "train", args, kwargs)()
    finally:
        prim.saving_backend = original
    return chosen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", help="suite rows, comma-separated")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", action="store_true", help="every call of eager's step, not only the counts")
    ap.add_argument("--fuselens", help="rows whose fuselens graphs' choices to count too (a compile each)", default="")
    a = ap.parse_args()
    for name in a.models.split(","):
        try:
            calls = eager_choices(name, a.batch, a.device)
        except Exception as e:  # (a row torch cannot build here: the others still print)
            print(f"{name}: {type(e).__name__}: {e}"[:200], flush=True)
            continue
        if a.calls:
            print(f"{'q shape':22} {'q strides':26} {'mask (shape, strides, dtype, grad)':58} grad eager fuselens")
            for shape, stride, mask, grad, eager, predicted in calls:
                flag = "" if predicted in (eager, None) or predicted == "cpu" else "  <- differs"
                print(f"{str(shape):22} {str(stride):26} {str(mask):58} {grad!s:5} {eager:5} {predicted!s:8}{flag}")
        eager = Counter((c[2] is not None and c[2][3], c[4]) for c in calls)
        line = f"{name}: eager (mask grad, backend) {dict(eager)}"
        if name in a.fuselens.split(","):
            graph = Counter((m is not None and bool(m[1]), b) for m, b in fuselens_choices(name, a.batch, a.device))
            line += f"; fuselens's graphs {dict(graph)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
