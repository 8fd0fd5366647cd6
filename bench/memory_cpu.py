"""Peak memory of a training step on the CPU (issue 41): eager vs fuselens vs torch.compile
(Inductor's C++ backend), on small versions of the suite's training rows whose fuselens peak was
above Inductor's on the H200 (bench/suite.py: unet_ddpm_gn, timm_resnet50_gn, swin_tiny, t5_small),
or any training row of bench/suite.py at a small batch.

    PYTHONPATH=compiler python bench/memory_cpu.py [--only unet,gn_resnet] [--dtype fp32,bf16]
                                                   [--compilers eager,fuselens,inductor] [--where]
    PYTHONPATH=compiler python bench/memory_cpu.py --only bert_base,gpt2 --batch 1 --dtype bf16

A step is bench/suite.py's (zero_grad(set_to_none), forward under the model's autocast, backward,
SGD step). Its peak is read from the profiler's CPU allocator events (profile_memory=True): the
running sum of the bytes each allocation and free reports, from the step's start, at its highest
(the parameters, and the gradients of the step before, which zero_grad frees, are there before:
the number is above the start, as the H200's max_memory_allocated less what a step starts with).
The buffer plan the peak comes from (what the wrapper frees when, what takes whose memory) is
the one the GPU programs have: codegen/wrapper.py is shared. `--where`: the op running at each
compiler's peak, and the live bytes there."""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys
import tempfile

_cache = tempfile.mkdtemp(prefix="fl-mem-")
os.environ.setdefault("FUSELENS_CACHE_DIR", os.path.join(_cache, "fuselens"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_cache, "inductor"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import fuselens  # noqa: E402
from models import no_dropout, no_dropout_config  # noqa: E402
import suite  # noqa: E402
from suite import Autocast, Step  # noqa: E402
from suite_models import MODELS as SUITE, UNet  # noqa: E402


class Bottleneck(nn.Module):
    """timm's resnet50_gn block: 1x1, 3x3, 1x1 convolutions, GroupNorm after each."""

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        gn = lambda c: nn.GroupNorm(32, c)
        self.body = nn.Sequential(nn.Conv2d(cin, width, 1, bias=False), gn(width), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, stride, 1, bias=False), gn(width), nn.ReLU(),
                                  nn.Conv2d(width, cout, 1, bias=False), gn(cout))
        self.skip = nn.Identity() if cin == cout and stride == 1 else \
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), gn(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


class GNResNet(nn.Module):
    def __init__(self, widths=(32, 64), blocks=(2, 2), classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.GroupNorm(32, widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, c = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(Bottleneck(c, w, 2 if i and not j else 1))
                c = 4 * w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def _hf(model_cls, config_cls, **config):
    import transformers as T
    return getattr(T, model_cls)(no_dropout_config(getattr(T, config_cls)(**config)))


def unet():
    return UNet(widths=(32, 64, 64, 64), temb=128), (torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))), {}


def gn_resnet():
    return GNResNet(), (torch.randn(8, 3, 128, 128),), {}


def swin():
    m = _hf("SwinForImageClassification", "SwinConfig", image_size=128, embed_dim=48, depths=[2, 2, 2],
            num_heads=[3, 6, 12], window_size=4, num_labels=10)
    return m, (), {"pixel_values": torch.randn(8, 3, 128, 128), "labels": torch.randint(0, 10, (8,))}


def t5():
    m = _hf("T5ForConditionalGeneration", "T5Config", vocab_size=512, d_model=128, d_kv=32, d_ff=512, num_layers=2,
            num_heads=4, decoder_start_token_id=0)
    return m, (), {"input_ids": torch.randint(0, 512, (8, 256)), "labels": torch.randint(0, 512, (8, 128))}


MODELS = {"unet": unet, "gn_resnet": gn_resnet, "swin": swin, "t5": t5}


def allocations(prof):
    """(time, bytes, op name) of each allocation (+) and free (-) the profiler saw, in order."""
    out = []

    def walk(ev, op):
        if ev.tag == _EventType.Allocation:
            out.append((ev.start_time_ns, ev.extra_fields.alloc_size, op))
        elif ev.tag == _EventType.TorchOp:
            op = ev.name if op is None or not op.startswith("aten::") else op
        for c in ev.children:
            walk(c, op)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    return sorted(out, key=lambda a: a[0])


MARK = 12345  # bytes of the allocation that marks the measured call's start


def peak(call):
    """(peak bytes above the start of `call`, the op allocating at the peak). A call before it is
    profiled too, so the frees of what that one made (the gradients zero_grad frees) are seen."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
        mark = torch.empty(MARK, dtype=torch.uint8)  # (held: its free is not the step's)
        call()
    del mark
    live = top = 0
    where, started = None, False
    for _, size, op in allocations(prof):
        if not started:
            started = size == MARK
            continue
        live += size
        if live > top:
            top, where = live, op
    return top, where


def step_of(name, dtype, compiler, batch):
    if name in MODELS:
        torch.manual_seed(0)
        model, args, kwargs = MODELS[name]()
        no_dropout(model)
        model = Autocast(model.train(), "cpu")
    else:  # a row of bench/suite.py, at `batch`
        model, args, kwargs = suite.build(name, "train", dtype, "cpu", batch)
    model.enabled = dtype == "bf16"
    if compiler == "fuselens":
        model = fuselens.compile(model)
    elif compiler == "inductor":
        torch._dynamo.reset()  # (every row's forward is Autocast.forward: past 8 recompiles dynamo runs it eagerly)
        model = torch.compile(model)
    return Step(model, "train", args, kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--compilers", default="eager,fuselens,inductor")
    ap.add_argument("--where", action="store_true")
    ap.add_argument("--batch", type=int, default=1, help="the batch of bench/suite.py's rows named in --only")
    a = ap.parse_args()
    unknown = [n for n in a.only.split(",") if n not in MODELS and n not in SUITE]
    if unknown:
        sys.exit(f"memory_cpu: no model named {', '.join(unknown)} (here: {', '.join(MODELS)}; or a row of bench/suite.py)")
    compilers = a.compilers.split(",")
    print(f"{'model':<12}{'dtype':<6}" + "".join(f"{c + ' MB':>14}" for c in compilers) +
          ("   fuselens/inductor" if {"fuselens", "inductor"} <= set(compilers) else ""))
    for name in a.only.split(","):
        for dtype in a.dtype.split(","):
            peaks = {}
            for c in compilers:
                step = step_of(name, dtype, c, a.batch)
                step()  # (compiles)
                peaks[c] = peak(step)
            line = f"{name:<12}{dtype:<6}" + "".join(f"{peaks[c][0] / 2 ** 20:>14.3f}" for c in compilers)
            if "fuselens" in peaks and "inductor" in peaks:
                line += f"   {peaks['fuselens'][0] / peaks['inductor'][0]:.3f}"
            print(line, flush=True)
            if a.where:
                for c in compilers:
                    print(f"    {c}: peak at {peaks[c][1]}")


if __name__ == "__main__":
    main()
