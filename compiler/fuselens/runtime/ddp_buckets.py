"""A graph captured inside DistributedDataParallel's forward, split at DDP's gradient buckets (as
Dynamo's DDPOptimizer splits it): each piece is compiled on its own and runs its backward as its
own autograd Function, so the parameters of one bucket get their gradients (and DDP's reducer
all-reduces that bucket) while the backward of the pieces before it still computes. One graph
would hand DDP every gradient at its very end: no all-reduce overlaps the backward."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.passes.split_module import split_module
from torch.nn.parallel import DistributedDataParallel

from .. import settings
from ..backend import driver


def bucket_limits(ddp) -> list[int]:
    """The byte caps of DDP's buckets in the order its reducer fills them (the last
    parameters' first): a user's per-bucket list, else the first bucket's cap then the rest's,
    as the reducer rebuilds its buckets after the first step."""
    config = getattr(ddp, "_bucket_config", None)  # (torch >= 2.12; before, a default cap's first is 1 MiB)
    if config is not None and config.per_bucket_bytes_caps:
        return list(config.per_bucket_bytes_caps)
    if config is not None:
        first = config.first_bucket_bytes_cap
    else:
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default", False) \
            else ddp.bucket_bytes_cap
    return [min(first, ddp.bucket_bytes_cap), ddp.bucket_bytes_cap]


def bucket_of_nodes(gm: fx.GraphModule, param_bytes: dict, limits: list[int]) -> dict:
    """Each op node's bucket, walking the graph backwards (the order its backward runs): a
    parameter counts toward the bucket of its first use (autograd accumulates its gradient, and
    DDP's hook sees it, once the backward of every use is done: a tied embedding's at the end),
    and a bucket closes once its parameters reach its cap. Bucket 0 is the graph's end. Ops
    before the first parameter's use join the earliest bucket with parameters."""
    first_use: dict = {}  # node -> the parameters it is the first to read
    for param in param_bytes:
        first = min(param.users, key=_order(gm), default=None)
        first_use.setdefault(first, []).append(param)
    buckets, sizes = {}, [0]
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        if sizes[-1] >= limits[min(len(sizes) - 1, len(limits) - 1)]:
            sizes.append(0)
        sizes[-1] += sum(param_bytes[p] for p in first_use.get(node, ()))
        buckets[node] = len(sizes) - 1
    if len(sizes) > 1 and sizes[-1] == 0:
        last = len(sizes) - 1
        buckets = {n: min(b, last - 1) for n, b in buckets.items()}
    return buckets


def _order(gm):
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    return position.__getitem__


def split_for_ddp(gm: fx.GraphModule, inputs, mode: str, name: str):
    """A `SplitGraph` of `gm` at the buckets of the DDP module whose forward is running, or None
    where there is none (or one bucket holds all of the graph's parameters)."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None or not torch.is_grad_enabled() or not settings.ddp_split():
        return None
    params = {id(p) for p in ddp.parameters() if p.requires_grad}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_bytes = {ph: t.numel() * t.element_size() for ph, t in zip(placeholders, inputs)
                   if isinstance(t, torch.Tensor) and id(t) in params}
    buckets = bucket_of_nodes(gm, param_bytes, bucket_limits(ddp))
    count = max(buckets.values(), default=0) + 1
    if count < 2:
        return None
    # pieces in the forward's order: the graph's end (bucket 0) is the last piece
    parent = split_module(gm, gm, lambda node: count - 1 - buckets[node])
    return SplitGraph(parent, mode, name)


class _Piece:
    """One bucket's part of the graph, compiled by the backend at its first call (its inputs are
    the pieces' before it: their layouts follow from the guarded graph inputs')."""

    def __init__(self, gm: fx.GraphModule, mode, name):
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))
        if self.single:  # the backend's graphs return a tuple
            out.args = ((out.args[0],),)
            gm.recompile()
        self.gm, self.mode, self.name, self.compiled = gm, mode, name, None

    def __call__(self, *inputs):
        if self.compiled is None:
            self.compiled = driver.compile_graph(self.gm, list(inputs), mode=self.mode, guarded=True, name=self.name)
        outs = self.compiled(*inputs)
        return outs[0] if self.single else outs


class SplitGraph:
    """A graph as pieces at DDP's buckets, run in order by the split's parent graph."""

    def __init__(self, parent: fx.GraphModule, mode, name):
        self.pieces = []
        for node in parent.graph.nodes:
            if node.op == "call_module":
                piece = _Piece(parent.get_submodule(node.target), mode,
                               f"{name}, bucket piece {len(self.pieces) + 1}")
                del parent._modules[node.target]
                object.__setattr__(parent, node.target, piece)  # the parent's code calls it
                self.pieces.append(piece)
        self.parent = parent

    def __call__(self, *inputs):
        return tuple(self.parent(*inputs))

    @property
    def kernels(self):
        return [k for p in self.pieces for k in getattr(p.compiled, "kernels", [])]

    @property
    def wrapper_source(self):
        return "\n".join(p.compiled.wrapper_source for p in self.pieces if getattr(p.compiled, "wrapper_source", ""))
