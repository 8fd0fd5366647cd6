"""CPU benchmark (issue 43): eager vs torch.compile (Inductor's C++/OpenMP) vs fuselens's C++
kernels, on the machine's own threads (torch.get_num_threads()).

    PYTHONPATH=compiler python bench/cpu.py [--only NAME ...] [--json bench/results/cpu-<machine>.json]

Rows: fused pointwise ops (a manual GeLU), a manual softmax and layer norm, an MLP block
(LayerNorm, Linear, GeLU, Linear, residual) in inference and a training step (forward, backward,
SGD step eagerly), a transformers encoder (BERT) and decoder (GPT-2) in small configs with random
weights, one decode step of a gpt-fast-style Llama (bench/decode_models.py, a quarter of the 1B's
width, 4 layers), and a ResNet-18 (torchvision's where it imports, else the same network defined
below) in inference: each in fp32, and again in bf16 where the CPU has bf16 instructions
(inference in bf16, the training step under bf16 autocast). Per row and compiler:
the first call (compile included; every compiler's disk cache is a fresh directory of this
process, so the first row of each kind is cold), then steps timed in ROUNDS rounds alternating
the compilers, the fastest step reported: on the shared 2-core development machine other work
takes a core for seconds at a time (eager's GeLU row moved between 53 and 131 ms from one run to
the next), which a median keeps and the fastest step mostly does not. Results checked against
eager's (max |got - want| / max |want|).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

_cache = tempfile.mkdtemp(prefix="fl-cpu-bench-")
os.environ.setdefault("FUSELENS_CACHE_DIR", os.path.join(_cache, "fuselens"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_cache, "inductor"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuselens  # noqa: E402

ROUNDS = 3
COMPILERS = ("eager", "inductor", "fuselens")
N, D = 2048, 4096


def cpu_has_bf16() -> bool:
    try:
        return "avx512_bf16" in open("/proc/cpuinfo").read() or "amx_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def softmax(x):
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


class MLPBlock(nn.Module):
    def __init__(self, d=1024, hidden=4096):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def resnet18():
    """torchvision.models.resnet18(), or the same network where torchvision does not import."""
    try:
        import torchvision
        return torchvision.models.resnet18()
    except Exception:  # noqa: BLE001 (not installed, or built for another torch)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1), *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


def hf(kind):
    import transformers as T
    cfg = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
               vocab_size=8000, max_position_embeddings=256)
    if kind == "bert":
        model = T.BertModel(T.BertConfig(**cfg, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    else:
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=8000, n_embd=256, n_layer=4, n_head=4, n_positions=256,
                                               use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(0))
    return model.eval(), (ids,)


def rows(bf16):
    """name -> build(): (function or module, inputs, train, autocast dtype or None), fp32 rows then bf16
    rows where the CPU has bf16 instructions (inference in bf16, training under bf16 autocast)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    dtypes = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if bf16 else [])
    for tag, dt in dtypes:
        x = torch.randn(N, D, generator=g).to(dt)
        w, b = torch.randn(D, generator=g).to(dt), torch.randn(D, generator=g).to(dt)
        out[f"gelu {N}x{D} {tag}"] = lambda x=x: (gelu, (x,), False, None)
        out[f"softmax {N}x{D} {tag}"] = lambda x=x: (softmax, (x,), False, None)
        out[f"layer norm {N}x{D} {tag}"] = lambda x=x, w=w, b=b: (layer_norm, (x, w, b), False, None)
    for tag, dt in dtypes:
        # the fp32 rows' names as before this table had bf16 model rows (earlier results compare)
        name = (lambda n: n) if dt == torch.float32 else (lambda n: f"{n} bf16")

        def infer(build, dt=dt):
            model, inputs = build()
            inputs = tuple(t.to(dt) if t.is_floating_point() else t for t in inputs)
            return model.to(dt), inputs, False, None

        def mlp_train(dt=dt):
            torch.manual_seed(0)
            return MLPBlock().train(), (torch.randn(8, 256, 1024),), True, dt if dt != torch.float32 else None

        def mlp():
            torch.manual_seed(0)
            return MLPBlock().eval(), (torch.randn(8, 512, 1024),)

        def cnn():
            torch.manual_seed(0)
            return resnet18().eval(), (torch.randn(8, 3, 224, 224),)
        out[name("MLP block inference 8x512x1024")] = lambda infer=infer: infer(mlp)
        out[name("MLP block training step 8x256x1024")] = mlp_train
        out[name("BERT encoder 4 layers 8x128")] = lambda infer=infer: infer(lambda: hf("bert"))
        out[name("GPT-2 decoder 4 layers 8x128")] = lambda infer=infer: infer(lambda: hf("gpt2"))
        out[name("Llama decode step 512x4 layers, 1 token")] = lambda dt=dt: (*decode(dt), False, None)
        out[name("ResNet-18 8x3x224x224")] = lambda infer=infer: infer(cnn)
    return out


def decode(dtype):
    """One token of a gpt-fast-style Llama (bench/decode_models.py), its KV cache 320 positions."""
    from decode_models import build_decoder, config, decode_one
    torch.manual_seed(0)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = build_decoder(config("llama1b", quick=True), 1, 320, dtype, "cpu")

        def forward(self, token, pos):
            return decode_one(self.model, token, pos)
    return Step(), (torch.zeros(1, 1, dtype=torch.long), torch.tensor([100]))


def first_tensor(v):
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (tuple, list)):
        return first_tensor(v[0])
    if hasattr(v, "to_tuple"):
        return first_tensor(v.to_tuple())
    raise TypeError(type(v))


def make_call(compiler, fn, inputs, train, amp=None):
    if compiler == "eager":
        compiled = fn
    elif compiler == "inductor":
        compiled = torch.compile(fn)
    else:
        compiled = fuselens.compile(fn)
    if not train:
        def call():
            with torch.no_grad():
                return compiled(*inputs)
        return call
    opt = torch.optim.SGD(fn.parameters(), lr=1e-3)

    def step():
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = compiled(*inputs)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out
    return step


def time_calls(call, budget_s=1.0, least=3):
    """The fastest of the calls in `budget_s` (at least `least`, at most 50)."""
    times, start = [], time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
        if len(times) >= 50:
            break
    return min(times)


def measure(name, build):
    import copy
    fn, inputs, train, amp = build()
    calls, first, errors = {}, {}, {}
    want = None
    for c in COMPILERS:
        # each compiler its own copy of the model: training steps change the weights
        model = copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn
        call = make_call(c, model, inputs, train, amp)
        t = time.perf_counter()
        got = first_tensor(call())
        first[c] = time.perf_counter() - t
        if c == "eager":
            want = got.detach().float()
        else:
            errors[c] = ((got.detach().float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        calls[c] = call
    per_round = {c: [] for c in COMPILERS}
    for _ in range(ROUNDS):
        for c in COMPILERS:
            per_round[c].append(time_calls(calls[c]))
    ms = {c: 1e3 * min(per_round[c]) for c in COMPILERS}
    return {"name": name, **{f"{c}_ms": round(ms[c], 3) for c in COMPILERS},
            **{f"{c}_first_s": round(first[c], 3) for c in COMPILERS},
            **{f"{c}_max_rel_error": errors[c] for c in errors}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--json")
    args = ap.parse_args()
    bf16 = cpu_has_bf16()
    table = rows(bf16)
    results = []
    print(f"{'row':40s} {'eager':>9s} {'inductor':>9s} {'fuselens':>9s} {'vs eager':>8s} {'vs ind.':>8s} "
          f"{'ind. 1st':>8s} {'fl 1st':>8s}", flush=True)
    for name, build in table.items():
        if args.only and not any(o in name for o in args.only):
            continue
        r = measure(name, build)
        results.append(r)
        print(f"{name:40s} {r['eager_ms']:9.2f} {r['inductor_ms']:9.2f} {r['fuselens_ms']:9.2f} "
              f"{r['eager_ms'] / r['fuselens_ms']:7.2f}x {r['fuselens_ms'] / r['inductor_ms']:7.2f}x "
              f"{r['inductor_first_s']:7.1f}s {r['fuselens_first_s']:7.1f}s", flush=True)
    if results:
        geo = math.exp(statistics.mean(math.log(r["fuselens_ms"] / r["inductor_ms"]) for r in results))
        print(f"geomean fuselens / inductor: {geo:.3f}")
    if args.json:
        meta = {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(), "torch": torch.__version__, "bf16_rows": bf16}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
