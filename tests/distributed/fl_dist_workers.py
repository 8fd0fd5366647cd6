"""The processes of tests/distributed: each rank runs every case twice, compiled and eager, under
the same wrapper (DDP or FSDP2) from the same initial parameters and data, and rank 0 reports
what each compiled run made (graphs, graph pieces, breaks and where) and how far its losses and
parameters are from the eager run's."""
from __future__ import annotations

import pickle
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2
STEPS = 3
D = 32
# below two residual blocks' parameters (2 x 8448 bytes): the MLP's ~34 KB make 3 buckets
BUCKET_CAP_MB = 12_000 / 2 ** 20


class Block(nn.Module):
    def __init__(self, d, checkpointed=False):
        super().__init__()
        self.fc1, self.fc2, self.checkpointed = nn.Linear(d, d), nn.Linear(d, d), checkpointed

    def inner(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def forward(self, x):
        if self.checkpointed:
            return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return x + self.inner(x)


class MLP(nn.Module):
    """A residual MLP of 4 blocks; `unused`: a layer whose output the loss never reads."""

    def __init__(self, checkpointed=False, unused=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(D, checkpointed) for _ in range(4))
        self.head = nn.Linear(D, 1)
        self.unused = nn.Linear(D, D) if unused else None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def gpt2():
    import transformers as T
    cfg = T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return T.GPT2LMHeadModel(cfg)


def mlp_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(8, D, generator=g),), {}


def gpt2_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return (), {"input_ids": ids, "labels": ids}


def loss_of(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def shard(model, units):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # a CPU mesh, as the gloo group is: left to choose, FSDP2 takes CUDA where a GPU is visible
    # and moves the shards there (the H200 machine's run died of SIGSEGV in both ranks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# name -> (make the model, batch, wrap: (model, compile) -> the module called, options)
CASES = {
    "compile(DDP)": (MLP, mlp_batch, lambda m, c: c(DDP(m, bucket_cap_mb=BUCKET_CAP_MB)), {}),
    "DDP(compile)": (MLP, mlp_batch, lambda m, c: DDP(c(m), bucket_cap_mb=BUCKET_CAP_MB), {}),
    "compile(DDP) no_sync": (MLP, mlp_batch, lambda m, c: c(DDP(m, bucket_cap_mb=BUCKET_CAP_MB)),
                             {"no_sync": True}),
    "compile(DDP) find_unused static gradient_as_bucket_view": (
        lambda: MLP(unused=True), mlp_batch,
        lambda m, c: c(DDP(m, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True,
                           gradient_as_bucket_view=True)), {}),
    "compile(DDP) static_graph": (MLP, mlp_batch,
                                  lambda m, c: c(DDP(m, bucket_cap_mb=BUCKET_CAP_MB, static_graph=True)), {}),
    "FSDP2": (MLP, mlp_batch, lambda m, c: c(shard(m, lambda m: m.blocks)), {}),
    "FSDP2 checkpointed": (lambda: MLP(checkpointed=True), mlp_batch,
                           lambda m, c: c(shard(m, lambda m: m.blocks)), {}),
    "GPT-2 compile(DDP)": (gpt2, gpt2_batch, lambda m, c: c(DDP(m, bucket_cap_mb=BUCKET_CAP_MB)), {}),
    "GPT-2 FSDP2": (gpt2, gpt2_batch, lambda m, c: c(shard(m, lambda m: m.transformer.h)), {}),
}


def train(case, rank, compiled):
    """Losses and final full parameters of STEPS SGD steps; with `no_sync`, each step
    accumulates a micro-batch without synchronizing before the synchronized one."""
    import fuselens
    from fuselens.runtime.ddp_buckets import bucket_limits
    make, batch, wrap, options = CASES[case]
    torch.manual_seed(0)
    module = make()
    model = wrap(module, fuselens.compile if compiled else (lambda m: m))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        if options.get("no_sync"):
            with model.no_sync():
                args, kwargs = batch(step + 50, rank)
                loss_of(model(*args, **kwargs)).backward()
        args, kwargs = batch(step, rank)
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    ddp = next((m for m in model.modules() if isinstance(m, DDP)), None)
    buckets = None
    if ddp is not None:
        # DDP's own assignment over the parameters the forward reads, in reverse order, at its
        # caps (as it buckets before its first step), and the reducer's buckets now
        unused = {id(p) for p in module.unused.parameters()} if getattr(module, "unused", None) else set()
        read = [p for p in reversed(list(module.parameters())) if id(p) not in unused]
        limits = bucket_limits(ddp)
        buckets = (len(dist._compute_bucket_assignment_by_size(read, limits)[0]),
                   len(ddp.reducer._get_zeros_like_grad_buckets()))
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return torch.stack(losses), params, buckets


def run_case(case, rank):
    from fuselens.runtime.compiled import collecting
    eager_losses, eager_params, _ = train(case, rank, compiled=False)
    with warnings.catch_warnings(record=True) as caught, collecting() as log:
        warnings.simplefilter("always")
        losses, params, buckets = train(case, rank, compiled=True)
    contract = sys.modules.get("fuselens.ops.contract")
    return {
        "loss_error": (losses - eager_losses).abs().max().item(),
        "loss_scale": eager_losses.abs().max().item(),
        "param_error": max((a - b).abs().max().item() for a, b in zip(params, eager_params)),
        "entries": [(e.function, len(e.graphs), sum(g.pieces for g in e.graph_calls),
                     e.graph_break.code if e.graph_break else None,
                     str(e.graph_break.detail) if e.graph_break else None) for e in log],
        "ddp_buckets": buckets,
        "warnings": [str(w.message) for w in caught if "fuselens" in str(w.category).lower()
                     or "fuselens" in str(w.message).lower()],
        "contract_violations": list(getattr(contract, "VIOLATIONS", [])),
    }


def worker(rank, port, cases, out):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        results = {}
        for case in cases:
            results[case] = run_case(case, rank)
            dist.barrier()
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_all(cases, out):
    """Every case in WORLD processes of one gloo group; rank 0's report. The group's store is
    this process's, on a port it holds until the workers end (a port found free and closed again
    could be another test's by the time a worker bound it: a worker once aborted so in CI)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(worker, args=(store.port, list(cases), str(out)), nprocs=WORLD)
    del store
    with open(out, "rb") as f:
        return pickle.load(f)
