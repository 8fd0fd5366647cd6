"""The contract of what the scheduler hands codegen (docs/architecture.md, "Stage contracts"): a
Schedule of the LoweredGraph's steps. Checked where `schedule` returns it when FUSELENS_VERIFY=1."""
from __future__ import annotations

from torch.fx.node import map_aggregate

from ..lower.ir import ComputedBuffer, ExternCall, InputBuffer, LoweredGraph, ReadRecorder, View, use_handler
from ..ops.contract import expect
from .fusion import FusedKernel, Schedule, fits, node_ranges, node_vars, reshaped, row_dims

STAGE = "schedule"


def _reads(buf, shape, red_dims, sizevars):
    """The buffers `buf`'s loop body loads, evaluated in a kernel over `shape` reducing `red_dims`."""
    rec = ReadRecorder(sizevars, node_ranges(buf, shape, red_dims, sizevars))
    with use_handler(rec):
        buf.body(node_vars(buf, shape, red_dims, sizevars))
    return {src.name for src, _ in rec.reads}


def _fits_domain(n: ComputedBuffer, k: FusedKernel) -> bool:
    if n.kind == "reduction":
        return k.is_reduction and (tuple(n.in_shape), tuple(n.red_dims)) == (tuple(k.shape), tuple(k.red_dims))
    if n.kind == "partial":
        return k.is_reduction and (tuple(n.in_shape), row_dims(n)) == (tuple(k.shape), tuple(k.red_dims))
    if n.kind == "scatter":
        return fits(n, k.shape, k.red_dims or ())
    if not k.is_reduction:
        return tuple(n.shape) == tuple(k.shape) or reshaped(n, k.shape)
    return fits(n, k.shape, k.red_dims)


def check_schedule(graph: LoweredGraph, sched: Schedule) -> None:
    """Every computed buffer of `graph` in one kernel, every extern call once, in an order where
    each step reads only what is in memory by then (or computed earlier in its own kernel)."""
    stage = STAGE
    buffers = [s for s in graph.steps if isinstance(s, ComputedBuffer)]
    calls = [s for s in graph.steps if isinstance(s, ExternCall)]
    placed: dict = {}
    for step in sched.steps:
        if isinstance(step, ExternCall):
            expect(step in calls and step.name not in placed, stage, f"extern {step.name}",
                   "is a step of the loop IR, scheduled once")
            placed[step.name] = step
            continue
        expect(isinstance(step, FusedKernel) and step.nodes, stage, f"step {step!r}", "is a FusedKernel or an "
               "ExternCall")
        for n in step.nodes:
            expect(n.name not in placed, stage, f"buffer {n.name}", "is computed by one kernel")
            placed[n.name] = step
    missing = [b.name for b in buffers + calls if b.name not in placed]
    expect(not missing, stage, f"buffers {missing}", "are computed by a kernel or an extern step")

    in_memory = {b.name for b in graph.inputs if isinstance(b, InputBuffer)}
    for step in sched.steps:
        if isinstance(step, ExternCall):
            what = f"extern {step.name}"
            map_aggregate((step.args, step.kwargs), lambda a: expect(
                a.buf.name in in_memory, stage, what, f"reads buffer {a.buf.name} before a step stores it")
                if isinstance(a, View) else None)
            in_memory.update(r.name for r in ([step.result] if step.result is not None else step.items))
            continue
        what = f"kernel of {', '.join(n.name for n in step.nodes)}"
        names = {n.name for n in step.nodes}
        expect(step.stores <= names, stage, what, f"stores only its own buffers, not {sorted(step.stores - names)}")
        computed: set = set()
        for n in step.nodes:
            expect(_fits_domain(n, step), stage, f"buffer {n.name}",
                   f"fits its kernel's loops ({list(step.shape)}, reducing {step.red_dims})")
            for src in _reads(n, tuple(step.shape), step.red_dims or (), graph.sizevars):
                expect(src in in_memory or src in computed, stage, f"buffer {n.name}",
                       f"reads {src} before it is stored or computed in its kernel")
            computed.add(n.name)
        in_memory.update(step.stores)
    for i, o in enumerate(graph.outputs):
        if isinstance(o, View):
            expect(o.buf.name in in_memory, stage, f"output {i}", f"is buffer {o.buf.name}, which a step stores")
