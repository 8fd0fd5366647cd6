"""Real models through fuselens on a CUDA machine: equal to eager, and graphs/breaks beside
torch.compile's (Dynamo's explain).

    PYTHONPATH=compiler python bench/models.py [--models resnet50,vit_b_16] [--modes eval,train]
                                               [--json out.json]

Random weights from each library's own constructor (torchvision, timm, transformers: whichever
are installed), batch 2. Eval: the outputs under no_grad. Train: outputs, the loss's gradients
of every parameter and the running statistics after one step, with dropout and drop-path off
(their random numbers are not eager's). Matmuls and convolutions in fp32 without TF32, so
differences are summation order only: the table gives the relative error ||got - want|| / ||want||
of the worst tensor (||want|| at least 1e-6 of the largest gradient's: gradients that are zero in
exact arithmetic, such as a bias before a training-mode BatchNorm, are rounding noise in both),
and `ok` where it is under 1e-4 (outputs) or 1e-3 (gradients).
"""
from __future__ import annotations

import argparse
import copy
import json
import time
import traceback
import warnings

import torch

import fuselens

VISION = {
    "resnet50": ("torchvision", "resnet50"), "mobilenet_v3_large": ("torchvision", "mobilenet_v3_large"),
    "efficientnet_b0": ("torchvision", "efficientnet_b0"), "convnext_tiny": ("torchvision", "convnext_tiny"),
    "vit_b_16": ("torchvision", "vit_b_16"), "swin_t": ("torchvision", "swin_t"),
    "timm_resnet50": ("timm", "resnet50"), "timm_vit_base": ("timm", "vit_base_patch16_224"),
    "timm_convnext_tiny": ("timm", "convnext_tiny"),
}


def build(name):
    lib, ctor = VISION[name]
    if lib == "torchvision":
        import torchvision
        m = getattr(torchvision.models, ctor)()
    else:
        import timm
        m = timm.create_model(ctor, pretrained=False)
    return m, (torch.randn(2, 3, 224, 224),)


def no_dropout(m):
    for mod in m.modules():
        kind = type(mod).__name__
        if "Dropout" in kind or "DropPath" in kind or "StochasticDepth" in kind:
            for attr in ("p", "drop_prob"):
                if hasattr(mod, attr):
                    setattr(mod, attr, 0.0)


def rel(got, want, floor=1e-30) -> float:
    """||got - want|| / ||want||, ||want|| taken as at least `floor`: a gradient that is zero in
    exact arithmetic (a bias before a training-mode BatchNorm) is rounding noise in both."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(floor)).item()


def outputs(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict) or hasattr(v, "values"):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in outputs(x)]
    return []


def step(model, inputs, train):
    if not train:
        with torch.no_grad():
            return outputs(model(*inputs)), [], []
    out = outputs(model(*inputs))
    sum(o.float().sum() for o in out if o.is_floating_point()).backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    stats = [(n, b) for n, b in model.named_buffers() if "running" in n]
    return [o.detach() for o in out], grads, stats


def check(name, train, device):
    torch.manual_seed(0)
    m, inputs = build(name)
    m = m.to(device).train(train)
    no_dropout(m)
    ref = copy.deepcopy(m)
    inputs = tuple(x.to(device) for x in inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.time()
        got = step(fuselens.compile(m), inputs, train)
        first_s = time.time() - t
    want = step(ref, inputs, train)
    fallbacks = sorted({str(w.message)[:160] for w in caught if w.category is fuselens.FuselensWarning})
    err_out = max([rel(a, b) for a, b in zip(got[0], want[0])] or [0.0])
    floor = 1e-6 * max([b.double().norm().item() for _, b in want[1] if b is not None] or [0.0])
    errs = [(rel(a, b, floor), n) for (n, a), (_, b) in zip(got[1] + got[2], want[1] + want[2])]
    err_grad, worst = max(errs, default=(0.0, None))
    mm = copy.deepcopy(ref).eval() if not train else copy.deepcopy(ref)
    with torch.no_grad() if not train else torch.enable_grad():
        ex = fuselens.explain(mm, *inputs)
        dyn = torch._dynamo.explain(copy.deepcopy(ref))(*inputs)
    torch._dynamo.reset()
    return {
        "model": name, "mode": "train" if train else "eval", "first_call_s": round(first_s, 1),
        "rel_err_out": err_out, "rel_err_grad": err_grad, "worst_grad": worst,
        "ok": err_out < 1e-4 and err_grad < 1e-3 and not fallbacks,
        "graphs": len(ex.graphs), "breaks": len(ex.graph_breaks),
        "break_codes": sorted({b.code for b in ex.graph_breaks}),
        "break_details": sorted({f"{b.code} {b.filename.split('/')[-1]}:{b.line} {b.detail[:100]}"
                                 for b in ex.graph_breaks}),
        "dynamo_graphs": dyn.graph_count, "dynamo_breaks": dyn.graph_break_count,
        "fallbacks": fallbacks,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(VISION))
    ap.add_argument("--modes", default="eval,train")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in a.models.split(","):
        for mode in a.modes.split(","):
            try:
                rows.append(check(name, mode == "train", a.device))
            except Exception as e:  # noqa: BLE001 (a model that cannot be built or run: say why)
                traceback.print_exc()
                rows.append({"model": name, "mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"[:200]})
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'model':22} {'mode':5} {'ok':3} {'out err':>8} {'grad err':>8} {'graphs':>6} {'breaks':>6} "
          f"{'dynamo g/b':>10} {'1st s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:22} {r['mode']:5} ERR {r['error'][:80]}")
            continue
        print(f"{r['model']:22} {r['mode']:5} {'yes' if r['ok'] else 'NO':3} {r['rel_err_out']:8.1e} "
              f"{r['rel_err_grad']:8.1e} {r['graphs']:6} {r['breaks']:6} "
              f"{r['dynamo_graphs']:>4}/{r['dynamo_breaks']:<5} {r['first_call_s']:6.1f}")
        for fb in r["fallbacks"]:
            print(f"{'':28} fallback: {fb}")
        for b in r["break_details"]:
            print(f"{'':28} break: {b}")
        if not r["ok"] and r["worst_grad"]:
            print(f"{'':28} worst gradient: {r['worst_grad']}")


if __name__ == "__main__":
    main()
