"""Fusion: which computed buffers share a kernel, and which of them still need memory.

A kernel iterates one *domain*: a shape S, with the dims in `red_dims` reduced (none for a
pointwise kernel). Every dim of S has a loop variable (`x<d>` over the kept dims, `r<d>` over
the reduced ones). A computed buffer fits a domain when its loop space is S (pointwise over S, or a
reduction of S over the same dims) or S with the reduced dims set to 1 (per-row values, such as a
mean). Inside a kernel, a buffer produced by the same kernel is never loaded: its value is
recomputed from its body (pointwise) or taken from the register holding it (reductions) — legal
only when the consumer reads exactly the element the producer writes at the same loop
variables, which the scheduler checks by comparing index expressions.

Nodes are visited in order; each joins the kernel where fusion saves the most memory traffic
(bytes of intermediate buffers no longer written and read back, plus inputs read once instead of
twice). With nothing in common with any kernel, a node still joins the latest kernel whose domain
it fits as it is (one launch fewer); otherwise it starts a new kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import sympy

from ..lower.ir import ComputedBuffer, ExternBuffer, ExternCall, LoweredGraph, ReadRecorder, View, buffer_view, \
    compute_dtype, contiguous_strides, loop_ranges, loop_vars, use_handler
from ..lower.indexing import expanded, reshape_index
from torch.fx.node import map_aggregate

# column reductions over at least this many rows run in two stages (module docstring)
COLUMN_SPLIT_MIN_ROWS = 1024
# inner rows shorter than this are reduced second (split_outer_inner_reductions)
SHORT_INNER_ROWS = 32
# about this many partial rows (2 per SM of an H100); chunks are powers of two of at least MIN_CHUNK rows
TARGET_PARTIALS = 256
MIN_CHUNK = 8
# partials in kernels without row reductions (columns tiled too): chunks sized for about
# TILE_PROGRAMS programs of TILE_COLS columns (the launcher's column tile; H100 sweeps, bench/NOTES.md:
# chunks of 512 rows for 8192x4096, 128 for 8192x1024, within 2% of the best of 64-1024 on every
# kernel; with fewer columns, as many programs: a channels-last BatchNorm's sums over 401408 rows of
# 64 took 112 us in 98 programs, 35 in 392)
TILE_PROGRAMS, TILE_COLS = 1024, 64
# reductions of rows this long, few enough rows that a program per row leaves a GPU idle, run in two
# stages (`split_long_rows`), each program of stage 1 reducing at least MIN_SPLIT_CHUNK elements
LONG_ROW = 1 << 15
MIN_SPLIT_CHUNK = 512
# rows longer than this are reduced in a loop (codegen/triton.py), kept here for the scheduler's checks
PERSISTENT_RNUMEL_MAX = 4096


def keep_shape(shape, red_dims):
    return tuple(1 if d in red_dims else s for d, s in enumerate(shape))


def row_shapes(shape, red_dims):
    """Shapes of per-row values in a kernel over `shape` reducing `red_dims` (keepdim or not;
    without the kept dims' trailing 1s too: the per-channel [C] of a kernel over [N, C, 1, 1])."""
    kept = tuple(s for d, s in enumerate(shape) if d not in red_dims)
    squeezed = kept
    while squeezed and squeezed[-1] == 1:
        squeezed = squeezed[:-1]
    return keep_shape(shape, red_dims), kept, squeezed


def moved_row_vars(bshape, shape, red_dims):
    """The loop variables of a per-row value whose size-1 dims lie elsewhere than the reduced dims
    of a kernel over `shape` (a channels-last BatchNorm's per-channel [1, C, 1, 1] in a kernel
    summing [N, H, W, C] over N, H and W): its other dims are the kept ones, in order. None for
    other shapes, and for those `row_shapes` lists."""
    bshape = tuple(bshape)
    if not red_dims or bshape in row_shapes(shape, red_dims) or len(bshape) != len(shape):
        return None
    kept = [d for d, s in enumerate(shape) if d not in red_dims and s != 1]
    dims = [d for d, s in enumerate(bshape) if s != 1]
    if len(dims) != len(kept) or any(bshape[a] != shape[b] for a, b in zip(dims, kept)):
        return None
    out = [sympy.Integer(0)] * len(bshape)
    for a, b in zip(dims, kept):
        out[a] = sympy.Symbol(f"x{b}", integer=True, nonnegative=True)
    return out


def body_shape(buf: ComputedBuffer):
    return buf.in_shape if buf.kind in ("reduction", "partial", "scatter") else buf.shape


def row_dims(buf):
    """The dims a partial keeps (its columns): a kernel holding it reduces these per row."""
    return tuple(d for d in range(len(buf.in_shape)) if d not in buf.red_dims)


def chunk_for(rows):
    chunk = max(MIN_CHUNK, -(-rows // TARGET_PARTIALS))
    return 1 << (chunk - 1).bit_length()


def is_column_reduction(buf):
    """A reduction whose innermost dim is kept (sizes-1 dims aside): of the outer dims with the
    kept ones trailing, or batched so, kept dims outside the reduced ones too (a channels-last
    [N, H, W, C] averaged over H and W: squeeze-and-excitation, a segmentation head's pooling).
    Its partials' columns are all the kept dims, the innermost contiguous in memory; reduced per
    (n, c) as rows, each row's elements lay C apart."""
    if not isinstance(buf, ComputedBuffer) or buf.kind != "reduction":
        return False
    dims = [d for d, s in enumerate(buf.in_shape) if s != 1]
    red = [d for d in dims if d in buf.red_dims]
    kept = [d for d in dims if d not in buf.red_dims]
    at = [dims.index(d) for d in red]  # (one run of dims: the rows a chunk walks)
    return bool(red and kept) and max(red) < max(kept) and at == list(range(at[0], at[0] + len(at)))


def tile_chunk(rows, cols):
    """Chunk for partials in a kernel without row reductions (columns tiled by TILE_COLS): about
    TILE_PROGRAMS programs in all, so each streams a large tile (short chunks left the H100 at a
    third of the copy rate for bf16) and the GPU holds enough loads in flight (too few programs
    did not)."""
    chunk = max(MIN_CHUNK, -(-rows // max(1, TILE_PROGRAMS // -(-cols // TILE_COLS))))
    return 1 << (chunk - 1).bit_length()


def set_chunk(partial, stage2, chunk):
    """Partials of `chunk` rows: one row of columns per chunk, the chunks outermost in memory
    (a chunked kernel's program p stores its columns, all the kept dims, as row p)."""
    first = min(partial.red_dims)
    rows = math.prod(partial.in_shape[d] for d in partial.red_dims)
    pshape = tuple(-(-rows // chunk) if d == first else s for d, s in enumerate(stage2.shape))
    order = [first] + [d for d in range(len(pshape)) if d != first]
    dense = contiguous_strides(tuple(pshape[d] for d in order))
    stride = tuple(dense[order.index(d)] for d in range(len(pshape)))
    partial.shape, partial.stride, partial.chunk = pshape, stride, chunk
    stage2.body, stage2.in_shape, stage2.red_dims = buffer_view(partial).load, pshape, (first,)


def split_outer_inner_reductions(graph: LoweredGraph, column_partials=True):
    """A reduction of dims on both sides of the kept ones (BatchNorm's statistics: [N, C, H, W]
    over N, H and W) with rows too long for one block is split in two: stage 1 reduces the inner
    dims (rows of H*W contiguous elements, one per (n, c): N*C programs, each row in registers,
    where the whole reduction had C programs looping over N*H*W strided elements); stage 2 (the original buffer, which keeps its name, shape and readers) reduces
    stage 1's [N, C, 1, 1] over the outer dims (a column reduction, itself split in two when
    long, `split_column_reductions`). Where the inner rows are shorter than SHORT_INNER_ROWS and
    columns are split into partials, the other way round: stage 1 reduces the outer dims (a
    column reduction with every kept dim and the inner ones as columns), stage 2 the inner ones
    (a channels-last GroupNorm's [N, H, W, G, C/G] over H, W and a group's C/G channels: rows of
    C/G elements, stored in fp32 per pixel and group, wrote as many bytes as the input held)."""
    steps = []
    for buf in graph.steps:
        steps.append(buf)
        if not isinstance(buf, ComputedBuffer) or buf.kind != "reduction":
            continue
        dims = [d for d, s in enumerate(buf.in_shape) if s != 1]
        kept = [d for d in dims if d not in buf.red_dims]
        inner = tuple(d for d in dims if d in buf.red_dims and kept and d > max(kept))
        outer = tuple(d for d in buf.red_dims if d not in inner)
        rnumel = math.prod(buf.in_shape[d] for d in buf.red_dims)
        if not inner or not any(buf.in_shape[d] != 1 for d in outer) or rnumel <= PERSISTENT_RNUMEL_MAX:
            continue
        if column_partials and math.prod(buf.in_shape[d] for d in inner) < SHORT_INNER_ROWS:
            inner, outer = outer, inner  # (stage 1 over the outer dims, stage 2 the inner ones)
        shape = keep_shape(buf.in_shape, inner)
        rows = ComputedBuffer(f"{buf.name}_rows", shape, contiguous_strides(shape), compute_dtype(buf.dtype),
                              body=buf.body, kind="reduction", in_shape=buf.in_shape, red_dims=inner,
                              reduce=buf.reduce, loc=buf.loc)
        buf.body, buf.in_shape, buf.red_dims = buffer_view(rows).load, shape, outer
        steps[-1:] = [rows, buf]
    graph.steps = steps


def split_long_rows(graph: LoweredGraph):
    """A reduction of few rows, each of LONG_ROW elements or more (a loss's mean over everything,
    argmax over a decode step's vocabulary), is split in two: stage 1 reduces each of S chunks of
    every row (its outermost reduced dim of n split into (S, n / S), S a power of two dividing n,
    rows x S about TARGET_PARTIALS programs of at least MIN_SPLIT_CHUNK elements; an inner reduced
    dim where the outer ones are too short), stage 2 (the original buffer, which keeps its name,
    shape and readers) the S partials of each row. A GPU ran such a reduction as one program per
    row looping over all of it: one SM's bandwidth."""
    steps = []
    for buf in graph.steps:
        steps.append(buf)
        if not isinstance(buf, ComputedBuffer) or buf.kind != "reduction":
            continue
        sizes = [buf.in_shape[d] for d in buf.red_dims]
        red = [d for d in buf.red_dims if buf.in_shape[d] != 1]
        if not red or not all(isinstance(n, int) for n in buf.in_shape):
            continue
        rows, rnumel = math.prod(buf.in_shape) // max(math.prod(sizes), 1), math.prod(sizes)
        if rnumel < LONG_ROW:
            continue
        for d in red:  # the outermost reduced dim that splits 4 ways or more
            n, splits = buf.in_shape[d], 1
            while n % (splits * 2) == 0 and rows * splits * 2 <= TARGET_PARTIALS and \
                    rnumel // (splits * 2) >= MIN_SPLIT_CHUNK:
                splits *= 2
            if splits >= 4:
                break
        else:
            continue
        chunk = n // splits
        in_shape = buf.in_shape[:d] + (splits, chunk) + buf.in_shape[d + 1:]
        red_dims = tuple(e + (e > d) for e in buf.red_dims if e != d) + (d + 1,)
        shape = keep_shape(in_shape, red_dims)
        body = buf.body
        stage1 = ComputedBuffer(f"{buf.name}_split", shape, contiguous_strides(shape), compute_dtype(buf.dtype),
                                body=lambda idx, body=body, d=d, chunk=chunk:
                                body(list(idx[:d]) + [idx[d] * chunk + idx[d + 1]] + list(idx[d + 2:])),
                                kind="reduction", in_shape=in_shape, red_dims=tuple(sorted(red_dims)),
                                reduce=buf.reduce, loc=buf.loc)
        partials = buffer_view(stage1)
        buf.body = lambda idx, load=partials.load, d=d: load(list(idx[:d + 1]) + [0] + list(idx[d + 1:]))
        buf.in_shape = tuple(splits if e == d else 1 if e in buf.red_dims else s for e, s in enumerate(buf.in_shape))
        steps[-1:] = [stage1, buf]
    graph.steps = steps


def split_column_reductions(graph: LoweredGraph):
    """Split each long column reduction into a partial (stage 1) and the reduction of the
    partials (stage 2, the original buffer, which keeps its name, shape and readers).
    Returns {partial name: (partial, stage 2)}."""
    steps, pairs = [], {}
    for buf in graph.steps:
        if not is_column_reduction(buf):
            steps.append(buf)
            continue
        rows = math.prod(buf.in_shape[d] for d in buf.red_dims)
        if rows < COLUMN_SPLIT_MIN_ROWS:
            steps.append(buf)
            continue
        partial = ComputedBuffer(f"{buf.name}_partial", (), (), compute_dtype(buf.dtype), body=buf.body,
                                 kind="partial", in_shape=buf.in_shape, red_dims=buf.red_dims, reduce=buf.reduce,
                                 loc=buf.loc)
        set_chunk(partial, buf, chunk_for(rows))
        steps += [partial, buf]
        pairs[partial.name] = (partial, buf)
    graph.steps = steps
    return pairs


def reshaped(buf, shape):
    """`buf` is pointwise over a reshape of `shape` and stored row-major: the same elements in the
    same order (a gradient computed over [B, S, D] whose [B*S, D] view a bias gradient sums). In a
    kernel over `shape` its loop variables are the kernel's, reshaped, and it is stored at the
    kernel's row-major position; a reader of that position reads it without a load."""
    shape = tuple(shape)
    return buf.kind == "pointwise" and buf.shape != shape and math.prod(buf.shape) == math.prod(shape) and \
        all(st == cs for s, st, cs in zip(buf.shape, buf.stride, contiguous_strides(buf.shape)) if s != 1)


def fits(buf, shape, red_dims):
    """A pointwise `buf` can be computed in a kernel over `shape` reducing `red_dims`."""
    if buf.kind == "scatter":  # (in pointwise kernels of its own domain only)
        return not red_dims and buf.in_shape == tuple(shape)
    return buf.shape == tuple(shape) or buf.shape in row_shapes(shape, red_dims) or reshaped(buf, shape) or \
        buf.kind == "pointwise" and moved_row_vars(buf.shape, shape, red_dims) is not None


def node_vars(buf, shape, red_dims, sizevars):
    """The loop variables `buf`'s body is evaluated at, in a kernel over `shape` reducing `red_dims`."""
    if reshaped(buf, shape):
        env = SimpleNamespace(sizevars=sizevars, ranges=loop_ranges(shape, red_dims))
        return reshape_index(loop_vars(shape, red_dims), shape, buf.shape, env)
    moved = buf.kind == "pointwise" and moved_row_vars(buf.shape, shape, red_dims)
    if moved:
        return moved
    if buf.kind in ("reduction", "partial", "scatter") or len(buf.shape) == len(shape):
        return loop_vars(body_shape(buf), red_dims)
    kept = [d for d in range(len(shape)) if d not in red_dims]  # a per-row value without the reduced dims
    return [sympy.Integer(0) if s == 1 else sympy.Symbol(f"x{d}", integer=True, nonnegative=True)
            for d, s in zip(kept, buf.shape)]


def node_ranges(buf, shape, red_dims, sizevars):
    """The extents of the loop variables in `node_vars(buf, shape, red_dims)`."""
    if reshaped(buf, shape):
        return loop_ranges(shape, red_dims)
    if (buf.kind in ("reduction", "partial", "scatter") or len(buf.shape) == len(shape)) and \
            not (buf.kind == "pointwise" and moved_row_vars(buf.shape, shape, red_dims)):
        return loop_ranges(body_shape(buf), red_dims)
    return {v: s for v, s in zip(node_vars(buf, shape, red_dims, sizevars), buf.shape) if isinstance(v, sympy.Symbol)}


def store_index(buf, shape, red_dims, sv):
    if reshaped(buf, shape):
        out_vars, strides = loop_vars(shape, red_dims), contiguous_strides(shape)
    else:
        out_vars = loop_vars(buf.shape, red_dims) if buf.kind == "reduction" else node_vars(buf, shape, red_dims, sv)
        strides = buf.stride
    return expanded(sum((v * sv(st) for v, st in zip(out_vars, strides)), sympy.Integer(0)))


@dataclass(eq=False)
class FusedKernel:
    nodes: list
    shape: tuple
    red_dims: tuple | None  # None: pointwise kernel
    stores: set = field(default_factory=set)  # names of buffers written to memory

    @property
    def is_reduction(self):
        return self.red_dims is not None

    @property
    def chunk(self):
        """Rows per program when the kernel computes partials (stage 1 of column reductions)."""
        return next((n.chunk for n in self.nodes if n.kind == "partial"), None)

    @property
    def has_row_reductions(self):
        return any(n.kind == "reduction" for n in self.nodes)

    def rnumel(self):
        return math.prod(self.shape[d] for d in self.red_dims or ())


@dataclass
class Schedule:
    steps: list  # FusedKernel | ExternCall

    def describe(self) -> str:
        lines = []
        for s in self.steps:
            if isinstance(s, ExternCall):
                lines.append(f"extern {s.prim.name} -> {s.name}")
                continue
            over = f"reduction over {list(s.shape)} reducing dims {list(s.red_dims)}" if s.is_reduction else \
                f"pointwise over {list(s.shape)}"
            if s.chunk:
                over += f", partials of {s.chunk} rows"
            lines.append(f"kernel ({over}): {', '.join(n.name for n in s.nodes)}; "
                         f"stores {', '.join(sorted(s.stores)) or 'nothing'}")
        return "\n".join(lines)


class Scheduler:
    def __init__(self, graph: LoweredGraph, reads=None):
        self.graph = graph
        self.sv = graph.sizevars
        self._reads: dict = {} if reads is None else reads  # (name, shape, red_dims) -> loads of its body
        self.group_of: dict = {}  # buffer name -> FusedKernel
        self.position: dict = {}  # id(step) -> index in steps
        self.readers: dict = {}  # buffer name -> {id: FusedKernel} of the kernels reading it

    def reads(self, buf, shape, red_dims):
        key = (buf.name, shape, red_dims)
        if key not in self._reads:
            rec = ReadRecorder(self.sv, node_ranges(buf, shape, red_dims, self.sv))
            with use_handler(rec):
                buf.body(node_vars(buf, shape, red_dims, self.sv))
            self._reads[key] = rec.reads
        return self._reads[key]

    def sources(self, buf):
        """Names of the buffers `buf` reads (the same in every domain it may be computed in)."""
        red = row_dims(buf) if buf.kind == "partial" else buf.red_dims if buf.kind == "reduction" else ()
        return {src.name for src, _ in self.reads(buf, body_shape(buf), red)}

    def domain_for(self, kernel: FusedKernel, buf: ComputedBuffer):
        """The domain (shape, red_dims) the kernel would iterate with `buf` in it, or None."""
        if buf.kind in ("reduction", "partial"):
            shape, red = (buf.in_shape, row_dims(buf)) if buf.kind == "partial" else (buf.in_shape, buf.red_dims)
            if kernel.is_reduction:
                if (kernel.shape, kernel.red_dims) != (shape, red):
                    return None
                # partials keep whole rows in registers: no looped row reductions beside them
                partials = kernel.chunk is not None or buf.kind == "partial"
                row_red = kernel.has_row_reductions or buf.kind == "reduction"
                if partials and row_red and kernel.rnumel() > PERSISTENT_RNUMEL_MAX:
                    return None
                if kernel.chunk is not None and buf.kind == "partial" and buf.chunk != kernel.chunk:
                    return None
                return shape, red
            # a pointwise kernel turns into a reduction kernel if all its nodes fit
            return (shape, red) if all(fits(n, shape, red) for n in kernel.nodes) else None
        if kernel.is_reduction:
            return (kernel.shape, kernel.red_dims) if fits(buf, kernel.shape, kernel.red_dims) else None
        return (kernel.shape, None) if body_shape(buf) == kernel.shape or reshaped(buf, kernel.shape) else None

    def fusion_score(self, kernel: FusedKernel, buf: ComputedBuffer):
        """Bytes of memory traffic saved by computing `buf` in `kernel`, or None if illegal."""
        domain = self.domain_for(kernel, buf)
        if domain is None:
            return None
        shape, red = domain[0], domain[1] or ()
        here = self.position[id(kernel)]
        read_by_kernel = {b.name for n in kernel.nodes for b, _ in self.reads(n, shape, red)}
        saved = 0
        for src, index in self.reads(buf, shape, red):
            producer = self.group_of.get(src.name)
            if producer is kernel:
                # a partial is read by stage 2 only, after the whole kernel; a scatter's elements
                # are not those its kernel's loop variables name
                if src.kind in ("partial", "scatter"):
                    return None
                if index != store_index(src, shape, red, self.sv):
                    return None
                saved += 2 * src.numel() * src.dtype.itemsize
                continue
            if self._producer_position(src, producer) > here:
                return None
            if src.name in read_by_kernel:
                saved += src.numel() * src.dtype.itemsize
        return saved

    def _producer_position(self, src, producer):
        if producer is not None:
            return self.position[id(producer)]
        if isinstance(src, ExternBuffer):
            return self.position[id(src.call)]
        return -1

    def run(self) -> Schedule:
        steps: list = []
        for step in self.graph.steps:
            if isinstance(step, ExternCall):
                self.position[id(step)] = len(steps)
                steps.append(step)
                continue
            # traffic is saved only in kernels that compute or read what `step` reads: those are
            # scored (scoring every kernel was quadratic: 269k scorings in GPT-2 training's first call)
            sources = self.sources(step)
            related = {id(k): k for name in sources for k in (
                *([self.group_of[name]] if name in self.group_of else []), *self.readers.get(name, {}).values())}
            scored = [(self.fusion_score(k, step), k) for k in related.values()]
            scored = [(s, k) for s, k in scored if s]
            if not scored:  # no traffic in common, but one launch fewer (horizontal fusion): the
                # latest kernel that iterates a domain it fits (a saved copy of a bias [C] joins
                # the kernel of per-channel statistics before the [N, C, H, W] normalization)
                candidates = [k for k in steps if isinstance(k, FusedKernel)]
                scored = next(([(0, k)] for k in reversed(candidates) if self.domain_for(k, step) == (k.shape, k.red_dims)
                               and not reshaped(step, k.shape) and self.fusion_score(k, step) == 0), [])
            if scored:
                _, best = max(scored, key=lambda sk: (sk[0], self.position[id(sk[1])]))
                best.shape, best.red_dims = self.domain_for(best, step)
                best.nodes.append(step)
            else:
                red = row_dims(step) if step.kind == "partial" else step.red_dims if step.kind == "reduction" else None
                best = FusedKernel([step], body_shape(step), red)
                self.position[id(best)] = len(steps)
                steps.append(best)
            self.group_of[step.name] = best
            for name in sources:
                self.readers.setdefault(name, {})[id(best)] = best
        self._mark_stores(steps)
        return Schedule(steps)

    def _mark_stores(self, steps):
        needed = {o.buf.name for o in self.graph.outputs if isinstance(o, View)}
        for step in steps:
            if isinstance(step, ExternCall):
                map_aggregate((step.args, step.kwargs),
                              lambda a: needed.add(a.buf.name) if isinstance(a, View) else None)
                continue
            red = step.red_dims or ()
            for n in step.nodes:
                needed.update(src.name for src, _ in self.reads(n, step.shape, red)
                              if self.group_of.get(src.name) is not step)
        for step in steps:
            if isinstance(step, FusedKernel):
                step.stores = {n.name for n in step.nodes if n.name in needed or n.kind == "scatter"}


def schedule(graph: LoweredGraph, column_partials=True) -> Schedule:
    """`column_partials`: long column reductions and few long rows run in two stages
    (`split_column_reductions`, `split_long_rows`), as a GPU needs to keep its cores busy; a CPU's
    few threads share the columns, or a long row, instead."""
    split_outer_inner_reductions(graph, column_partials)
    if column_partials:
        split_long_rows(graph)
    pairs = split_column_reductions(graph) if column_partials else {}
    scheduler = Scheduler(graph)
    sched = scheduler.run()
    # partials that found no row kernel to join: chunks sized with the column tiles (longer where
    # there are many columns, shorter where few: 64 channels of a ResNet's first stage), then
    # schedule again with the new partial shapes
    changed = False
    for k in sched.steps:
        if isinstance(k, FusedKernel) and k.chunk and not k.has_row_reductions:
            for n in k.nodes:
                if n.kind == "partial":
                    rows = math.prod(n.in_shape[d] for d in n.red_dims)
                    chunk = tile_chunk(rows, math.prod(n.in_shape) // max(rows, 1))
                    if chunk != n.chunk:
                        set_chunk(*pairs[n.name], chunk)
                        changed = True
    # (the first pass's read analysis holds: a stage 2 reading a partial anew has a new input shape,
    # so a new key)
    return Scheduler(graph, scheduler._reads).run() if changed else sched
