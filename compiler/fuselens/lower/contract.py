"""The contract of what lower hands the scheduler (docs/architecture.md, "Stage contracts"): a
LoweredGraph's buffers, steps and outputs. Checked where `lower_graph` returns it when
FUSELENS_VERIFY=1. What each loop body reads is checked with the schedule (schedule/contract.py),
which runs the bodies."""
from __future__ import annotations

import math

import torch
from torch.fx.node import map_aggregate

from ..ops.contract import expect
from ..ops.primitives import PRIMITIVES
from .ir import Buffer, ComputedBuffer, ExternBuffer, ExternCall, InputBuffer, LoweredGraph, View

STAGE = "loop IR"
REDUCE = ("sum", "prod", "max", "min")


def extent(shape, stride) -> int:
    """Elements of storage a strided layout spans (0 when empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))


def check_buffer(b: Buffer, stage: str = STAGE) -> None:
    what = f"buffer {b.name}"
    expect(isinstance(b.dtype, torch.dtype), stage, what, f"its dtype is a torch.dtype, not {b.dtype!r}")
    expect(len(b.shape) == len(b.stride), stage, what, f"shape {list(b.shape)} and stride {list(b.stride)} "
           "have one entry per dim")
    expect(all(isinstance(s, int) and s >= 0 for s in b.shape), stage, what,
           f"its sizes are non-negative ints, not {list(b.shape)}")


def check_view(v: View, defined: set, what: str, stage: str = STAGE) -> None:
    """`v` views a buffer `defined` before it, within that buffer's elements."""
    expect(v.buf.name in defined, stage, what, f"reads buffer {v.buf.name} before it is written")
    expect(len(v.shape) == len(v.stride), stage, what, f"views {v.buf.name} with one stride per dim")
    if all(isinstance(n, int) for n in (*v.shape, *v.stride, v.offset)) and all(v.shape):
        last = v.offset + sum((s - 1) * st for s, st in zip(v.shape, v.stride) if st > 0)
        first = v.offset + sum((s - 1) * st for s, st in zip(v.shape, v.stride) if st < 0)
        expect(0 <= first and last < max(extent(v.buf.shape, v.buf.stride), math.prod(v.buf.shape)), stage, what,
               f"views {v.buf.name} {list(v.buf.shape)} within its elements (shape {list(v.shape)}, "
               f"stride {list(v.stride)}, offset {v.offset})")


def check_lowered(graph: LoweredGraph) -> None:
    stage = STAGE
    defined: set = set()

    def define(b: Buffer):
        check_buffer(b)
        expect(b.name not in defined, stage, f"buffer {b.name}", "is written once (its name is unique)")
        defined.add(b.name)

    for i, b in enumerate(graph.inputs):
        if b is None:
            expect(graph.has_seed, stage, f"input {i}", "is None only as the seed of a graph with random ops")
            continue
        expect(isinstance(b, InputBuffer) and b.index == i, stage, f"input {i}", "is an InputBuffer of index "
               f"{i}")
        define(b)
    expect(graph.has_seed == (None in graph.inputs), stage, "the inputs", "hold the seed (None) where has_seed")
    for step in graph.steps:
        if isinstance(step, ComputedBuffer):
            what = f"buffer {step.name}"
            expect(callable(step.body), stage, what, "has a loop body")
            expect(step.kind in ("pointwise", "reduction", "scatter"), stage, what,
                   f"is pointwise, a reduction or a scatter (lowering makes no {step.kind!r})")
            if step.kind == "scatter":
                expect(isinstance(step.into, InputBuffer) and (step.shape, step.stride, step.dtype) ==
                       (step.into.shape, step.into.stride, step.into.dtype), stage, what,
                       "writes into a graph input, whose layout and dtype it has")
            if step.kind == "reduction":
                rank = len(step.in_shape)
                expect(step.reduce in REDUCE, stage, what, f"reduces with one of {', '.join(REDUCE)}")
                expect(all(0 <= d < rank for d in step.red_dims) and  # (none: a 0-d value's sum)
                       len(set(step.red_dims)) == len(step.red_dims), stage, what,
                       f"reduces distinct dims of its {rank}-d input, not {list(step.red_dims)}")
                expect(tuple(step.shape) == tuple(1 if d in step.red_dims else s for d, s in enumerate(step.in_shape)),
                       stage, what, f"keeps the reduced dims as 1s: {list(step.in_shape)} over "
                       f"{list(step.red_dims)} is not {list(step.shape)}")
            define(step)
        else:
            expect(isinstance(step, ExternCall), stage, f"step {step!r}", "is a ComputedBuffer or an ExternCall")
            what = f"extern {step.name} ({step.prim!r})"
            expect(PRIMITIVES.get(getattr(step.prim, "name", None)) is step.prim, stage, what,
                   "calls a registered primitive")
            map_aggregate((step.args, step.kwargs),
                          lambda a: check_view(a, defined, what) if isinstance(a, View) else None)
            results = [step.result] if step.result is not None else step.items
            for r in results:
                expect(isinstance(r, ExternBuffer) and r.call is step and
                       (r.item is None) == (step.result is not None), stage, what,
                       "its results are ExternBuffers of this call (a tuple's items by their index)")
                define(r)
    for i, o in enumerate(graph.outputs):
        if isinstance(o, View):
            check_view(o, defined, f"output {i}")
        else:
            expect(not isinstance(o, (Buffer, torch.Tensor)), stage, f"output {i}", "is a View or a Python value")
