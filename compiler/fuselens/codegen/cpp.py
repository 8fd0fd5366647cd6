"""C++ source for one FusedKernel (CPU tensors): the kernel writer, a second implementation of the
ops handler beside codegen/triton.py's, from the same loop IR and fusion decisions.

A kernel is one `extern "C"` function of raw pointers and (in graphs with dynamic sizes) size
arguments, so its library needs no Python or ATen headers (cpp_build.py builds a program's kernels
as one library). Its loops are the kernel's domain, one `for` a dim (loop variables `x<d>` over the
kept dims, `r<d>` over the reduced ones, the index expressions' own symbols):

  pointwise  the outer dims shared among OpenMP threads (`omp parallel for collapse`), the
             innermost vectorised (`omp simd`); the body is straight-line code of the kernel's
             fused nodes, no temporaries in memory.
  reduction  the kept dims outer, parallel; in each row, a loop over the reduced dims per run of
             reductions that read none of each other (`omp simd reduction`: vector accumulators),
             then the row's values, then a loop storing what is over the whole domain. Where the
             rows are fewer than the threads (a sum of everything), each loop over a row is split
             among the threads instead (`omp parallel for simd reduction`).
  column     a reduction whose one kept dim is innermost (a bias gradient): threads share tiles
             of columns, each walks the rows in memory order with an accumulator per column,
             storing what is over the whole domain as it goes (`column_body`).

A value computed in the innermost loop but independent of its variable goes before that loop
(cpp_expressions.py's HoistPoint).

Float sums accumulate in float vector lanes over at most SUM_CHUNK elements of the innermost
reduced loop, each chunk's sum added to a double (close to eager's cascade sums of float32 for any
row length, at the float loop's speed);
max/min propagate NaN (a flag beside the vector max: `omp simd reduction(max:)` drops it).
"""
from __future__ import annotations

import contextlib
import math
import re

import sympy
import torch

from ..lower.ir import compute_dtype, use_handler
from ..schedule.fusion import FusedKernel, moved_row_vars, row_shapes, store_index
from .cpp_expressions import C_TYPES, TEMPORARY, CppExpressions, HoistPoint, input_pointee, literal
from .kernel_expressions import CV
from . import cpp_vml
from .cpp_tables import tabulate

DEFINITION = re.compile(r"^[\w:]+ (tmp\d+) = ")

# a loop nest shares its iterations among threads only from this many elements (a parallel
# region's start and join cost microseconds)
PARALLEL_MIN_ELEMENTS = 1 << 15
# at most this many columns in a thread's tile of a column reduction (its accumulators stay in L1)
COLUMN_TILE = 256
# a pointwise kernel that transposes (`transposed_dim`) walks tiles of this many elements of the
# loads' contiguous dim by as many of the stores' (each cache line it reads used whole while in L1)
TRANSPOSE_TILE = 32
# at most this many elements in a row cache array (cpp_expressions.py; on the thread's stack: 64
# KiB of floats, 128 of doubles)
ROW_CACHE_MAX = 16384
# the most elements of a row a float sum's lanes add before their sum goes into the double
# accumulator (a lane of 16 adds at most 64; a double in the loop halves the lanes and converts
# each value: bf16 layer norm 2.9 -> 2.6 ms on 2 threads)
SUM_CHUNK = 1024


def accumulator_dtype(reduce, dtype):
    """What a reduction of compute dtype `dtype` accumulates in."""
    if reduce == "sum" and dtype.is_floating_point:
        return torch.float64
    if not dtype.is_floating_point:
        return torch.int64 if reduce in ("sum", "prod") else torch.int32 if dtype == torch.bool else dtype
    return dtype


class Accumulators(list):
    """(buf, accumulator, NaN flag or None) of each reduction of a loop; `partials`: the float
    sums' accumulator -> the float partial the innermost loop adds to (SUM_CHUNK)."""

    def __init__(self, accs, partials):
        super().__init__(accs)
        self.partials = partials

    def clauses(self, partial=False):
        """The OpenMP reduction clauses of the accumulators (of the partials, where `partial`)."""
        out = []
        for buf, acc, nan in self:
            op = {"sum": "+", "prod": "*"}.get(buf.reduce, buf.reduce)
            out.append(f" reduction({op}:{self.partials.get(acc, acc) if partial else acc})" +
                       (f" reduction(|:{nan})" if nan else ""))
        return "".join(out)


class CppKernelWriter(CppExpressions):
    """Writes one FusedKernel's C++ source (`generate`): the ops handler its nodes' bodies run
    against, in the loops of the module docstring."""

    def __init__(self, kernel: FusedKernel, name_index: int, sizevars, dynamic_values, threads):
        super().__init__(kernel, sizevars, dynamic_values)
        self.index_in_graph = name_index
        # (the wrapper's in-place analysis: each element of a store over the domain is written
        # by the loop iteration that reads it, after every read of the row, as Triton's persistent kernels)
        self.mode = "persistent" if kernel.is_reduction else "pointwise"
        self.threads = threads
        self.split_rows = kernel.is_reduction and self.xnumel < 2 * threads and \
            self.xnumel * self.rnumel >= PARALLEL_MIN_ELEMENTS
        self.row_loops = 0
        self.to_cache = []  # (key, C type) of the values the row cache keeps (a second generation's)
        self.columns = True  # whether a column reduction may be (a second generation's: columns_read_across)
        self.transpose = None  # the dim a pointwise kernel's loads are contiguous along (transposed_dim)
        self.interior = None  # (lo, hi) of interior loops (a second generation's: interior_split)
        # a kernel writing into a graph input at positions read from a tensor (a scatter, pointwise
        # kernels only) returns whether one was out of range (not stored): the launch raises, and the
        # graph's eager run then raises eager's error (backend/driver.py)
        self.out_of_range = " reduction(|:fl_out_of_range)" if any(n.kind == "scatter" for n in kernel.nodes) else ""

    # --- loops ------------------------------------------------------------------------------------
    def var(self, d):
        return f"{'r' if d in self.red else 'x'}{d}"

    def parallel_if(self):
        """The `if` clause of a parallel loop nest: whether the kernel's whole domain is worth
        threads, where its sizes are known only at the call."""
        if self.static_shape:
            return ""
        work = " * ".join(self.expr(self.sizevars(s)) for s in self.kernel.shape if s != 1) or "1"
        return f" if({work} >= {PARALLEL_MIN_ELEMENTS})"

    @contextlib.contextmanager
    def loop_nest(self, dims, parallel, simd, reductions="", sums=None):
        """`for` loops over `dims`, outermost first. `parallel`: the nest's iterations shared among
        threads (all its loops but the innermost, or that one alone, which is then also vectorised);
        `simd`: the innermost vectorised. `reductions`: the OpenMP reduction clauses of the
        accumulators the body updates. `sums`: the float sums (`Accumulators`) whose body adds to
        a partial of the innermost loop (`innermost_sum_loop`; none where the nest has no loop)."""
        if not dims:
            if sums is not None:
                sums.partials.clear()
            yield
            return
        parallel = parallel and (not self.static_shape or self.xnumel * self.rnumel >= PARALLEL_MIN_ELEMENTS)
        inner, outer = dims[-1], dims[:-1]
        if parallel and not simd:  # every loop shared (a reduction kernel's rows)
            inner, outer = None, dims
        # too few outer iterations to share among threads: the innermost loop is shared instead
        # (one parallel region per outer iteration: a long row of a few)
        inner_shared = parallel and inner is not None and \
            math.prod(self.kernel.shape[d] for d in outer) < 4 * self.threads
        opened = 0
        if parallel and outer and not inner_shared:
            collapse = f" collapse({len(outer)})" if len(outer) > 1 else ""
            self.emit(f"#pragma omp parallel for{collapse}{reductions}{self.parallel_if()}")
        for d in outer:
            self.open_for(d)
            opened += 1
        row_loop = self.row_loop
        if self.row_cache_ok() and dims == self.r_dims:
            self.row_loops += 1
            self.row_loop = (self.var(inner), self.row_loops)
        try:
            if inner is None:
                yield
            elif sums is not None and sums.partials:
                with self.innermost_sum_loop(inner, parallel and (not outer or inner_shared), reductions, sums):
                    yield
            else:
                if parallel and (not outer or inner_shared):
                    self.emit(f"#pragma omp parallel for simd{reductions}{self.parallel_if()}")
                elif simd:
                    self.emit(f"#pragma omp simd{reductions}")
                self.open_for(inner, hoist=True)
                yield
                self.close_brace()
        finally:
            for _ in range(opened):
                self.close_brace()
            self.row_loop = row_loop

    @contextlib.contextmanager
    def innermost_sum_loop(self, d, parallel, reductions, sums):
        """The innermost (vectorised) loop over `d` of a loop nest whose body adds to float sums'
        partials: each partial set to 0 before it and added to its double accumulator after it;
        a loop longer than SUM_CHUNK walks its chunks (shared among threads where `parallel`)."""
        n = self.expr(self.sizevars(self.kernel.shape[d]))  # (digits where the size is static)
        chunked = not n.isdigit() or int(n) > SUM_CHUNK
        start, stop = "0", None
        if chunked:
            v = self.var(d)
            if parallel:
                self.emit(f"#pragma omp parallel for{reductions}{self.parallel_if()}")
            self.open_block(f"for (int64_t {v}c = 0; {v}c < {n}; {v}c += {SUM_CHUNK}) {{")
            start, stop = f"{v}c", f"({v}c + {SUM_CHUNK} < {n} ? {v}c + {SUM_CHUNK} : {n})"
        for part in sums.partials.values():
            self.depth[part] = len(self.scopes)
            self.emit(f"float {part} = 0.0f;")
        pragma = "omp parallel for simd" if parallel and not chunked else "omp simd"
        clauses = sums.clauses(partial=True)
        self.emit(f"#pragma {pragma}{clauses}{self.parallel_if() if parallel and not chunked else ''}")
        self.open_for(d, hoist=True, start=start, stop=stop)
        yield
        self.close_brace()
        for acc, part in sums.partials.items():
            self.emit(f"{acc} += {part};")
        if chunked:
            self.close_brace()

    def row_cache_ok(self):
        """Whether the kernel's loops over a row may keep values in a row cache: one reduced dim of a
        known size, each row walked by one thread."""
        return self.kernel.is_reduction and not self.split_rows and len(self.r_dims) == 1 and \
            self.static_shape and self.rnumel <= ROW_CACHE_MAX

    def open_for(self, d, hoist=False, start="0", stop=None):
        """`hoist`: values in its body that do not depend on its variable go before it (the line
        before its header is its #pragma), as the loops of a collapsed nest cannot have them."""
        v = self.var(d)
        stop = stop or self.expr(self.sizevars(self.kernel.shape[d]))
        at = len(self.lines) - 1 if hoist and self.lines and self.lines[-1][1].startswith("#pragma") else \
            len(self.lines) if hoist else None
        self.emit(f"for (int64_t {v} = {start}; {v} < {stop}; {v}++) {{")
        self.scopes.append({})
        self.indent += 1
        self.hoist_points.append(HoistPoint(v, at, self.indent - 1, len(self.scopes)))

    def open_block(self, header):
        """A block (a loop the nest helpers do not make) whose values stay in it."""
        self.emit(header)
        self.scopes.append({})
        self.indent += 1
        self.hoist_points.append(None)

    def close_brace(self):
        self.indent -= 1
        self.scopes.pop()
        self.hoist_points.pop()
        self.emit("}")

    # --- stores -----------------------------------------------------------------------------------
    def store(self, buf, value):
        ptr = self.arg_for(buf, self.out_args, "out_ptr")
        conds = []
        if buf.kind == "scatter":  # at the positions its body computes, where they are in range
            value, index, index_text, conds = self.scatter_parts(value)
        else:
            index = store_index(buf, self.kernel.shape, self.red, self.sizevars)
            index_text = self.expr(index)
        self.store_sites.setdefault(buf.name, set()).add(self.site(index, None))
        if not (compute_dtype(buf.dtype) != buf.dtype and value.dtype == torch.float32):
            value = self.to_dtype(value, buf.dtype)  # (a float is stored to a half type rounded)
        stored = value.expr if C_TYPES[buf.dtype] == C_TYPES[value.dtype] else \
            self.bf16_bits_text(value) if buf.dtype == torch.bfloat16 else f"{C_TYPES[buf.dtype]}({value})"
        if conds:
            self.emit(f"if ({self.AND.join(conds)}) {ptr}[{index_text}] = {stored}; else fl_out_of_range = 1;",
                      loc=buf.loc or self.loc)
        else:
            self.emit(f"{ptr}[{index_text}] = {stored};", loc=buf.loc or self.loc)

    # --- reductions -------------------------------------------------------------------------------
    def declare_accumulators(self, bufs, lanes=None):
        """The `Accumulators` of the reductions `bufs`, declared (`lanes`: an array of that many,
        one a column)."""
        accs, partials = [], {}
        for buf in bufs:
            dtype = compute_dtype(buf.dtype)
            acc_dtype = accumulator_dtype(buf.reduce, dtype)
            acc = f"acc{self.tmp}"
            self.tmp += 1
            neutral = {"sum": 0, "prod": 1}.get(buf.reduce)
            if neutral is None:
                neutral = float("-inf" if buf.reduce == "max" else "inf") if dtype.is_floating_point else \
                    (0 if buf.reduce == "max" else 1) if dtype == torch.bool else \
                    (torch.iinfo(dtype).min if buf.reduce == "max" else torch.iinfo(dtype).max)
            nan = f"{acc}_nan" if buf.reduce in ("max", "min") and dtype.is_floating_point else None
            declared = [(C_TYPES[acc_dtype], acc, literal(neutral, acc_dtype))] + ([("int", nan, "0")] if nan else [])
            for c_type, name, value in declared:
                self.depth[name] = len(self.scopes)
                if lanes is None:
                    self.emit(f"{c_type} {name} = {value};", loc=buf.loc)
                else:
                    self.emit(f"{c_type} {name}[{lanes}];", loc=buf.loc)
                    self.emit(f"for (int64_t i = 0; i < {lanes}; i++) {name}[i] = {value};")
            if lanes is None and dtype == torch.float32 and acc_dtype == torch.float64:
                partials[acc] = f"{acc}_part"
            accs.append((buf, acc, nan))
        return Accumulators(accs, partials)

    def accumulate(self, accs, lane=""):
        """Each reduction's element at the loop variables, combined into its accumulator (`lane`:
        the subscript of an array of them), a float sum's into its partial."""
        for buf, acc, nan in accs:
            with self.at(buf.loc):
                self.op_names.add({"max": "amax", "min": "amin"}.get(buf.reduce, buf.reduce))
                v = buf.body(self.vars_for(buf)).expr
                acc = accs.partials.get(acc, acc) + lane
                if buf.reduce in ("sum", "prod"):
                    self.emit(f"{acc} {'+' if buf.reduce == 'sum' else '*'}= {v};")
                else:
                    self.emit(f"{acc} = {v} {'>' if buf.reduce == 'max' else '<'} {acc} ? {v} : {acc};")
                    if nan:
                        self.emit(f"{nan}{lane} |= {v} != {v};")

    def finish(self, accs, lane=""):
        for buf, acc, nan in accs:
            with self.at(buf.loc):
                dtype = compute_dtype(buf.dtype)
                acc += lane
                text = f"{C_TYPES[dtype]}({acc})" if dtype != torch.bool else f"{acc} != 0"
                if nan:
                    text = f"{nan}{lane} ? {literal(float('nan'), dtype)} : {text}"
                self.values[buf.name] = self.round(self.cse(text, dtype), buf.dtype)

    def reductions(self, bufs, stores=()):
        """The reductions `bufs` (none reads another) in one loop over the row, which also stores
        the domain values `stores` (read by no reduction's result): each element is computed once
        for both (a GeLU stored and averaged by a squeeze-excite block: its tanh once, the row read
        once)."""
        accs = self.declare_accumulators(bufs)
        with self.loop_nest(self.r_dims, parallel=self.split_rows, simd=True, reductions=accs.clauses(), sums=accs):
            for buf in stores:
                self.store(buf, self.inline(buf))
            self.accumulate(accs)
        self.finish(accs)

    def column_tile(self):
        """Columns a thread reduces at once in a column reduction (`column_body`), or None where
        the kernel is not one: its one kept dim innermost, its reductions independent of each other
        (a GeLU's gradient, whose column sums are the bias gradient; a channels-last batch norm's
        backward, whose input gradient reads the channels' sums)."""
        if not self.columns or not self.kernel.is_reduction or len(self.x_dims) != 1 or not self.r_dims or \
                max(self.r_dims) > self.x_dims[0] or not self.static_shape or self.rnumel < 16:
            return None
        reductions = [n for n in self.kernel.nodes if n.kind == "reduction"]
        if self._independent_run(reductions[0]) != reductions:
            return None
        per_thread = -(-self.xnumel // self.threads)
        return min(COLUMN_TILE, max(16, -(-per_thread // 16) * 16))

    def columns_read_across(self) -> bool:
        """Whether this generation's column reduction loads an input that is contiguous along the
        rows and strided along the columns (the bias gradient of a transposed operand): walking
        it a row at a time gathers each element from another row of memory, and gcc took 23 s on
        one such kernel (SegFormer's backward); the row reduction reads it in order."""
        if self.column_tile() is None:
            return False
        column, rows = self.var(self.x_dims[0]), {self.var(d) for d in self.r_dims}
        for sites in self.load_sites.values():
            for index, _, _ in sites:
                steps = loop_steps(index)
                if steps.get(column, 0) != 1 and any(steps.get(r) == 1 for r in rows):
                    return True
        return False

    def domain_stores(self):
        """The nodes stored over the kernel's whole domain (not per row)."""
        return [n for n in self.kernel.nodes if n.name in self.kernel.stores and not self.is_row_value(n)]

    def column_body(self, tile):
        """A column reduction: threads share tiles of `tile` columns; each walks the rows with an
        accumulator per column, the columns innermost (contiguous, vectorised), storing what is over
        the whole domain and reads no column value as it goes, then computes and stores the columns'
        values (kept in an array of the tile where the other domain values read them), then walks
        the rows again to store those."""
        d = self.x_dims[0]
        v, size = self.var(d), self.kernel.shape[d]
        reductions = [n for n in self.kernel.nodes if n.kind == "reduction"]
        row_values = [n for n in self.kernel.nodes if self.is_row_value(n)]
        names = {n.name for n in row_values}
        later = [n for n in self.domain_stores() if self._reads_any(n, names)]
        parallel = self.xnumel * self.rnumel >= PARALLEL_MIN_ELEMENTS and size > tile
        if parallel:
            self.emit("#pragma omp parallel for")
        self.open_block(f"for (int64_t xt = 0; xt < {size}; xt += {tile}) {{")
        self.emit(f"int64_t xe = xt + {tile} < {size} ? xt + {tile} : {size};")
        accs = self.declare_accumulators(reductions, lanes=tile)
        kept = {}  # row value -> (its array of the tile, compute dtype), for `later`
        for n in row_values if later else ():
            kept[n.name] = (f"col{len(kept)}", compute_dtype(n.dtype))
            self.emit(f"{C_TYPES[kept[n.name][1]]} {kept[n.name][0]}[{tile}];")
        with self.loop_nest(self.r_dims, parallel=False, simd=False):
            self.emit("#pragma omp simd")
            self.open_for(d, hoist=True, start="xt", stop="xe")
            self.accumulate(accs, lane=f"[{v} - xt]")
            for buf in self.domain_stores():
                if buf not in later:
                    self.store(buf, self.inline(buf))
            self.close_brace()
        self.open_block(f"for (int64_t {v} = xt; {v} < xe; {v}++) {{")
        self.finish(accs, lane=f"[{v} - xt]")
        for buf in row_values:
            if buf.kind != "reduction":
                with self.at(buf.loc):
                    self.values[buf.name] = buf.body(self.vars_for(buf))
            if buf.name in self.kernel.stores:
                self.store(buf, self.values[buf.name])
            if buf.name in kept:
                self.emit(f"{kept[buf.name][0]}[{v} - xt] = {self.values[buf.name]};")
        self.close_brace()
        if later:
            with self.loop_nest(self.r_dims, parallel=False, simd=False):
                self.emit("#pragma omp simd")
                self.open_for(d, hoist=True, start="xt", stop="xe")
                for name, (array, dtype) in kept.items():
                    self.values[name] = CV(f"{array}[{v} - xt]", dtype)
                for buf in later:
                    self.store(buf, self.inline(buf))
                self.close_brace()
        self.close_brace()

    # --- the kernel's structure -------------------------------------------------------------------
    def is_row_value(self, buf):
        """A per-row value (reduction result, or a pointwise buffer over the kept dims only)."""
        return buf.kind == "reduction" or buf.kind != "scatter" and (
            buf.shape != self.kernel.shape and (buf.shape in row_shapes(self.kernel.shape, self.red) or
                                                moved_row_vars(buf.shape, self.kernel.shape, self.red) is not None))

    def body(self):
        stores = self.kernel.stores
        tile = self.column_tile()
        if tile is not None:
            return self.column_body(tile)
        if not self.kernel.is_reduction:
            if self.interior is not None:
                return self.interior_body()
            if self.transpose is not None:
                return self.transposed_body()
            with self.loop_nest(self.x_dims, parallel=True, simd=True, reductions=self.out_of_range):
                self.pointwise_stores()
            return
        with self.loop_nest(self.x_dims, parallel=not self.split_rows, simd=False):
            for key, c_type in self.to_cache:
                self.cached[key] = f"row{len(self.cached)}"
                self.emit(f"{c_type} {self.cached[key]}[{self.rnumel}];")
            # domain values to store that read no per-row value ride in the first reduction's loop
            # (each element computed once); the others, in loops between the row values they read
            row_values = {b.name for b in self.kernel.nodes if self.is_row_value(b)}
            reads_row = {b.name: self._reads_any(b, row_values) for b in self.kernel.nodes
                         if b.name in stores and b.name not in row_values}
            independent = [b for b in self.kernel.nodes if reads_row.get(b.name) is False]
            dependent = []
            for buf in self.kernel.nodes:
                if buf.kind == "reduction" or self.is_row_value(buf):
                    self.domain_store_loop(dependent)
                    dependent = []
                    if buf.kind == "reduction":
                        if buf.name not in self.values:
                            self.reductions(self._independent_run(buf), independent)
                            independent = []
                    else:
                        with self.at(buf.loc):
                            self.values[buf.name] = buf.body(self.vars_for(buf))
                    if buf.name in stores:
                        self.store(buf, self.values[buf.name])
                elif reads_row.get(buf.name):
                    dependent.append(buf)
            self.domain_store_loop(independent + dependent)

    def domain_store_loop(self, bufs):
        """A loop over the row storing `bufs`."""
        if bufs:
            with self.loop_nest(self.r_dims, parallel=self.split_rows, simd=True):
                for buf in bufs:
                    self.store(buf, self.inline(buf))

    def transposed_dim(self):
        """The outer dim a pointwise kernel's loads are contiguous along where its innermost dim,
        along which it stores, strides them (a channels-last value copied to NCHW, the gradient of
        a concatenation): walked in the innermost dim's order, each load takes another cache line
        (a 16M-element bf16 copy of SegFormer's backward: 209 ms on 2 threads). None otherwise."""
        if self.kernel.is_reduction or len(self.x_dims) < 2 or not self.static_shape:
            return None
        inner, names = self.var(self.x_dims[-1]), {self.var(d): d for d in self.x_dims[:-1]}
        if any(loop_steps(index).get(inner) != 1 for sites in self.store_sites.values() for index, _, _ in sites):
            return None
        for sites in self.load_sites.values():
            for index, _, _ in sites:
                step = loop_steps(index)
                if step.get(inner, 0) not in (0, 1):
                    d = next((names[v] for v, k in step.items() if k == 1 and v in names), None)
                    if d is not None and min(self.kernel.shape[d], self.kernel.shape[self.x_dims[-1]]) >= TRANSPOSE_TILE:
                        return d
        return None

    def transposed_body(self):
        """`transposed_dim`'s loops: the other outer dims and tiles of the loads' contiguous dim
        shared among threads; in each, tiles of the innermost dim, each TRANSPOSE_TILE rows of the
        loads' dim by a vectorised run of the innermost."""
        d, inner, t = self.transpose, self.x_dims[-1], TRANSPOSE_TILE
        outer = [e for e in self.x_dims[:-1] if e != d]
        v, w = self.var(d), self.var(inner)
        n, m = self.kernel.shape[d], self.kernel.shape[inner]
        if self.xnumel >= PARALLEL_MIN_ELEMENTS:
            collapse = f" collapse({len(outer) + 1})" if outer else ""
            self.emit(f"#pragma omp parallel for{collapse}{self.out_of_range}")
        for e in outer:
            self.open_for(e)
        self.open_block(f"for (int64_t {v}t = 0; {v}t < {n}; {v}t += {t}) {{")
        self.open_block(f"for (int64_t {w}t = 0; {w}t < {m}; {w}t += {t}) {{")
        self.open_for(d, start=f"{v}t", stop=f"({v}t + {t} < {n} ? {v}t + {t} : {n})")
        self.emit("#pragma omp simd")
        self.open_for(inner, hoist=True, start=f"{w}t", stop=f"({w}t + {t} < {m} ? {w}t + {t} : {m})")
        self.pointwise_stores()
        for _ in range(4 + len(outer)):
            self.close_brace()

    def pointwise_stores(self):
        for buf in self.kernel.nodes:
            if buf.name in self.kernel.stores:
                self.store(buf, self.inline(buf))

    def interior_split(self):
        """(lo, hi, masks) for a pointwise kernel with masks (its loads at a tensor's border, a padded
        pooling window): inner loop iterations in [lo, hi) where every mask holds run a copy of the
        body without masks (loads and selects gcc vectorises), the others the masked body. None
        where the kernel has no masks, too few outer iterations, or a mask not affine in the inner
        loop variable (the check at the range's two ends then proves nothing)."""
        if self.kernel.is_reduction or not self.mask_conds or len(self.x_dims) < 2 or self.dynamic_values:
            return None
        inner, outer = self.x_dims[-1], self.x_dims[:-1]
        if math.prod(self.kernel.shape[d] for d in outer) < 4 * self.threads:
            return None
        v, n = self.var(inner), self.kernel.shape[inner]
        along = False
        for c in self.mask_conds:
            sym = next((s for s in c.free_symbols if s.name == v), None)
            if sym is None:
                continue
            along = True
            if not isinstance(c, sympy.core.relational.Relational):
                return None
            d = c.lhs - c.rhs
            if sympy.diff(d, sym).has(sym) or any(sym in f.free_symbols for f in d.atoms(sympy.Function)):
                return None
        pad = min(8, n // 4) if along else 0  # (masks along the inner dim: a border of `pad` each side)
        return (pad, n - pad, list(self.mask_conds)) if n - 2 * pad > 0 else None

    def interior_body(self):
        """`interior_split`'s loops: the outer loops, then per outer iteration whether every mask
        holds at both ends of [lo, hi) (affine masks: then on all of it), and the inner loop as
        [0, lo) masked, [lo, hi) unmasked, [hi, n) masked (all masked where the check fails)."""
        lo, hi, conds = self.interior
        inner, outer = self.x_dims[-1], self.x_dims[:-1]
        v, n = self.var(inner), self.kernel.shape[inner]
        with self.loop_nest(outer, parallel=True, simd=False, reductions=self.out_of_range):
            checks = {c.subs({s: end for s in c.free_symbols if s.name == v}) for c in conds for end in (lo, hi - 1)}
            if sympy.false in checks:
                return self.interior_loops(inner, n, n, n)  # (never all: the masked body throughout)
            checks = sorted(self.expr(c) for c in checks if c is not sympy.true)
            self.emit(f"bool interior = {' && '.join(f'({c})' for c in checks) or 'true'};")
            self.emit(f"int64_t lo = interior ? {lo} : {n}, hi = interior ? {hi} : {n};")
            self.interior_loops(inner, n, "lo", "hi", hi == n)

    def interior_loops(self, inner, n, lo, hi, none_after=False):
        for start, stop, unmasked in (("0", lo, False), (lo, hi, True), (hi, n, False)):
            if start == stop or (stop == n and none_after):
                continue  # (masks not along the inner dim: nothing after the interior)
            self.unmasked = unmasked
            self.emit(f"#pragma omp simd{self.out_of_range}")
            self.open_for(inner, hoist=True, start=str(start), stop=str(stop))
            self.pointwise_stores()
            self.close_brace()
        self.unmasked = False

    @staticmethod
    def close(loop):
        if loop is not None:
            loop.__exit__(None, None, None)
        return None

    # --- the whole kernel -------------------------------------------------------------------------
    def launch_params(self):
        """(parameter declaration, what the wrapper passes) in the function's parameter order:
        tensors (their buffer names), the seed, size values."""
        params = [(f"const {input_pointee(self.buffers[b].dtype)}* {p}", b) for b, p in self.in_args.items()]
        params += [(f"{C_TYPES[self.buffers[b].dtype]}* {p}", b) for b, p in self.out_args.items()]
        params += [("int64_t seed", "seed")] if self.uses_seed else []
        return params + [(f"int64_t {p}", int(self.sizevars.values[s])) for s, p in self.size_args.items()]

    def launch_signature(self):
        """What each launch passes: (tensors' buffer names, scalars: "seed" and size values, sizes)."""
        values = [v for _, v in self.launch_params()]
        n = len(self.in_args) + len(self.out_args)
        sizes = (self.xnumel, self.rnumel) if self.kernel.is_reduction else (self.xnumel,)
        return values[:n], values[n:], sizes

    def drop_unused_temporaries(self):
        """Lines of temporaries nothing reads (a cached value's operands in the loops that load it)."""
        while True:
            defined = {}
            for i, (_, text) in enumerate(self.lines):
                m = DEFINITION.match(text)
                if m:
                    defined[m.group(1)] = i
            used = set()
            for i, (_, text) in enumerate(self.lines):
                m = DEFINITION.match(text)
                used.update(TEMPORARY.findall(text.split(" = ", 1)[1] if m else text))
            unused = {i for n, i in defined.items() if n not in used}
            if not unused:
                return
            self.lines = [line for i, line in enumerate(self.lines) if i not in unused]

    def generate(self):
        with use_handler(self):
            self.body()
        self.lines, tables = tabulate(self.lines, {n for n, d in self.half_values.items() if d == torch.bfloat16})
        if self.cached or tables:
            self.drop_unused_temporaries()
        if cpp_vml.available():
            self.lines = cpp_vml.chunked(self.lines)
        name = self.kernel_name()
        params = ", ".join(p for p, _ in self.launch_params())
        body = ["    " * indent + text for indent, text in self.lines]
        if self.out_of_range:
            header = f'extern "C" int {name}({params}) {{'
            body = ["    int fl_out_of_range = 0;", *body, "    return fl_out_of_range;"]
        else:
            header = f'extern "C" void {name}({params}) {{'
        return name, "".join(tables) + "\n".join([header, *body, "}"]) + "\n"


def loop_steps(index) -> dict:
    """Loop variable name -> how far `index` (a load's or store's site) moves when it steps by one."""
    return {v.name: index.diff(v) for v in index.free_symbols if v.name[0] in "xr"}


def generate_cpp_kernel(kernel: FusedKernel, index: int, sizevars, dynamic_values, threads):
    """(name, C++ source of the kernel's function, its writer): generated again with what a
    generation's loads show (a column reduction reading across its rows, which makes it a row
    reduction; a pointwise kernel that transposes), then with the values for a row cache and an
    interior range."""
    def generation(columns=True, transpose=None, to_cache=(), interior=None):
        writer = CppKernelWriter(kernel, index, sizevars, dynamic_values, threads)
        writer.columns, writer.transpose, writer.to_cache, writer.interior = columns, transpose, list(to_cache), interior
        return (*writer.generate(), writer)
    name, source, writer = generation()
    columns, transpose = not writer.columns_read_across(), writer.transposed_dim()
    if not columns or transpose is not None:
        name, source, writer = generation(columns, transpose)
    to_cache, interior = writer.keys_to_cache(), writer.interior_split()
    if to_cache or interior:
        name, source, writer = generation(columns, transpose, to_cache, interior)
    return name, source, writer
