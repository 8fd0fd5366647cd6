"""First call of a compiled model in a new process, cold (empty program cache) vs warm (the
cache an earlier process filled), on the CPU with kernels in Triton's interpreter: where
fuselens's own time goes (backend/program_cache.py, bench/NOTES.md).

    python bench/program_cache.py [--repeat N] [MODEL:MODE ...]   (default: every row below)

Each row is the fastest of N process pairs (a cold one, then a warm one on its cache), field by
field, in seconds: capture (the capture of every function and resume function, their guards
included; of which py_compile: builtins.compile of the guards' and transformed functions' source),
backend (compiling programs: primitive graph, joint graph and partition, lowering, scheduling,
codegen), cache load (key, read, programs made again from their sources), programs (running the
generated programs: kernels in the interpreter, externs), rest (the remainder of the call)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS = ["gpt2:train", "vit:eval", "resnet18:train", "resnet18:eval", "resnet50:train", "resnet50:eval"]
FIELDS = ["first_call", "capture", "py_compile", "backend", "cache_load", "programs", "rest"]


def resnet(blocks, bottleneck):
    """A ResNet of torchvision's layout (stem, four stages of basic or bottleneck blocks with
    stride-2 downsampling, pooling, linear head), narrow: the graph of a ResNet-18/50, small tensors."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * (4 if bottleneck else 1)
            convs = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)] if bottleneck else \
                [(cin, width, 3, stride), (width, cout, 3, 1)]
            self.convs = nn.ModuleList(nn.Conv2d(i, o, k, s, k // 2, bias=False) for i, o, k, s in convs)
            self.bns = nn.ModuleList(nn.BatchNorm2d(o) for _, o, _, _ in convs)
            self.down = None if stride == 1 and cin == cout else \
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.cout = cout

        def forward(self, x):
            y = x
            for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
                y = bn(conv(y))
                if i < len(self.convs) - 1:
                    y = torch.relu(y)
            return torch.relu(y + (x if self.down is None else self.down(x)))

    layers, cin = [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()], 8
    for stage, n in enumerate(blocks):
        for i in range(n):
            block = Block(cin, 4 << stage, 2 if i == 0 and stage > 0 else 1)
            layers.append(block)
            cin = block.cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
    return model, torch.randn(2, 3, 16, 16)


def child(name, mode):
    import torch
    import fuselens
    from fuselens import stats
    from fuselens.backend import driver
    from fuselens.runtime import compiled
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import builtins
    times = {"capture": 0.0, "programs": 0.0, "py_compile": 0.0}
    active = set()

    def timed(fn, field, within=None):
        def wrapper(*args, **kwargs):
            if within is not None and within not in active:
                return fn(*args, **kwargs)
            active.add(field)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[field] += time.perf_counter() - start
                active.discard(field)
        return wrapper
    compiled.capture = timed(compiled.capture, "capture")
    builtins.compile = timed(builtins.compile, "py_compile", within="capture")
    driver.Program.__call__ = timed(driver.Program.__call__, "programs")
    torch.manual_seed(0)
    if name.startswith("resnet"):
        model, x = resnet([2, 2, 2, 2] if name == "resnet18" else [3, 4, 6, 3], name == "resnet50")
        args, kwargs = (x,), {}
    else:
        import hf_zoo
        import transformers
        transformers.logging.set_verbosity_error()
        model, kwargs = hf_zoo.make(name, dropout=False)
        args = ()
    model.train(mode == "train")
    fn = fuselens.compile(model)
    import warnings
    warnings.simplefilter("error", fuselens.FuselensWarning)  # a graph run eagerly would not be timed
    start = time.perf_counter()
    with torch.set_grad_enabled(mode == "train"):
        out = fn(*args, **kwargs)
        if mode == "train":
            first = out if isinstance(out, torch.Tensor) else out[0]
            first.float().pow(2).mean().backward()
    total = time.perf_counter() - start
    b = stats.backend
    res = dict(first_call=total, capture=times["capture"], py_compile=times["py_compile"], backend=b["seconds"], cache_load=b["cache_load_seconds"],
               programs=times["programs"], compiles=b["compiles"], hits=b["cache_hits"],
               backward_layouts=b["backward_layouts"], triton=stats.triton_compile_seconds())
    res["rest"] = total - sum(res[f] for f in ("capture", "backend", "cache_load", "programs"))
    print(json.dumps(res))


def measure(row, repeat):
    name, mode = row.split(":")
    best = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, FUSELENS_INTERPRET="1", TRITON_INTERPRET="1", FUSELENS_PROGRAM_CACHE="1",
                       FUSELENS_CACHE_DIR=cache, PYTHONPATH=str(ROOT / "compiler"))
            for kind in ("cold", "warm"):
                out = subprocess.run([sys.executable, __file__, "--child", name, mode], env=env, check=True,
                                     capture_output=True, text=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                res["counts"] = [f"{res['compiles']}/{res['hits']}" +
                                 (f"+{res['backward_layouts']}bw" if res["backward_layouts"] else "")]
                if kind in best:
                    res = {k: min(v, best[kind][k]) if isinstance(v, float) else
                           best[kind][k] + v if k == "counts" else v for k, v in res.items()}
                best[kind] = res
    return best


def main(argv):
    repeat = 3
    if argv[:1] == ["--repeat"]:
        repeat, argv = int(argv[1]), argv[2:]
    print(f"{'row':16} {'':5} " + " ".join(f"{f:>10}" for f in FIELDS) + "  compiles/hits of each run")
    for row in argv or ROWS:
        best = measure(row, repeat)
        for kind in ("cold", "warm"):
            r = best[kind]
            print(f"{row:16} {kind:5} " + " ".join(f"{r[f]:10.3f}" for f in FIELDS) +
                  "  " + " ".join(r["counts"]),
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        main(sys.argv[1:])
