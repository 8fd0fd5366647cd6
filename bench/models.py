"""Real models through fuselens on a CUDA machine: two tables.

Correctness (issue 16): equal to eager, and graphs/breaks beside torch.compile's (Dynamo's explain).

    PYTHONPATH=compiler python bench/models.py [--models resnet50,hf_bert] [--modes eval,train] [--json out.json]

Random weights from each library's own constructor (torchvision, timm, transformers: whichever
are installed), batch 2; transformers models in tiny configs made by their own config classes.
Eval: the outputs under no_grad. Train: outputs, the loss's gradients of every parameter and the
running statistics after one step, with dropout and drop-path off (their random numbers are not
eager's). Matmuls and convolutions in fp32 without TF32, so differences are summation order only:
the table gives the relative error ||got - want|| / ||want|| of the worst tensor (||want|| at
least 1e-6 of the largest gradient's: gradients that are zero in exact arithmetic, such as a bias
before a training-mode BatchNorm, are rounding noise in both), and `ok` where it is under 1e-4
(outputs) or 1e-3 (gradients); a gradient beyond that still passes where it is as close to the
same step's float64 gradient as eager's is (within 2x: `vs_float64`).

Speed (issue 18): the six workloads of bench_speed.py, eager vs fuselens vs torch.compile
(Inductor), default and reduce-overhead modes; first calls in fresh processes.

    PYTHONPATH=compiler python bench/models.py --speed [--workloads a,b] [--json speed.json]
    PYTHONPATH=compiler python bench/models.py --cold [--workloads a,b] [--compilers eager,fuselens] [--json cold.json]
        [--keep-caches DIR] [--profile-first DIR]
    PYTHONPATH=compiler python bench/models.py --merge speed.json cold.json --json bench/results/models-speed-h100.json
    PYTHONPATH=compiler python bench/models.py --profile resnet50_fp32_infer
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fuselens  # noqa: E402

VISION = {
    "resnet50": ("torchvision", "resnet50"), "mobilenet_v3_large": ("torchvision", "mobilenet_v3_large"),
    "efficientnet_b0": ("torchvision", "efficientnet_b0"), "convnext_tiny": ("torchvision", "convnext_tiny"),
    "vit_b_16": ("torchvision", "vit_b_16"), "swin_t": ("torchvision", "swin_t"),
    "timm_resnet50": ("timm", "resnet50"), "timm_vit_base": ("timm", "vit_base_patch16_224"),
    "timm_convnext_tiny": ("timm", "convnext_tiny"),
}
HF = ["hf_bert", "hf_roberta", "hf_gpt2", "hf_llama", "hf_mistral", "hf_t5", "hf_distilbert", "hf_vit", "hf_clip",
      "hf_whisper", "hf_wav2vec2", "hf_resnet", "hf_convnext"]


def no_dropout_config(cfg):
    """Dropout, layer drop, drop path and SpecAugment masking off in a transformers config (and
    its sub-configs): their random numbers are not eager's."""
    import transformers
    for k, v in list(vars(cfg).items()):
        if isinstance(v, transformers.PretrainedConfig):
            no_dropout_config(v)
        elif isinstance(v, float) and ("drop" in k or k in ("mask_time_prob", "mask_feature_prob")):
            setattr(cfg, k, 0.0)
    return cfg


def hf_tiny(name):
    """(model, args, kwargs): a transformers model in a tiny config of its own config class."""
    import transformers as T
    ids = torch.randint(3, 1000, (2, 16))
    text = {"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    pixels = {"pixel_values": torch.randn(2, 3, 32, 32)}
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    vit = dict(small, image_size=32, patch_size=8)
    decoder = dict(small, vocab_size=1000, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    made = {
        "hf_bert": lambda: (T.BertModel, T.BertConfig(vocab_size=1000, max_position_embeddings=64, **small), text),
        "hf_roberta": lambda: (T.RobertaModel, T.RobertaConfig(vocab_size=1000, max_position_embeddings=64, **small),
                               text),
        "hf_gpt2": lambda: (T.GPT2LMHeadModel, T.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4,
                                                           n_positions=64, use_cache=False, bos_token_id=0,
                                                           eos_token_id=0), {"input_ids": ids}),
        "hf_llama": lambda: (T.LlamaForCausalLM, T.LlamaConfig(**decoder), text),
        "hf_mistral": lambda: (T.MistralForCausalLM, T.MistralConfig(**decoder), text),
        "hf_t5": lambda: (T.T5Model, T.T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, use_cache=False),
                          {"input_ids": ids, "decoder_input_ids": ids[:, :8]}),
        "hf_distilbert": lambda: (T.DistilBertModel, T.DistilBertConfig(vocab_size=1000, dim=64, n_layers=2, n_heads=4,
                                                                        hidden_dim=128, max_position_embeddings=64),
                                  text),
        "hf_vit": lambda: (T.ViTModel, T.ViTConfig(**vit), pixels),
        "hf_clip": lambda: (T.CLIPModel, T.CLIPConfig(
            text_config=dict(small, vocab_size=1000, max_position_embeddings=16, bos_token_id=0, eos_token_id=2),
            vision_config=dict(vit), projection_dim=32), {**text, **pixels}),
        "hf_whisper": lambda: (T.WhisperModel, T.WhisperConfig(
            vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=32, max_target_positions=32, use_cache=False, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=0),
            {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": ids[:, :8]}),
        "hf_wav2vec2": lambda: (T.Wav2Vec2Model, T.Wav2Vec2Config(
            **small, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), {"input_values": torch.randn(2, 1600)}),
        "hf_resnet": lambda: (T.ResNetModel, T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]),
                              pixels),
        "hf_convnext": lambda: (T.ConvNextModel, T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1]),
                                pixels),
    }
    cls, cfg, kwargs = made[name]()
    return cls(no_dropout_config(cfg)), (), kwargs


def build(name):
    """(model, args, kwargs) of a correctness-table model."""
    if name in HF:
        return hf_tiny(name)
    lib, ctor = VISION[name]
    if lib == "torchvision":
        import torchvision
        m = getattr(torchvision.models, ctor)()
    else:
        import timm
        m = timm.create_model(ctor, pretrained=False)
    return m, (torch.randn(2, 3, 224, 224),), {}


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


def to64(v):
    """Floating-point tensors in float64 (a model's float64 twin takes them)."""
    if isinstance(v, dict):
        return {k: to64(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return tuple(to64(x) for x in v)
    return v.double() if v.is_floating_point() else v


def to(v, device):
    return {k: to(x, device) for k, x in v.items()} if isinstance(v, dict) else \
        tuple(to(x, device) for x in v) if isinstance(v, tuple) else v.to(device)


def step(model, args, kwargs, train):
    if not train:
        with torch.no_grad():
            return outputs(model(*args, **kwargs)), [], []
    out = outputs(model(*args, **kwargs))
    # a random cotangent, the same for both (ones would give a model that ends in a LayerNorm
    # gradients that are zero in exact arithmetic: rounding noise in eager and compiled alike)
    gen = torch.Generator(device=out[0].device).manual_seed(0)
    sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum()
        for o in out if o.is_floating_point()).backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    stats = [(n, b) for n, b in model.named_buffers() if "running" in n]
    return [o.detach() for o in out], grads, stats


def check(name, train, device):
    torch.manual_seed(0)
    m, args, kwargs = build(name)
    m = m.to(device).train(train)
    no_dropout(m)
    ref, pristine = copy.deepcopy(m), copy.deepcopy(m)
    args, kwargs = to(args, device), to(kwargs, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.time()
        got = step(fuselens.compile(m), args, kwargs, train)
        first_s = time.time() - t
    want = step(ref, args, kwargs, train)
    fallbacks = sorted({str(w.message)[:160] for w in caught if w.category is fuselens.FuselensWarning})
    err_out = max([rel(a, b) for a, b in zip(got[0], want[0])] or [0.0])
    floor = 1e-6 * max([b.double().norm().item() for _, b in want[1] if b is not None] or [0.0])
    errs = [(rel(a, b, floor), n) for (n, a), (_, b) in zip(got[1] + got[2], want[1] + want[2])]
    err_grad, worst = max(errs, default=(0.0, None))
    exact = {}
    if err_grad >= 1e-3:  # which side is off? both against the step in float64
        exact = {"_orig_mod." + n: g for n, g in step(pristine.double(), to64(args), to64(kwargs), train)[1]}
    # a gradient far from eager's in a model computed in float32 passes where it is as close to
    # the float64 one as eager's is (within 2x): a sum that cancels (a bias whose gradient is
    # nearly zero in exact arithmetic) differs by summation order alone
    beyond = [(rel(a, exact[n]) / max(rel(b, exact[n]), 1e-12), n) for (e, n), (_, a), (_, b)
              in zip(errs, got[1], want[1]) if e >= 1e-3 and exact.get(n) is not None]
    mm = copy.deepcopy(ref).eval() if not train else copy.deepcopy(ref)
    with torch.no_grad() if not train else torch.enable_grad():
        ex = fuselens.explain(mm, *args, **kwargs)
        dyn = torch._dynamo.explain(copy.deepcopy(ref))(*args, **kwargs)
    torch._dynamo.reset()
    return {
        "model": name, "mode": "train" if train else "eval", "first_call_s": round(first_s, 1),
        "rel_err_out": err_out, "rel_err_grad": err_grad, "worst_grad": worst,
        # per gradient off eager's by >= 1e-3: its error against float64 over eager's
        "vs_float64": {n: round(r, 2) for r, n in beyond},
        "ok": err_out < 1e-4 and not fallbacks and len(got[0]) == len(want[0]) and (
            err_grad < 1e-3 or len(beyond) == sum(e >= 1e-3 for e, _ in errs) and all(r <= 2 for r, _ in beyond)),
        "graphs": len(ex.graphs), "breaks": len(ex.graph_breaks),
        "break_codes": sorted({b.code for b in ex.graph_breaks}),
        "break_details": sorted({f"{b.code} {b.filename.split('/')[-1]}:{b.line} {b.detail[:100]}"
                                 for b in ex.graph_breaks}),
        "dynamo_graphs": dyn.graph_count, "dynamo_breaks": dyn.graph_break_count,
        "fallbacks": fallbacks,
    }


def correctness(a):
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
                pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))
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
        for b in r["break_details"][:6]:
            print(f"{'':28} break: {b}")
        if r["rel_err_grad"] >= 1e-3 and r["worst_grad"]:
            ratios = r["vs_float64"]
            worst = sorted(ratios.items(), key=lambda kv: -kv[1])[:3]
            summary = (f"{len(ratios)} gradients, at most {worst[0][1]}x ({', '.join(f'{n} {v}x' for n, v in worst)})"
                       if ratios else "not computed (a running statistic)")
            print(f"{'':28} worst gradient: {r['worst_grad']}; error against float64 over eager's: {summary}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join([*VISION, *HF]))
    ap.add_argument("--modes", default="eval,train")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--speed", action="store_true", help="issue 18's speed table (bench_speed.py)")
    ap.add_argument("--cold", action="store_true", help="first calls in fresh processes, cold and warm-cache")
    ap.add_argument("--keep-caches", metavar="DIR", help="cold: merge the caches it filled into DIR; point "
                    "TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, FUSELENS_CACHE_DIR at DIR/triton, ... for --speed")
    ap.add_argument("--profile", help="kernel time by kernel of one speed workload")
    ap.add_argument("--profile-first", metavar="DIR", help="cold: also eager's first step and each compiler's "
                    "warm one under cProfile, stats in DIR/<workload>-<compiler>.prof")
    ap.add_argument("--first-call", nargs=2, metavar=("WORKLOAD", "COMPILER"), help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="+")
    ap.add_argument("--workloads")
    ap.add_argument("--compilers", default="eager,fuselens,inductor", help="speed, cold, profile: which to time")
    ap.add_argument("--no-ro", action="store_true", help="speed: without the reduce-overhead columns")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.speed or a.cold or a.profile or a.first_call or a.merge:
        import bench_speed
        return bench_speed.main(a)
    correctness(a)


if __name__ == "__main__":
    main()
