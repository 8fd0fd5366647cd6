"""The Python wrapper of one graph: allocates buffers, launches kernels, calls externs, returns outputs.

It is generated as source (shown to users next to the kernels) and exec'd. Buffers are freed
after their last use, and a later buffer of the same size, stride and dtype takes over the
memory of a dead one instead of allocating, where holding the dead one until then keeps the
program's peak of live bytes as it is (`WrapperWriter.live_bytes`).

What depends on no input (a causal mask from `arange`, `torch.ones(16, 4) * 0.5`), kernels and
extern calls alike, is made by `make_constants` on the first call and kept by the program: not
what the caller gets (nor what an extern that may return a view reads), not what draws random
numbers, not what reads a Python object the caller may change. It is made on the first call's
stream (CUDA-graph recording, in mode="reduce-overhead", follows a warm-up call, so it is made
outside the graph). Every line costs host time on each call, so externs are called as the torch
functions themselves and whole-buffer permutations as `.permute` (cheaper than `as_strided`).
"""
from __future__ import annotations

import functools
import hashlib
import linecache
import marshal
import math
import operator
import os
import sys
import types

import torch
import torch.nn.functional as F

from ..lower.ir import ComputedBuffer, ExternCall, LoweredGraph, View, contiguous_strides
from ..ops import effects
from . import attention
from ..ops.primitives import PRIMITIVES
from ..schedule.fusion import FusedKernel, Schedule


def reinterpret(t, size, stride, offset):
    """A strided view of `t` (offset relative to t's first element)."""
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


def _span(shape, stride):
    """Elements of memory a layout spans."""
    return 0 if 0 in shape else 1 + sum((size - 1) * st for size, st in zip(shape, stride))


def _row_major(shape, stride):
    return all(st == cs for size, st, cs in zip(shape, stride, contiguous_strides(shape)) if size != 1)


def permutation(v: View):
    """The dims `p` with `v == v.buf.permute(p)`, if it is one."""
    buf = v.buf
    if v.offset != 0 or len(v.shape) != len(buf.shape):
        return None
    dims, free = [], list(range(len(buf.shape)))
    for size, stride in zip(v.shape, v.stride):
        d = next((d for d in free if buf.shape[d] == size and buf.stride[d] == stride), None)
        if d is None:
            return None
        dims.append(d)
        free.remove(d)
    return tuple(dims)


def view_kind(v: View):
    """How the wrapper makes a static view of a whole buffer: "permute" (`.t()`, `.permute`),
    "view" (a row-major reshape), or None (`reinterpret`)."""
    if not all(isinstance(x, int) for x in (*v.shape, *v.stride, *v.buf.shape, *v.buf.stride)):
        return None
    if permutation(v) is not None:
        return "permute"
    if v.offset == 0 and math.prod(v.shape) == math.prod(v.buf.shape) and \
            _row_major(v.shape, v.stride) and _row_major(v.buf.shape, v.buf.stride):
        return "view"
    return None


def all_plain(v) -> bool:
    """Only Views and values that cannot change between calls (numbers, strings, dtypes, and
    containers of them): not a numpy array or another object the caller may write into."""
    if isinstance(v, (tuple, list)):
        return all(all_plain(x) for x in v)
    if isinstance(v, dict):
        return all(all_plain(x) for x in v.values())
    if isinstance(v, slice):
        return all_plain((v.start, v.stop, v.step))
    return v is None or isinstance(v, (View, bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format))


def ensure_layout(t, size, stride):
    """Extern results are read by kernels with the strides meta execution predicted; copy if they differ.
    None where the kernel returned no tensor in that place (attention's weights, not asked for).
    A dim of size 1 may have any stride: its index is 0 (cuDNN returns a squeeze-excite block's
    (N, C, 1, 1) convolution contiguous where channels-last was predicted: every one was copied)."""
    if t is None:
        return t
    if t.shape == size:
        actual = t.stride()
        if actual == stride or all(a == s or n <= 1 for n, a, s in zip(size, actual, stride)) or 0 in size:
            return t
    out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


# what a program keeps of the values that depend on no input (neither a graph input nor the seed):
# made on its first call, then held, up to this many bytes; larger ones are made each call
CONSTANT_MAX_BYTES = 1 << 23


def lines_comment(lines):
    """`  # model.py:12-15` for the source lines a kernel or call came from."""
    by_file: dict = {}
    for filename, line in lines:
        by_file.setdefault(os.path.basename(filename), []).append(line)
    parts = [f"{f}:{min(ls)}" + (f"-{max(ls)}" if max(ls) != min(ls) else "") for f, ls in sorted(by_file.items())]
    return f"  # {', '.join(parts)}" if parts else ""


def torch_name(fn):
    name = getattr(fn, "__name__", None)
    for prefix, owner in (("torch", torch), ("torch.nn.functional", F), ("torch.Tensor", torch.Tensor),
                          ("operator", operator), ("math", math)):
        if name and getattr(owner, name, None) is fn:
            return f"{prefix}.{name}"
    return None


# CPU buffers of this many bytes or more ask for transparent huge pages. torch's CPU allocator
# takes large blocks straight from mmap and returns them on free, so each call of a program
# faults its large outputs in again, 4 KB at a time: writing a fresh 32 MB tensor took 5.3 ms on
# the 2-core EPYC dev machine, with 2 MB pages 1.5 (a GeLU kernel's own work there: 4 ms)
HUGE_PAGE_MIN_BYTES = 4 << 20
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's madvise where the kernel gives transparent huge pages on request (THP `madvise`
    mode; `always` needs no asking, `never` gives none), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():
                return None
        import ctypes
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def allocators(device: torch.device) -> dict:
    """The wrapper's names for allocating buffers on `device`: `empty(size, stride, dtype)`, and
    on a CPU `empty_huge` for buffers of HUGE_PAGE_MIN_BYTES or more."""
    def on_device(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    fast = getattr(torch._C._dynamo.guards, f"_empty_strided_{device.type}", None)
    if device.type == "cuda" and fast is not None:  # current device checked per call
        return {"empty_current": fast, "empty_on": on_device, "current_device": torch._C._cuda_getDevice}
    empty = fast if device.type == "cpu" and fast is not None else on_device
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None:
        return {"empty": empty, "empty_huge": empty}

    def empty_huge(size, stride, dtype):
        # (the whole 2 MB pages inside the block: the allocator may have touched its first page)
        t = empty(size, stride, dtype)
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)
        return t
    return {"empty": empty, "empty_huge": empty_huge}


class WrapperWriter:
    def __init__(self, graph: LoweredGraph, sched: Schedule, kernels: dict, device, boxed=False, triton=True):
        self.graph, self.sched = graph, sched
        self.triton = triton  # the graph's kernels are Triton's (else C++)
        self.boxed = boxed
        self.device = torch.device(device)
        self.kernels = kernels  # id(FusedKernel) -> (TritonKernel, KernelWriter)
        self.lines: list[str] = []
        self.consts: list = []
        # kernel outputs allocated in the layout of the one reshape or permutation of them the
        # program returns (a bias gradient's (1, n) sum returned as (n,)): no `.view` call per
        # call, and the output is no view (autograd refuses in-place writes into a view that a
        # custom Function returned)
        self.allocated_as: dict = {}

    def value(self, v) -> str:
        if isinstance(v, View):
            if v.is_whole() or self.allocated_as.get(v.buf.name) == (tuple(v.shape), tuple(v.stride)):
                return v.buf.name
            kind = view_kind(v)
            if kind == "permute":
                dims = permutation(v)
                return f"{v.buf.name}.t()" if dims == (1, 0) else f"{v.buf.name}.permute{dims}"
            if kind == "view":
                return f"{v.buf.name}.view({tuple(v.shape)})"
            return f"reinterpret({v.buf.name}, {tuple(v.shape)}, {tuple(v.stride)}, {v.offset})"
        if isinstance(v, (bool, int, str)) or v is None:
            return repr(v)
        if isinstance(v, float):
            return repr(v) if math.isfinite(v) else f"float('{v}')"
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.device):
            return f"torch.device('{v}')"
        if isinstance(v, tuple):
            return "(" + "".join(self.value(x) + ", " for x in v).rstrip(" ") + ")" if len(v) == 1 else \
                "(" + ", ".join(self.value(x) for x in v) + ")"
        if isinstance(v, list):
            return "[" + ", ".join(self.value(x) for x in v) + "]"
        if isinstance(v, slice):
            return f"slice({self.value(v.start)}, {self.value(v.stop)}, {self.value(v.step)})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {self.value(x)}" for k, x in v.items()) + "}"
        name = torch_name(v)
        if name:
            return name
        self.consts.append(v)
        return f"consts[{len(self.consts) - 1}]"

    def huge(self, name) -> bool:
        """Whether buffer `name` is a CPU buffer allocated on huge pages (`empty_huge`)."""
        return self.device.type == "cpu" and (self.nbytes(name) or 0) >= HUGE_PAGE_MIN_BYTES

    def extern_line(self, call: ExternCall) -> str:
        if call.prim.name == "call_torch":
            fn, args, kwargs = call.args
            parts = [self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()]
            return f"{self.value(fn)}({', '.join(parts)})"
        result = call.result
        if call.prim.name in ("addmm", "mm", "bmm") and not call.kwargs and result is not None and \
                self.huge(result.name) and result.stride == contiguous_strides(result.shape):
            # a large product written to huge pages as our own buffers are (ATen's would be faulted
            # in 4 KB at a time: a 32 MB logits matrix's pages cost as much as a 1024-row GEMM);
            # F.linear's own call for a 2-D input, addmm(bias, x, w.t()), is this one
            parts = ", ".join(self.value(a) for a in call.args)
            return f"{torch_name(call.prim.impl)}({parts}, out=empty_huge({result.shape}, {result.stride}, {result.dtype}))"
        if call.prim.name in ("addmm", "mm") and not call.kwargs:
            *bias, x, wt = call.args
            if isinstance(wt, View) and len(wt.shape) == 2 and view_kind(wt) == "permute" and \
                    permutation(wt) == (1, 0) and all(isinstance(b, View) and len(b.shape) == 1 for b in bias):
                # what F.linear calls for a 2-D input (and a bias), made in C++: one call, no `.t()`
                return f"torch.nn.functional.linear({self.value(x)}, {wt.buf.name}{''.join(', ' + self.value(b) for b in bias)})"
        parts = [self.value(a) for a in call.args] + [f"{k}={self.value(v)}" for k, v in call.kwargs.items()]
        if self.runs_decode_attention(call):  # allocated as the lowering predicted sdpa's result
            return f"decode_attention({', '.join(parts)}, shape={call.result.shape}, stride={call.result.stride})"
        return f"{torch_name(call.prim.impl) or 'prims.' + call.prim.name}({', '.join(parts)})"

    def runs_decode_attention(self, step) -> bool:
        """Whether this extern call is an `sdpa` that fuselens's decode attention kernel runs
        (codegen/attention.py): Triton kernels only (a C++ graph calls ATen's)."""
        return self.triton and step.prim.name == "sdpa" and step.result is not None and \
            attention.applies(*step.args, step.kwargs.get("attn_mask"), step.kwargs.get("is_causal", False),
                              step.result)

    def step_reads(self, step):
        if isinstance(step, ExternCall):
            names = []
            torch.fx.node.map_aggregate((step.args, step.kwargs),
                                        lambda a: names.append(a.buf.name) if isinstance(a, View) else None)
            return names
        # (a scatter writes into an input: it lives until then)
        return list(self.kernels[id(step)][1].in_args) + [self.scattered[n] for n in self.kernels[id(step)][1].out_args
                                                          if n in self.scattered]

    def step_buffers(self, step) -> list:
        """The buffers a step writes."""
        if isinstance(step, ExternCall):
            return ([step.result] if step.result is not None else []) + list(step.items)
        writer = self.kernels[id(step)][1]
        return [writer.buffers[name] for name in writer.out_args]

    def step_writes(self, step) -> list:
        return [b.name for b in self.step_buffers(step)]

    def extern_effects(self, step):
        """What an extern call does (ops/effects.py), from a run on meta tensors; None where it
        cannot run on them. A device argument is the meta device there too: a copy to the GPU of
        what was made on the CPU (BEiT's relative position index, made by torch ops on the CPU in
        every layer) runs on meta tensors, so it can be a constant like the rest (made each call,
        it was a synchronous copy from pageable memory a layer)."""
        fn, args, kwargs = step.args if step.prim.name == "call_torch" else (step.prim.impl, step.args, step.kwargs)
        tensors = []

        def meta(v):
            if isinstance(v, torch.device):
                return torch.device("meta")
            if not isinstance(v, View):
                return v
            base = torch.empty_strided(v.buf.shape, v.buf.stride, dtype=v.buf.dtype, device="meta")
            tensors.append(base.as_strided(v.shape, v.stride, v.offset))
            return tensors[-1]
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), meta)
        try:
            return effects.run(fn, args, kwargs, tensors)[1]
        except Exception:  # noqa: BLE001 (no meta kernel: nothing known of it)
            return None

    def constant_steps(self, keep: set) -> set:
        """Indices of the steps whose values depend on no input (a program's sizes are its own),
        kept by the program after its first call: kernels that take no seed, externs that draw no
        random numbers (ATen's tags), reading only what such steps made. None of them makes a
        graph output (`keep`) or what an extern outside them that may return a view of its
        arguments reads: a value the caller gets is never one the program keeps. What the other
        steps read of them fits CONSTANT_MAX_BYTES."""
        steps = self.sched.steps
        writes = [self.step_writes(step) for step in steps]
        made_by = {name: i for i, names in enumerate(writes) for name in names}
        reads = [self.step_reads(step) for step in steps]
        buffers = {b.name: b for step in steps for b in self.step_buffers(step)}
        known: dict = {}  # extern index -> its Effects, asked only of the externs it decides

        def facts(i):
            if i not in known:
                known[i] = self.extern_effects(steps[i])
            return known[i]

        def computes_from_nothing(i):
            step = steps[i]
            if not isinstance(step, ExternCall):
                return not self.kernels[id(step)][1].uses_seed
            args = step.args[1:] if step.prim.name == "call_torch" else (step.args, step.kwargs)
            return all_plain(args) and facts(i) is not None and not facts(i).draws_random_numbers

        def may_return_a_view(j):
            return not steps[j].prim.fresh and (facts(j) is None or any(a is not None for a in facts(j).aliases))
        excluded: set = set()
        while True:
            const: set = set()
            for i in range(len(steps)):  # in order: a step's inputs are decided before it
                if i not in excluded and all(made_by.get(n) in const for n in reads[i]) and computes_from_nothing(i):
                    const.add(i)
            leave_out = {i for i in const if any(n in keep for n in writes[i])}
            for j in set(range(len(steps))) - const:
                if any(made_by.get(n) in const for n in reads[j]) and isinstance(steps[j], ExternCall) and \
                        may_return_a_view(j):
                    leave_out |= {made_by[n] for n in reads[j] if made_by.get(n) in const}
            if not leave_out:
                held = {n for j in set(range(len(steps))) - const for n in reads[j] if made_by.get(n) in const}
                size = {n: buffers[n].dtype.itemsize * math.prod(buffers[n].shape) for n in held}
                if sum(size.values()) <= CONSTANT_MAX_BYTES:
                    return const
                leave_out = {made_by[max(size, key=size.get)]}  # the largest made each call instead
            excluded |= leave_out

    def generate(self):
        g, steps = self.graph, self.sched.steps
        params = ["seed" if b is None else b.name for b in g.inputs]
        keep = {o.buf.name for o in g.outputs if isinstance(o, View)}
        keep |= set(self.scattered)  # (an input's memory: never freed nor taken over)
        if not self.boxed:  # the caller holds its arguments until the call returns
            keep |= {b.name for b in g.inputs if b is not None}
        read_by_extern = {n for step in steps if isinstance(step, ExternCall) for n in self.step_reads(step)}
        # (a buffer an extern reads whose result may view it is never taken over: a convolution's
        # input is, after its last use; in a CNN's training step nearly every kernel output is one)
        read_by_viewing_extern = {n for step in steps if isinstance(step, ExternCall) and not step.prim.fresh
                                  for n in self.step_reads(step)}
        written = {n for step in steps if not isinstance(step, ExternCall) for n in self.kernels[id(step)][1].out_args}
        returned: dict = {}
        for o in g.outputs:
            if isinstance(o, View):
                returned.setdefault(o.buf.name, set()).add((tuple(o.shape), tuple(o.stride), view_kind(o)))
        for name, views in returned.items():
            if len(views) == 1 and name in written and name not in read_by_extern and name not in self.scattered:
                (shape, stride, kind), = views
                if kind in ("view", "permute"):  # the same memory, read by kernels by pointer
                    self.allocated_as[name] = (shape, stride)
        const = self.constant_steps(keep)
        rest = [i for i in range(len(steps)) if i not in const]
        made = {n for i in const for n in self.step_writes(steps[i])}
        held = list(dict.fromkeys(n for i in rest for n in self.step_reads(steps[i]) if n in made))
        out = self.lines
        if held:
            out.append("def make_constants():  # what depends on no input: made on the first call, then kept")
            self.emit_steps(sorted(const), keep | set(held), read_by_viewing_extern)
            out.append(f"    return ({', '.join(held)},)")
            out.append("")
        last_use = {n: i for i in rest for n in self.step_reads(steps[i])}
        if self.boxed:  # the list is the only reference the caller keeps: an input dies at its last use
            out.append("def call(args):")
            if params:
                out.append(f"    {', '.join(params)}, = args; args.clear()")
            unread = [p for p in params if p not in last_use and p not in keep and p != "seed"]
            if unread:
                out.append(f"    del {', '.join(unread)}")
        else:
            out.append(f"def call({', '.join(params)}):")
        if held:
            out.append("    if not constants:")
            out.append("        constants.append(make_constants())")
            out.append(f"    {', '.join(held)}, = constants[0]")
        self.emit_steps(rest, keep, read_by_viewing_extern | set(held))
        outs = [self.value(o) for o in g.outputs]
        out.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        return "\n".join(out) + "\n"

    def emit_steps(self, indices, keep, never_reused):
        """The lines of these steps in order, in a function's body: a buffer is deleted after its
        last use among them, unless in `keep`, or its memory, a dead kernel output's, is taken over
        by a later buffer of the same size, stride and dtype, unless in `never_reused` (what an
        extern that may return a view read; what the program keeps), and unless holding
        it until then would raise the steps' peak of live bytes (`live_bytes`): a caching
        allocator hands freed memory to the next allocation anyway, so taking a buffer over saves
        an allocation's host time, while holding it dead across a larger allocation costs its
        bytes at the peak (a UNet's backward held a recomputed GroupNorm input from its first
        kernels to its last)."""
        steps, out = self.sched.steps, self.lines
        last_use = {n: i for i in indices for n in self.step_reads(steps[i])}
        in_place = self.in_place_plan(indices, keep, never_reused, last_use)
        live = self.live_bytes(indices, keep, last_use, in_place)
        peak = max(live, default=0)
        if "empty_current" in allocators(self.device) and any(isinstance(steps[i], FusedKernel) for i in indices):
            # torch's allocator without the dispatcher (what Inductor's wrappers call; ~2 us a buffer
            # less than torch.empty_strided), on the current device: the graph's, or else a slower one
            out.append(f"    empty = empty_current if current_device() == {self.device.index or 0} else empty_on")
        pool: dict = {}  # (shape, stride, dtype) -> (name, position it died at) of dead buffers
        pooled: dict = {}  # dead buffer in `pool` -> its line in `out`: `del` unless a later buffer takes it
        taken = set(in_place.values())  # inputs a kernel wrote its output over (in their last use)
        for at, i in enumerate(indices):
            step = steps[i]
            if isinstance(step, ExternCall):
                loc = [step.loc[:2]] if step.loc else []
                out.append(f"    {step.name} = {self.extern_line(step)}{lines_comment(loc)}")
                results = [step.result] if step.result is not None else []
                for buf in results:
                    if not (step.prim.fresh_contiguous and buf.stride == contiguous_strides(buf.shape)):
                        out.append(f"    {buf.name} = ensure_layout({buf.name}, {buf.shape}, {buf.stride})")
                for buf in step.items:
                    out.append(f"    {buf.name} = ensure_layout({step.name}[{buf.item}], {buf.shape}, {buf.stride})")
                if step.result is None:
                    out.append(f"    del {step.name}")
            else:
                kernel, writer = self.kernels[id(step)]
                for name in writer.out_args:
                    buf = writer.buffers[name]
                    if name in self.scattered:
                        out.append(f"    {name} = {self.scattered[name]}  # written in place at indexed positions")
                        continue
                    shape, stride = self.allocated_as.get(name, (buf.shape, buf.stride))
                    key = (shape, stride, buf.dtype)
                    over = in_place.get((i, name))
                    old = None if over is not None else self._take_dead(pool.get(key), at, live, peak, self.nbytes(name))
                    if over is not None:
                        view = "" if self.allocated(over) == (shape, stride) else f".as_strided({shape}, {stride})"
                        out.append(f"    {name} = {over}{view}  # in place: read only where written")
                    elif old is not None:
                        del pooled[old]
                        out.append(f"    {name} = {old}; del {old}  # reuse")
                    else:
                        out.append(f"    {name} = {'empty_huge' if self.huge(name) else 'empty'}({shape}, {stride}, {buf.dtype})")
                tensors, scalars, sizes = writer.launch_signature()
                args = ", ".join(tensors + [str(a) for a in scalars])
                kernel.call_sizes = tuple(sizes)
                sizes = ", ".join(f"{k}={v}" for k, v in zip(("xnumel", "rnumel", "xchunk"), sizes))
                if writer.xnumel == 0:
                    out.append(f"    # {kernel.name}: empty, nothing to compute")
                else:  # the launch function bound at the first call, or the way to one (launcher.py)
                    out.append(f"    {kernel.name}.launch({args}) or {kernel.name}.run({args}, {sizes})"
                               f"{lines_comment(writer.source_lines)}")
            for name in [n for n, last in last_use.items() if last == i and n not in keep]:
                buf = self.buffer(name)
                if isinstance(buf, ComputedBuffer) and name not in never_reused and name not in taken and \
                        self.nbytes(name) is not None:
                    pool.setdefault((*self.allocated(name), buf.dtype), []).append((name, at))
                    pooled[name] = len(out)
                    out.append(None)
                else:
                    out.append(f"    del {name}")
        for name, line in pooled.items():  # no later buffer took its memory: freed where it died
            out[line] = f"    del {name}"
        out[:] = [line for line in out if line is not None]

    @staticmethod
    def _take_dead(dead, at, live, peak, size):
        """The name of the dead buffer in `dead` ((name, position it died at), latest last) that a
        buffer of `size` bytes made at position `at` takes over, held dead until then, or None:
        the latest to die, unless holding it would raise `peak` (then every earlier one would too:
        `dead` is emptied, each freed where it died). `live` (bytes live at each position) counts
        the held buffer from then on."""
        if not dead or size is None:
            return None
        name, died = dead[-1]
        if max(live[died + 1:at], default=0) + size > peak:
            dead.clear()
            return None
        dead.pop()
        for t in range(died + 1, at):
            live[t] += size
        return name

    def in_place_plan(self, indices, keep, never_reused, last_use) -> dict:
        """(step index, output name) -> the input whose memory the output takes over (`in_place_of`)."""
        plan, taken = {}, set()
        for i in indices:
            step = self.sched.steps[i]
            if isinstance(step, ExternCall):
                continue
            writer = self.kernels[id(step)][1]
            for name in writer.out_args:
                buf = writer.buffers[name]
                shape, stride = self.allocated_as.get(name, (buf.shape, buf.stride))
                over = self.in_place_of(i, writer, name, (shape, stride, buf.dtype), last_use, keep | never_reused | taken)
                if over is not None and (self.allocated(over) == (shape, stride) or name not in keep):
                    plan[i, name] = over  # (what the caller gets is no view)
                    taken.add(over)
        return plan

    def live_bytes(self, indices, keep, last_use, in_place) -> list:
        """Bytes live while each of these steps runs, each buffer freed after its last use: what
        the program reads from outside (inputs; in a boxed call freed at their last use too, unless
        held elsewhere: `InputBuffer.held`), every output a step allocates (not one written over an
        input), extern results. The bytes the external calls use inside are not known here."""
        steps = self.sched.steps
        made = {n for i in indices for n in self.step_writes(steps[i])}
        outside = {n for i in indices for n in self.step_reads(steps[i]) if n not in made}
        # not freed: inputs written over (their memory lives on as the output), inputs held elsewhere
        stays = set(in_place.values()) | {b.name for b in self.graph.inputs if b is not None and b.held}
        dies: dict = {}
        for n, last in last_use.items():
            if n not in keep and n not in stays:
                dies.setdefault(last, []).append(n)
        cur = sum(self.nbytes(n) or 0 for n in outside)
        live = []
        for i in indices:
            step = steps[i]
            new = self.step_writes(step) if isinstance(step, ExternCall) else \
                [n for n in self.kernels[id(step)][1].out_args if (i, n) not in in_place]
            cur += sum(self.nbytes(n) or 0 for n in new)
            live.append(cur)
            cur -= sum(self.nbytes(n) or 0 for n in dies.get(i, ()))
        return live

    def nbytes(self, name):
        """Bytes of a buffer's memory (the span of its layout as allocated), None where a size is
        not a number."""
        buf = self.buffer(name)
        if buf is not None:
            shape, stride = self.allocated(name)
        else:  # an input of the graph
            buf = next(b for b in self.graph.inputs if b is not None and b.name == name)
            shape, stride = buf.shape, buf.stride
        try:
            return int(_span(shape, stride)) * buf.dtype.itemsize
        except TypeError:
            return None

    def in_place_of(self, i, writer, name, key, last_use, excluded):
        """An input of kernel step `i` whose memory its output `name` (allocated as `key`) can take
        over, or None: a buffer of this program (a kernel's, or a GEMM's fresh result) in its last
        use, of the output's dtype and spanning as much memory, read only at the very elements the
        output is written, in one pass (a pointwise kernel; a persistent reduction's whole
        elements, not its per-row values), and every read of it before the write in the kernel's
        lines. Each element is then read before it is overwritten, by the thread that overwrites
        it, as in Inductor's in-place kernels (its GeLU and layer norms after a GEMM): no new
        buffer. Autotuning times such a kernel on copies (launcher.py)."""
        if writer.mode not in ("pointwise", "persistent"):
            return None
        sites = writer.store_sites.get(name, set())
        if len(sites) != 1 or (writer.mode == "persistent" and not next(iter(sites))[2]):
            return None
        for other, loads in writer.load_sites.items():
            if loads != sites or other in excluded or last_use.get(other) != i or \
                    not writer.reads_before_writing(other, name):
                continue
            buf, made = self._made.get(other, (None, None))
            fresh = isinstance(buf, ComputedBuffer) or isinstance(made, ExternCall) and made.result is buf and \
                made.prim.fresh_contiguous and buf.stride == contiguous_strides(buf.shape)
            if fresh and buf.dtype == key[2] and _span(*self.allocated(other)) == _span(*key[:2]):
                return other
        return None

    @functools.cached_property
    def scattered(self) -> dict:
        """Scatter buffer name -> the input whose memory it is (lower/ir.py ComputedBuffer)."""
        return {n.name: n.into.name for step in self.sched.steps if isinstance(step, FusedKernel)
                for n in step.nodes if n.kind == "scatter"}

    def allocated(self, name):
        """(shape, stride) a buffer of this program is allocated as."""
        buf = self.buffer(name)
        return self.allocated_as.get(name, (buf.shape, buf.stride))

    @functools.cached_property
    def _made(self) -> dict:
        """Buffer name -> (the buffer, the step that makes it), over the schedule's steps once (every
        freed buffer and every in-place candidate looks one up)."""
        made: dict = {}
        for step in self.sched.steps:
            bufs = step.nodes if isinstance(step, FusedKernel) else \
                ([step.result] if step.result is not None else []) + list(step.items)
            for b in bufs:
                made.setdefault(b.name, (b, step))
        return made

    def buffer(self, name):
        return self._made.get(name, (None, None))[0]


def generate_wrapper(graph: LoweredGraph, sched: Schedule, kernels: dict, device, boxed=False, triton=True):
    """Source of `call(*inputs)`, its code (marshalled), the function itself, and the objects its
    source names as `consts[i]`. `boxed`: `call(args)` takes its inputs as a list, which it empties,
    and frees each input after its last use (a backward's saved values: eager autograd frees them
    as its backward goes)."""
    writer = WrapperWriter(graph, sched, kernels, device, boxed, triton)
    source = writer.generate()
    code = marshal.dumps(compile(source, wrapper_filename(source), "exec"))
    call = load_wrapper(code, [k for k, _ in kernels.values()], writer.consts, device, source)
    return source, code, call, writer.consts


def wrapper_filename(source: str) -> str:
    """The file name a wrapper's code is compiled under, by its source's hash (the same for a
    program the program cache loads): a traceback through it shows the wrapper's line, the kernel
    launch or extern call that raised, where `load_wrapper` registered the source."""
    return f"<fuselens wrapper {hashlib.sha1(source.encode()).hexdigest()[:16]}>"


def load_wrapper(code: bytes, kernels, consts: list, device, source: str):
    """The function `call` of a wrapper's code, with the kernels (TritonKernels) it launches by name.
    The code comes marshalled: a program loaded from the program cache is not compiled again (a
    ResNet-50 training wrapper: 26-33 -> 0.3 ms on the dev CPU). Its `source` goes to linecache."""
    name = wrapper_filename(source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # (no mtime: never checked)
    device = torch.device(device)
    namespace = {"torch": torch, "prims": types.SimpleNamespace(**PRIMITIVES), "reinterpret": reinterpret,
                 "ensure_layout": ensure_layout, "consts": consts, "operator": operator, "math": math,
                 "constants": [], "device": device, "decode_attention": attention.decode_attention, **allocators(device), **{k.name: k for k in kernels}}
    exec(marshal.loads(code), namespace)
    return namespace["call"]
