"""Reductions in Triton kernels: their templates, the reduction of a block's rows, a chunked
kernel's partials, and a looped kernel's loop over a row, with online softmax (a max and a sum of
exp(x - max) in one pass). max/min reductions propagate NaN (combine functions with
`tl.PropagateNan.ALL`: `tl.max` drops NaN). The reductions (`prim.sum`, `prod`, `amax`, `amin`)
name their combine in ops/primitives.py (`reduce=`); its Triton forms are here.
"""
from __future__ import annotations

import contextlib

import sympy
import torch

from ..lower.indexing import expanded
from ..lower.ir import OpsHandler, compute_dtype, use_handler
from .triton_expressions import CV, TL_DTYPES, TritonExpressions


# max and min propagate NaN as torch's do (tl.max and a bare tl.maximum drop it)
REDUCE_FINAL = {"sum": "tl.sum({0}, 1)", "max": "tl.reduce({0}, 1, _max_combine)",
                "min": "tl.reduce({0}, 1, _min_combine)", "prod": "tl.reduce({0}, 1, _prod_combine)"}
REDUCE_AXIS0 = {"sum": "tl.sum({0}, 0)", "max": "tl.reduce({0}, 0, _max_combine)",
                "min": "tl.reduce({0}, 0, _min_combine)", "prod": "tl.reduce({0}, 0, _prod_combine)"}
REDUCE_COMBINE = {"sum": "{0} + {1}", "max": "tl.maximum({0}, {1}, tl.PropagateNan.ALL)",
                  "min": "tl.minimum({0}, {1}, tl.PropagateNan.ALL)", "prod": "{0} * {1}"}
# combine functions that tl.reduce calls, defined in a kernel's module when it uses them
COMBINE_FNS = {r: f"def _{r}_combine(a, b):\n    return {REDUCE_COMBINE[r].format('a', 'b')}"
               for r in ("max", "min", "prod")}


def neutral(reduce, dtype):
    if reduce in ("sum", "prod"):
        v = 0 if reduce == "sum" else 1
        return repr(float(v)) if dtype.is_floating_point else str(v)
    if dtype.is_floating_point:
        return 'float("-inf")' if reduce == "max" else 'float("inf")'
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    if info is None:
        return "0" if reduce == "max" else "1"
    return str(info.min if reduce == "max" else info.max)


class TritonReductions(TritonExpressions):
    """A kernel writer's reductions (in KernelWriter's loop structure: `mode`, `need_rmask`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.accs: dict[str, str] = {}  # partial's name -> its accumulator
        self.combines: set[str] = set()  # reductions whose combine function the kernel defines

    def reduction(self, buf, looped):
        value = buf.body(self.vars_for(buf))
        dtype = compute_dtype(buf.dtype)
        shape = self.block_shape()
        with self.at(buf.loc):
            self.op_names.add({"max": "amax", "min": "amin"}.get(buf.reduce, buf.reduce))
            self.combines.add(buf.reduce)
            if value.literal:
                value = CV(f"tl.full({shape}, {value}, {TL_DTYPES[dtype]})", dtype)
            elif self.axes(value.expr) != {"x", "r"}:  # a value constant along an axis of the block
                value = self.broadcast(value, shape, dtype)
            if looped:
                return value
            if self.need_rmask:
                value = self.cse(f"tl.where(rmask, {value}, {neutral(buf.reduce, dtype)})", dtype)
            result = self.cse(REDUCE_FINAL[buf.reduce].format(value) + "[:, None]", dtype)
            self.varies[result.expr] = frozenset("x")
            return self.round(result, buf.dtype)

    def broadcast(self, value, shape, dtype):
        """`value`, constant along an axis of the block, as the whole block. A scalar (a load at a
        constant index and what is computed from it: the sum of a 0-d value) joins it by an
        operation with a neutral splat: tl.broadcast_to takes only equal ranks, and the
        interpreter gives such a load rank 1."""
        if self.axes(value.expr):
            return self.cse(f"tl.broadcast_to({value}, {shape})", dtype)
        op, neutral_value = ("|", "0") if dtype == torch.bool else ("+", "-0.0" if dtype.is_floating_point else "0")
        return self.cse(f"{value} {op} tl.full({shape}, {neutral_value}, {TL_DTYPES[dtype]})", dtype)

    def partial(self, buf):
        """Add this block's rows of a partial to its accumulator."""
        value = buf.body(self.vars_for(buf))
        dtype = compute_dtype(buf.dtype)
        with self.at(buf.loc):
            self.op_names.add({"max": "amax", "min": "amin"}.get(buf.reduce, buf.reduce))
            self.combines.add(buf.reduce)
            if value.literal:
                value = CV(f"tl.full([XBLOCK, RBLOCK], {value}, {TL_DTYPES[dtype]})", dtype)
            elif self.axes(value.expr) != {"x", "r"}:
                value = self.broadcast(value, "[XBLOCK, RBLOCK]", dtype)
            if self.need_xmask:  # rows past the end (last chunk)
                value = self.cse(f"tl.where(xmask, {value}, {neutral(buf.reduce, dtype)})", dtype)
            acc = self.accs[buf.name]
            self.emit(f"{acc} = {REDUCE_COMBINE[buf.reduce].format(acc, value.expr)}")

    @contextlib.contextmanager
    def row_loop(self):
        self.emit("for roffset in range(0, rnumel, RBLOCK):")
        with self.scope():
            self.emit("rindex = roffset + tl.arange(0, RBLOCK)[None, :]")
            self.emit("rmask = rindex < rnumel")
            self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
            yield

    def _looped_run(self, buf):
        """(the reductions computed in one loop with `buf`, the (max, sum) pairs among them that
        loop computes online): `_independent_run`, and where `buf` is a max whose sum of
        exp(x - max) follows (softmax's denominator, cross-entropy's), that sum too, and the
        reductions after it that read neither. A 50257-word row is then read once, not twice."""
        run = self._independent_run(buf)
        partner = self._online_partner(buf)
        if partner is None:
            return run, ()
        run.append(partner)
        # later reductions join while they read no reduction still to compute (the run's, or one
        # passed over between the max and its sum)
        nodes = self.kernel.nodes
        pending = {n.name for n in nodes if n.kind == "reduction" and n.name not in self.values}
        for nxt in nodes[nodes.index(partner) + 1:]:
            if nxt.kind == "reduction":
                if self._reads_any(nxt, pending):
                    break
                run.append(nxt)
        return run, ((buf, partner),)

    def _online_partner(self, m):
        """The first reduction after max `m` that reads it, if it sums exp(x - m) over m's own x."""
        if m.reduce != "max" or not m.dtype.is_floating_point:
            return None
        nodes = self.kernel.nodes
        s = next((n for n in nodes[nodes.index(m) + 1:] if n.kind == "reduction" and self._reads_any(n, {m.name})),
                 None)
        if s is None or s.reduce != "sum" or (s.in_shape, s.red_dims) != (m.in_shape, m.red_dims):
            return None
        tree = _Tree(self)
        x, summand = tree.of(m), tree.of(s)
        if summand[0] == "exp" and summand[1][0][0] == "sub":
            a, b = summand[1][0][1]
            if a == x and b[0] == "load" and b[1] == m.name:
                return s
        return None

    def looped_reductions(self, bufs, online=()):
        """Reductions of a looped kernel in one loop over the row: none reads another, except the
        sum of each (max, sum) pair in `online`, which sums exp(x - max) over the max's own x. Each
        lane keeps its running max m and its sum s relative to m, rescaled by exp(m - m') as m
        grows to m' (online softmax); after the loop the lanes' sums are rescaled to the row's max.
        A max of -inf so far stands as 0 in those exponents (exp(-inf - -inf) would be NaN), and a
        row all -inf sums to NaN, as exp(x - max) does there in eager; NaN and +inf propagate."""
        sums = {s.name: m for m, s in online}
        accs = {}
        for buf in bufs:
            dtype = compute_dtype(buf.dtype)
            accs[buf.name] = self.new_tmp("xr")
            self.emit(f"{accs[buf.name]} = tl.full([XBLOCK, RBLOCK], {neutral(buf.reduce, dtype)}, "
                      f"{TL_DTYPES[dtype]})", loc=buf.loc)
        with self.row_loop():
            for buf in bufs:
                acc = accs[buf.name]
                if buf.name in sums:  # updated with its max, below
                    continue
                with self.at(buf.loc):
                    value = self.reduction(buf, looped=True)
                    combined = REDUCE_COMBINE[buf.reduce].format(acc, value)
                    partner = next((s for m, s in online if m is buf), None)
                    if partner is None:
                        self.emit(f"{acc} = tl.where(rmask, {combined}, {acc})")
                        continue
                    self.op_names.add("exp")
                    grown, shift, total = self.new_tmp("xr"), self.new_tmp("xr"), accs[partner.name]
                    self.emit(f"{grown} = tl.where(rmask, {combined}, {acc})")
                    self.emit(f'{shift} = tl.where({grown} == float("-inf"), 0.0, {grown})')
                    self.emit(f"{total} = tl.where(rmask, {total} * tl.exp({acc} - {shift}) + "
                              f"tl.exp({value} - {shift}), {total})")
                    self.emit(f"{acc} = {grown}")
        for buf in bufs:
            acc = accs[buf.name]
            with self.at(buf.loc):
                dtype = compute_dtype(buf.dtype)
                m = sums.get(buf.name)
                if m is None:
                    result = self.cse(REDUCE_FINAL[buf.reduce].format(acc) + "[:, None]", dtype)
                else:
                    row_max = self.values[m.name]
                    shift = self.cse(f'tl.where({row_max} == float("-inf"), 0.0, {row_max})', dtype)
                    total = self.cse(f"tl.sum({acc} * tl.exp({accs[m.name]} - {shift}), 1)[:, None]", dtype)
                    result = self.cse(f'tl.where({row_max} == float("-inf"), float("nan"), {total})', dtype)
                self.varies[result.expr] = frozenset("x")
                self.values[buf.name] = self.round(result, buf.dtype)


class _Tree(OpsHandler):
    """Ops handler that evaluates a kernel node's body to a tree of tuples (op, operands, dtype),
    the kernel's pointwise nodes inlined and identities dropped: two bodies computing the same
    value from the same loads give equal trees (KernelWriter._online_partner)."""

    def __init__(self, writer):
        self.writer = writer
        self.sizevars, self.ranges = writer.sizevars, writer.ranges  # (what bodies ask of a handler)

    def of(self, buf):
        with use_handler(self):
            return buf.body(self.writer.vars_for(buf))

    def at(self, loc):
        return contextlib.nullcontext()

    def load(self, buf, index):
        dep = self.writer.group.get(buf.name)
        if dep is not None and dep.kind == "pointwise":
            return dep.body(self.writer.vars_for(dep))
        return ("load", buf.name, expanded(index))

    def constant(self, value, dtype):
        return ("constant", value, dtype)

    def pointwise(self, p, vals, out_dtype):
        if p.name in ("copy", "stop_gradient"):
            return vals[0]
        return (p.name, tuple(vals), out_dtype)

    def to_dtype(self, v, dtype):
        return v if isinstance(v, tuple) and v[-1] == dtype else ("to", (v,), dtype)

    def masked(self, conds, body, other, dtype):
        return ("masked", (tuple(conds), body(), other), dtype)

    def index_value(self, e, dtype):
        return ("index", expanded(e), dtype)

    def random(self, kind, stream, flat):
        return ("random", object(), None)  # equal to no other value

    def indirect(self, v):
        return sympy.Symbol(f"indirect{v!r}", integer=True)  # (equal for equal trees)
