"""DDP and FSDP2 training steps at world size 1: eager, fuselens (DDP: graphs split at its buckets,
and one graph), torch.compile (DDP: Inductor with Dynamo's DDPOptimizer, and one graph).

    PYTHONPATH=compiler python3 bench/distributed.py --json out.json         # NCCL on one GPU
    PYTHONPATH=compiler python3 bench/distributed.py --device cpu --json -   # gloo on the CPU

One process, one rank: the collectives run (NCCL or gloo with one member), so what is timed is
what the wrappers and the compilers add to a step, and whether splitting at DDP's buckets costs
anything where no all-reduce has to overlap. Each row: the median step time (forward, backward,
SGD step) over `--steps` timed steps after `--warmup`, taken in `--rounds` rounds that alternate
the rows (the median round is reported), peak memory on the GPU over the timed steps, the largest
difference of its losses from eager's over the same steps, and for fuselens the graphs it made
(pieces: the graphs the backend compiled), its breaks, and its warnings."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    """The issue's model: a residual MLP (here `blocks` blocks of width d and 4d)."""

    def __init__(self, d, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def shard(model):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def fuselens_compile(model):
    import fuselens
    return fuselens.compile(model)


def torch_compile(model):
    return torch.compile(model)


def rows():
    """name -> (wrap the model, compile the wrapped model or None, environment, dynamo's optimize_ddp)."""
    return {
        "DDP eager": (DDP, None, {}, None),
        "DDP fuselens split at buckets": (DDP, fuselens_compile, {"FUSELENS_DDP_SPLIT": "1"}, None),
        "DDP fuselens one graph": (DDP, fuselens_compile, {"FUSELENS_DDP_SPLIT": "0"}, None),
        "DDP inductor DDPOptimizer": (DDP, torch_compile, {}, "ddp_optimizer"),
        "DDP inductor one graph": (DDP, torch_compile, {}, False),
        "FSDP2 eager": (shard, None, {}, None),
        "FSDP2 fuselens": (shard, fuselens_compile, {}, None),
        "FSDP2 inductor": (shard, torch_compile, {}, None),
    }


class Row:
    def __init__(self, name, spec, args, device):
        wrap, compile_fn, self.env, self.optimize_ddp = spec
        self.name, self.device = name, device
        torch.manual_seed(0)
        module = MLP(args.width, args.blocks).to(device)
        wrapped = wrap(module)
        self.model = compile_fn(wrapped) if compile_fn is not None else wrapped
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.batches = [torch.randn(args.batch, args.width, generator=gen).to(device) for _ in range(4)]
        self.losses, self.times, self.peak = [], [], 0
        self.log, self.caught = [], []

    def step(self, i):
        with _environment(self.env), _optimize_ddp(self.optimize_ddp):
            loss = self.model(self.batches[i % len(self.batches)])
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def run(self, steps, first):
        """`steps` steps; the first round's warm-up steps are recorded (fuselens's captures)."""
        from fuselens.runtime.compiled import collecting
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        with warnings.catch_warnings(record=True) as caught, collecting() as log:
            warnings.simplefilter("always")
            for i in range(steps):
                start = time.perf_counter()
                loss = self.step(i)
                if self.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                if not first:
                    self.losses.append(loss)
        if first:
            self.log += log
            self.caught += [str(w.message) for w in caught if "fuselens" in str(w.message)]
        if self.device == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())
        return times

    def result(self, eager_losses):
        losses = torch.stack(self.losses).float().cpu()
        out = {"step_ms": statistics.median(self.times) * 1e3,
               "loss_max_abs_diff_vs_eager": (losses - eager_losses).abs().max().item()
               if eager_losses is not None and len(eager_losses) == len(losses) else None,
               "peak_memory_mb": self.peak / 2 ** 20 if self.device == "cuda" else None}
        if self.log:
            out["graphs"] = sum(len(e.graphs) for e in self.log)
            out["pieces"] = sum(g.pieces for e in self.log for g in e.graph_calls)
            out["breaks"] = [f"{e.graph_break.code} in {e.function}: {e.graph_break.detail}"
                             for e in self.log if e.graph_break is not None]
            out["warnings"] = self.caught
        return out


class _environment:
    def __init__(self, env):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _optimize_ddp:
    """torch._dynamo.config.optimize_ddp for an Inductor row (read when Dynamo compiles a frame)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        if self.value is not None:
            import torch._dynamo
            self.saved = torch._dynamo.config.optimize_ddp
            torch._dynamo.config.optimize_ddp = self.value

    def __exit__(self, *exc):
        if self.value is not None:
            import torch._dynamo
            torch._dynamo.config.optimize_ddp = self.saved


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the results here (- for stdout)")
    p.add_argument("--width", type=int, default=None, help="model width (cuda: 1024, cpu: 128)")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch", type=int, default=None, help="batch rows (cuda: 8192, cpu: 16)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket cap (default DDP's own, 25 MB; cpu: 1 MB, DDP's first bucket's, "
                        "below which Dynamo's DDPOptimizer refuses)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (cuda: 30, cpu: 3)")
    p.add_argument("--rounds", type=int, default=None, help="(cuda: 5, cpu: 1)")
    p.add_argument("--only", nargs="*", help="row names (substrings)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.width = args.width or (1024 if cuda else 128)
    args.batch = args.batch or (8192 if cuda else 16)
    args.steps = args.steps or (30 if cuda else 3)
    args.rounds = args.rounds or (5 if cuda else 1)
    cap = args.bucket_cap_mb or (None if cuda else 1.0)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    specs = rows()
    if cap is not None:  # DDP rows at this cap
        specs = {k: ((lambda m: DDP(m, bucket_cap_mb=cap)),) + v[1:] if v[0] is DDP else v
                 for k, v in specs.items()}
    names = [n for n in specs if not args.only or any(o in n for o in args.only)]
    made = {}
    for name in names:  # one at a time: a failing row is reported, not fatal
        try:
            made[name] = Row(name, specs[name], args, args.device)
            made[name].run(args.warmup, first=True)
        except Exception as e:
            made.pop(name, None)
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            made[name] = e
    rounds: dict = {n: [] for n, r in made.items() if isinstance(r, Row)}
    for _ in range(args.rounds):  # alternating rows: a clock drift favours none
        for name in rounds:
            rounds[name].append(statistics.median(made[name].run(args.steps, first=False)))
    results = {}
    for name, r in made.items():
        if not isinstance(r, Row):
            results[name] = {"error": f"{type(r).__name__}: {r}"}
            continue
        r.times = [statistics.median(rounds[name])]
        eager = next((made[e] for e in made if e.startswith(name.split()[0]) and e.endswith("eager")), None)
        eager_losses = torch.stack(eager.losses).float().cpu() if isinstance(eager, Row) else None
        results[name] = r.result(eager_losses)
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": "nccl" if cuda else "gloo", "world_size": 1,
        "torch": torch.__version__,
        "model": f"residual MLP, {args.blocks} blocks of {args.width}x{4 * args.width}, batch {args.batch}, SGD",
        "ddp_bucket_cap_mb": cap if cap is not None else "DDP's default (25, first bucket 1)",
        "method": f"median step over {args.steps} steps, median of {args.rounds} alternating rounds, "
                  f"after {args.warmup} warm-up steps",
        "rows": results,
    }
    for a, b in (("DDP fuselens split at buckets", "DDP fuselens one graph"),
                 ("DDP fuselens split at buckets", "DDP inductor DDPOptimizer")):
        if "step_ms" in results.get(a, {}) and "step_ms" in results.get(b, {}):
            report[f"{a} / {b}"] = results[a]["step_ms"] / results[b]["step_ms"]
    text = json.dumps(report, indent=2)
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
