"""Triton source for one FusedKernel: the kernel writer.

`KernelWriter` is the ops handler that loop bodies run against: its expressions are
triton_expressions.py's (one line per operation, common subexpressions reused), its reductions
triton_reductions.py's; here is the kernel around them: the program's index setup, which node is
computed where and stored, and the source with its launch parameters. Kernel shapes:

  pointwise   1-D blocks of XBLOCK elements.
  persistent  reductions with rows of up to PERSISTENT_RNUMEL_MAX elements: a block holds
              XBLOCK whole rows (RBLOCK >= rnumel), every reduction and epilogue is straight-line.
  looped      longer rows: each reduction loops over the row in RBLOCK chunks (consecutive
              reductions that read none of each other in one loop); values that must be stored
              are computed in a final loop.
  chunked     kernels computing partials (stage 1 of a column reduction, schedule/fusion.py):
              program p walks rows [p*xchunk, (p+1)*xchunk) in blocks of XBLOCK rows and keeps
              one accumulator per partial in registers; after the loop it stores them as row p
              of the partials. chunked_rows: with row reductions, a block holds whole rows
              (RBLOCK >= rnumel, few rows) and the rest of the kernel is as persistent;
              chunked_tiles: no row reductions, so the columns are tiled too (program = (chunk,
              column tile)). Either way the accumulator is the whole [XBLOCK, RBLOCK] tile, added
              elementwise, its rows reduced once after the loop (a reduction across rows each
              step costs a shared-memory round trip per tile).
"""
from __future__ import annotations

import re

import sympy

from ..lower.indexing import FloorDiv
from ..lower.ir import DynamicValues, compute_dtype, use_handler
from ..ops.primitives import TRITON_HELPERS
from ..schedule.fusion import PERSISTENT_RNUMEL_MAX, FusedKernel, moved_row_vars, row_shapes, store_index
from .launcher import MAX_RTILE, ROUND_HELPERS, canonical, next_power_of_2
from .triton_expressions import BLOCK_NAMES, CV, TL_DTYPES, Hoist
from .triton_reductions import COMBINE_FNS, REDUCE_AXIS0, TritonReductions, neutral


# blocks never exceed this many elements, so a size divisible by it needs no mask
MAX_XBLOCK = 1024


class KernelWriter(TritonReductions):
    """Writes one FusedKernel's Triton source (`generate`): the ops handler its nodes' bodies run
    against, in the loop structure of its `mode` (module docstring)."""

    def __init__(self, kernel: FusedKernel, name_index: int, sizevars, dynamic_values=DynamicValues(), pdl=False,
                 reciprocal_divisors=False):
        super().__init__(kernel, sizevars, dynamic_values, reciprocal_divisors)
        self.pdl = pdl  # launched with programmatic dependent launch (codegen/cuda.py)
        self.index_in_graph = name_index
        shape = kernel.shape
        self.chunk = kernel.chunk
        self.mode = "pointwise" if not kernel.is_reduction else \
            ("persistent" if self.rnumel <= PERSISTENT_RNUMEL_MAX else "looped")
        if self.chunk:
            self.mode = "chunked_rows" if kernel.has_row_reductions else "chunked_tiles"
        numel_limit = max([self.xnumel * self.rnumel] + [n.numel() for n in kernel.nodes])
        self.int64 = numel_limit >= 2 ** 31  # also set by generate() for inputs spanning that much memory
        # masks where a dim of the kernel's rows (or of its reduction) is dynamic: its kernel is
        # shared by the graph's lengths; a static dim's extent is known here
        dynamic_x = any(s in dynamic_values for d, s in enumerate(shape) if d not in self.red)
        dynamic_r = any(shape[d] in dynamic_values for d in self.red)
        self.need_xmask = dynamic_x or self.xnumel % (self.chunk or MAX_XBLOCK) != 0
        self.need_rmask = self.mode == "looped" or dynamic_r or next_power_of_2(self.rnumel) != self.rnumel
        if self.mode == "chunked_tiles":  # column tiles of up to MAX_RTILE
            self.need_rmask = dynamic_r or self.rnumel % MAX_RTILE != 0
        self._chunk_loop = None

    # --- kernel structure -------------------------------------------------------------------------
    def emit_index_vars(self, dims, index_name, shape):
        inner = 1
        for pos, d in enumerate(reversed(dims)):
            v = sympy.Symbol(index_name)
            size = self.sizevars(shape[d])
            e = FloorDiv(v, self.sizevars(inner)) if inner != 1 else v
            text = self.expr(e) if pos == len(dims) - 1 else f"{self.expr(e)} % {self.divisor(size)}"
            self.emit(f"{'r' if index_name == 'rindex' else 'x'}{d} = {text}")
            inner *= shape[d]

    def store(self, buf, value):
        ptr = self.arg_for(buf, self.out_args, "out_ptr")
        if buf.kind == "scatter":  # at the positions its body computes, where they are in range
            value, index, index_text, conds = self.scatter_parts(value)
            mask = " & ".join(filter(None, [self.mask_for(index)] + conds)) or None
        else:
            index = store_index(buf, self.kernel.shape, self.red, self.sizevars)
            if not index.free_symbols:  # a single element: let lane 0 of block 0 write it
                index_text, mask = "xindex", "xmask"
            else:
                index_text, mask = self.index_text(index), self.mask_for(index)
        self.store_sites.setdefault(buf.name, set()).add(self.site(index, mask))
        if value.literal:  # a block of the pointers' shape: [XBLOCK, 1] where they do not vary along r
            along_r = any(s.name[0] == "r" for s in index.free_symbols)
            shape = "[XBLOCK, RBLOCK]" if along_r else "[XBLOCK, 1]" if self.kernel.is_reduction else "[XBLOCK]"
            value = CV(f"tl.full({shape}, {value}, {TL_DTYPES[value.dtype]})", value.dtype)
        self.emit(f"tl.store({ptr} + {index_text}, {value}" + (f", {mask})" if mask else ")"), loc=buf.loc or self.loc)

    def chunk_setup(self):
        """Before a chunked kernel's row loop: column indices, accumulators; then open the loop."""
        k = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        if self.mode == "chunked_tiles":
            self.emit("rtiles = tl.cdiv(rnumel, RBLOCK)")
            self.emit(f"xpid = {k} // rtiles")
            self.emit(f"rindex = ({k} % rtiles) * RBLOCK + tl.arange(0, RBLOCK)[None, :]")
        else:
            self.emit(f"xpid = {k}")
            self.emit("rindex = tl.arange(0, RBLOCK)[None, :]")
        self.emit("rmask = rindex < rnumel")
        self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                dtype = compute_dtype(buf.dtype)
                acc = self.new_tmp("r")
                self.emit(f"{acc} = tl.full([XBLOCK, RBLOCK], {neutral(buf.reduce, dtype)}, {TL_DTYPES[dtype]})",
                          loc=buf.loc)
                self.accs[buf.name] = acc
        self.hoist = Hoist(len(self.lines), len(self.scopes) + 1, {"r"}, self.indent, self.scopes[-1])
        self.emit("for xoffset in range(xpid * xchunk, xpid * xchunk + xchunk, XBLOCK):")
        self._chunk_loop = self.scope()
        self._chunk_loop.__enter__()
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        self.emit("xmask = xindex < xnumel")
        self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)

    def chunk_finish(self):
        self._chunk_loop.__exit__(None, None, None)
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                ptr = self.arg_for(buf, self.out_args, "out_ptr")
                mask = ", rmask)" if self.need_rmask else ")"
                acc = REDUCE_AXIS0[buf.reduce].format(self.accs[buf.name]) + "[None, :]"
                self.emit(f"tl.store({ptr} + xpid * rnumel + rindex, {acc}{mask}", loc=buf.loc)

    def row_setup(self, looped):
        k = "tl.program_id(0).to(tl.int64)" if self.int64 else "tl.program_id(0)"
        if not self.kernel.is_reduction:
            self.emit(f"xoffset = {k} * XBLOCK")
            self.emit("xindex = xoffset + tl.arange(0, XBLOCK)")
            self.emit("xmask = xindex < xnumel")
            self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)
            return
        self.emit(f"xoffset = {k} * XBLOCK")
        self.emit("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
        self.emit("xmask = xindex < xnumel")
        self.emit_index_vars(self.x_dims, "xindex", self.kernel.shape)
        if not looped:
            self.emit("rindex = tl.arange(0, RBLOCK)[None, :]")
            self.emit("rmask = rindex < rnumel")
            self.emit_index_vars(self.r_dims, "rindex", self.kernel.shape)
            self.hoist = Hoist(len(self.lines), 1, {"x", "r"}, self.indent, self.scopes[-1])

    def is_row_value(self, buf):
        """A per-row value (reduction result, or a pointwise buffer over the kept dims only)."""
        return self.kernel.is_reduction and buf.kind != "scatter" and (buf.kind == "reduction" or (
            buf.shape != self.kernel.shape and (buf.shape in row_shapes(self.kernel.shape, self.red) or
                                                moved_row_vars(buf.shape, self.kernel.shape, self.red) is not None)))

    def body(self):
        looped = self.mode == "looped"
        if self.chunk:
            self.chunk_setup()
        else:
            self.row_setup(looped)
        stores = self.kernel.stores
        epilogue_open = None
        for buf in self.kernel.nodes:
            if buf.kind == "partial":
                self.partial(buf)
            elif buf.kind == "reduction":
                epilogue_open = self.close(epilogue_open)
                if looped:
                    if buf.name not in self.values:
                        self.looped_reductions(*self._looped_run(buf))
                else:
                    self.values[buf.name] = self.reduction(buf, looped=False)
                if buf.name in stores:
                    self.store(buf, self.values[buf.name])
            elif self.is_row_value(buf):
                epilogue_open = self.close(epilogue_open)
                with self.at(buf.loc):
                    self.values[buf.name] = buf.body(self.vars_for(buf))
                if buf.name in stores:
                    self.store(buf, self.values[buf.name])
            elif buf.name in stores:
                if looped and epilogue_open is None:
                    epilogue_open = self.row_loop()
                    epilogue_open.__enter__()
                self.store(buf, self.inline(buf))
        self.close(epilogue_open)
        if self.chunk:
            self.chunk_finish()

    def close(self, loop):
        if loop is not None:
            loop.__exit__(None, None, None)
        return None

    # --- the whole kernel -------------------------------------------------------------------------
    def drop_unused_loop_vars(self):
        """Per-dimension variables are emitted up front; those no index ended up using go."""
        definition = re.compile(r"([xr]\d+) = ")
        code = [text.split("  # ", 1)[0] for _, text in self.lines]
        used = set(BLOCK_NAMES.findall(" ".join(definition.sub("", c, count=1) for c in code)))
        self.lines = [line for line, c in zip(self.lines, code)
                      if not definition.match(c) or definition.match(c).group(1) in used]
        # size arguments only those lines used go too; the rest are renumbered
        code = " ".join(text.split("  # ", 1)[0] for _, text in self.lines)
        kept = [(sym, name) for sym, name in self.size_args.items() if re.search(rf"\b{name}\b", code)]
        renames = {name: f"ks{i}" for i, (_, name) in enumerate(kept)}
        self.size_args = {sym: renames[name] for sym, name in kept}
        if any(old != new for old, new in renames.items()):
            pattern = re.compile(r"\bks\d+\b")
            self.lines = [(indent, pattern.sub(lambda m: renames.get(m.group(0), m.group(0)), text))
                          for indent, text in self.lines]

    def launch_params(self):
        """(parameter, what the wrapper passes) in the kernel's parameter order: tensors (their
        buffer names), the seed, size values, then the sizes xnumel[, rnumel[, xchunk]]."""
        params = [(p, b) for b, p in [*self.in_args.items(), *self.out_args.items()]]
        params += [("seed", "seed")] if self.uses_seed else []
        params += [(p, int(self.sizevars.values[s])) for s, p in self.size_args.items()]
        params += [("xnumel", self.xnumel)] + ([("rnumel", self.rnumel)] if self.kernel.is_reduction else [])
        return params + ([("xchunk", self.chunk)] if self.chunk else [])

    def launch_signature(self):
        """What each launch passes: (tensors' buffer names, scalars: "seed" and size values, sizes)."""
        values = [v for _, v in self.launch_params()]
        n_tensors, n_sizes = len(self.in_args) + len(self.out_args), 1 + self.kernel.is_reduction + bool(self.chunk)
        return values[:n_tensors], values[n_tensors:-n_sizes], tuple(values[-n_sizes:])

    def generate(self):
        with use_handler(self):
            self.body()
        self.drop_unused_loop_vars()
        name = self.kernel_name()
        params = [p for p, _ in self.launch_params()]
        params += ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.kernel.is_reduction else [])
        header = ["import triton", "import triton.language as tl", "from triton.language.extra import libdevice", ""]
        for r in sorted(self.combines & COMBINE_FNS.keys()):
            header += ["", "@triton.jit", *COMBINE_FNS[r].split("\n"), ""]
        sources = {**TRITON_HELPERS, **dict(ROUND_HELPERS.values())}
        for h in sorted(self.helpers):
            header += ["", "@triton.jit", *sources[h].split("\n"), ""]
        # a fresh seed every call: Triton must not compile a variant per seed's divisibility
        jit = '@triton.jit(do_not_specialize=["seed"])' if self.uses_seed else "@triton.jit"
        header += ["", jit, f"def {name}({', '.join(params)}):"]
        if self.pdl:  # this kernel's programs may start while the kernel before it still runs
            header[3:3] = ["from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait"]
            header += ["    gdc_wait()  # until the kernel before this one has finished and its writes are visible",
                       "    gdc_launch_dependents()  # the next kernel may start its programs as ours finish"]
        body = ["    " * indent + text for indent, text in self.lines]
        return name, "\n".join(header + body) + "\n"


def memory_extent(buf):
    """Elements between a buffer's first and last element (what an offset into it can reach)."""
    return 1 + sum((s - 1) * abs(st) for s, st in zip(buf.shape, buf.stride)) if buf.numel() else 0


def generate_kernel(kernel: FusedKernel, index: int, sizevars, dynamic_values=DynamicValues(), pdl=False, cuda=False,
                    fixed_sizes=frozenset()):
    """`pdl`: the kernel waits for the one before it (gdc_wait) and is launched with programmatic
    dependent launch, so its launch overlaps the previous kernel's last programs (Hopper and later).
    `cuda`: its tensors are on a CUDA device, whose ATen kernels' semantics it follows.
    `fixed_sizes`: size symbols that divide its indices as literals (KernelWriter.divisor)."""
    def written(int64):
        writer = KernelWriter(kernel, index, sizevars, dynamic_values, pdl, cuda)
        writer.int64 |= int64
        writer.fixed_sizes = fixed_sizes
        return writer.generate(), writer
    (name, source), writer = written(False)
    if not writer.int64 and any(memory_extent(b) >= 2 ** 31 for b in writer.buffers.values()):
        (name, source), writer = written(True)
    return name, source, writer


def fixed_divisors(generated: dict) -> dict:
    """{key: the size symbols of its kernel to divide by as literals} for generate_kernel's
    (name, source, writer) of a program's kernels that divide by size arguments (`divided_by`):
    the divisors whose values are the same in every kernel of its compiled source (a
    transformer's layers), so that literals cost no compile that sizes as arguments would have
    shared."""
    by_source: dict = {}
    for key, (name, source, _) in generated.items():
        by_source.setdefault(canonical(name, source)[1], []).append(key)
    # each kernel's size arguments: name -> (symbol, value)
    args = {key: {p: (s, int(w.sizevars.values[s])) for s, p in w.size_args.items()}
            for key, (_, _, w) in generated.items()}
    fixed = {}
    for keys in by_source.values():
        divided_by = generated[keys[0]][2].divided_by
        same = {p for p, (s, value) in args[keys[0]].items() if s in divided_by and
                all(args[k][p][1] == value for k in keys[1:])}
        for k in keys:
            symbols = frozenset(s for p, (s, _) in args[k].items() if p in same)
            if symbols:
                fixed[k] = symbols
    return fixed
