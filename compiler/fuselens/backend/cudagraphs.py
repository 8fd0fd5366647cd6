"""mode="reduce-overhead": compiled programs recorded into CUDA graphs and replayed, so that a call
costs one graph launch of host time instead of one launch per kernel and extern.

`CudaGraphed` replays one program (a graph's inference call); `TrainingGraphs` replays a training
graph's forward and backward programs, under the rules that keep its gradients eager's. As with
torch.compile, a call's outputs are the graph's buffers, which its next replay overwrites. Each
graph has its own memory pool, held while the compiled function lives."""
from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.nn as nn

from ..codegen.cuda import new_stream
from ..errors import warn

_LOG_RUNTIME = logging.getLogger("fuselens.runtime")


def graphable(inputs) -> bool:
    """A call CudaGraphed can record: every input a CUDA tensor, no backward recorded (a training
    call's programs are recorded by TrainingGraphs)."""
    return (torch.cuda.is_available() and all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)))


def _copy_into(buf, t):
    """buf.copy_(t) for a buffer of t's strides, expanded ones (a stride of 0: a gradient of a
    sum, say) included: each element t holds is copied once."""
    if 0 in buf.stride():
        size = [n if st else 1 for n, st in zip(t.shape, t.stride())]
        buf, t = buf.as_strided(size, buf.stride()), t.as_strided(size, t.stride(), t.storage_offset())
    buf.copy_(t)


class CudaGraphed:
    """After a warm-up call, a compiled program is recorded into a CUDA graph and replayed. A
    graph reads its inputs at fixed addresses. It is first recorded reading every input where the
    recording call's tensor lies; an input seen elsewhere later is read from then on from a buffer
    the graph owns, which each replay copies it into (never into the caller's tensor), and the
    graph is recorded again for that. So an input that stays in place (a parameter, a weight
    passed as a plain tensor, a buffer refilled in place, another graph's output) costs nothing a
    call, one that moves costs a copy. Only addresses are kept for inputs read in place, not the
    tensors (a tensor allocated later at the same place is read just as well), unless the program
    returns the input itself: the recorded outputs then hold the recording call's tensor.
    Parameters are never copied: one whose `.data` moved is recorded again in its new place.

    A copy costs about a kernel launch, so a replay with copies is not always cheaper than
    launching the program's kernels directly: calls alternate between the two until each has
    TRIAL_CALLS host timings, and if direct calls took less (medians), the graph is dropped
    (`dropped`, and `on_direct()` if given, which swaps the program itself in); so it is after
    MAX_RECORDINGS recordings, or when recording fails (with a warning). A copied input of a new
    size (a dynamic dim) is launched directly, not recorded.

    As with torch.compile, outputs are the graph's buffers: the next call overwrites them
    (clone to keep them). `fixed_layouts`: the caller passes inputs of one shape and stride only
    (capture's guards fix them, or the program was chosen for their layout), so a replay checks
    only where they lie (a ResNet-50's ~480 inputs: ~0.55 -> 0.15 us each on the dev CPU). Once
    replays are chosen, a call whose inputs are where the graph reads them (or fit the buffers
    they are copied into) takes the fast path: one check per input, the copies, the replay (a
    decode step's fresh token and position are copied while its weights and cache stay put)."""

    TRIAL_CALLS = 16
    MAX_RECORDINGS = 4

    def __init__(self, fn, on_direct=None, fixed_layouts=False):
        self.fn, self.on_direct, self.fixed_layouts = fn, on_direct, fixed_layouts
        self.dropped = False
        self.kernels = getattr(fn, "kernels", [])
        self.wrapper_source = getattr(fn, "wrapper_source", None)
        self.graph = self.outputs = None
        self.calls = self.recordings = 0
        self.placed: list = []  # per input: (data_ptr, shape, stride) where the graph reads it, None if copied
        self.static: list = []  # per input: the owned buffer a replay copies it into, None if read in place
        self.trial = None  # (replay, direct) host seconds while choosing; None: replay
        # the fast path's checks, once replays are chosen: per input its address (None where it
        # is copied), with its shape and stride unless fixed_layouts; and (index, buffer) copies
        self.at = None
        self.copies: list = []

    def __call__(self, *inputs):
        at = self.at
        if at is not None and (all(p is None or t.data_ptr() == p for t, p in zip(inputs, at)) if self.fixed_layouts else
                               all((p is None or t.data_ptr() == p) and t.shape == s and t.stride() == st
                                   for t, (p, s, st) in zip(inputs, at))):
            for i, buf in self.copies:
                _copy_into(buf, inputs[i])
            self.graph.replay()
            return self.outputs
        self.calls += 1
        if self.calls == 1:  # warm-up: allocator and autotuning settle before recording
            return self.fn(*inputs)
        if self.graph is None:
            return self._record(inputs, copied=set())
        moved = self._moved(inputs)
        if moved is None:  # a copied input of another size or layout (a dynamic dim): not recorded for it
            return self.fn(*inputs)
        if moved:
            return self._record(inputs, {i for i, b in enumerate(self.static) if b is not None} | moved)
        if self.trial is None:
            return self._replay(inputs)
        direct = self.calls % 2
        start = time.perf_counter()
        out = self.fn(*inputs) if direct else self._replay(inputs)
        self._tried(direct, start)
        return out

    def _moved(self, inputs):
        """Inputs read in place that are now elsewhere (indices); None if a copied input no longer
        fits its buffer."""
        moved = set()
        for i, (t, at, buf) in enumerate(zip(inputs, self.placed, self.static)):
            if buf is not None:
                if buf.shape != t.shape or buf.stride() != t.stride():
                    return None
            elif t.data_ptr() != at[0] or t.shape != at[1] or t.stride() != at[2]:
                moved.add(i)
        return moved

    def _record(self, inputs, copied):
        """Record the graph reading the inputs in `copied` from owned buffers and the others in
        place, replay it once (which uploads it) and return its outputs. Past MAX_RECORDINGS or if
        recording fails (out of memory, say), the graph is dropped and the program launched
        directly from then on."""
        self.recordings += 1
        copied = {i for i in copied if not isinstance(inputs[i], nn.Parameter)}
        if self.recordings > self.MAX_RECORDINGS:
            self._drop()
            return self.fn(*inputs)
        static = list(inputs)
        try:
            for i in copied:  # an owned buffer of the input's layout (the program was built for it)
                t = inputs[i]
                buf = self.static[i] if i < len(self.static) else None
                if buf is None or buf.shape != t.shape or buf.stride() != t.stride():
                    buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                _copy_into(buf, t)
                static[i] = buf
            graph, outputs = self._capture(static)
        except Exception as e:  # costs the graph, never the call
            warn(f"reduce-overhead: recording a CUDA graph failed ({type(e).__name__}: {e}); "
                 "launching the compiled kernels directly")
            self._drop()
            return self.fn(*inputs)
        self.graph, self.outputs = graph, outputs
        self.static = [static[i] if i in copied else None for i in range(len(static))]
        self.placed = [None if i in copied else (t.data_ptr(), t.shape, t.stride()) for i, t in enumerate(static)]
        self.trial = ([], []) if copied else None
        self._fast_path()
        graph.replay()
        return outputs

    def _fast_path(self):
        """The fast path's checks for the graph recorded (none while a trial runs)."""
        if self.trial is not None or self.graph is None:
            self.at, self.copies = None, []
            return
        self.copies = [(i, buf) for i, buf in enumerate(self.static) if buf is not None]
        self.at = [None if at is None else at[0] for at in self.placed] if self.fixed_layouts else \
            [(None, buf.shape, buf.stride()) if at is None else at for at, buf in zip(self.placed, self.static)]

    def _capture(self, inputs):
        """(graph, its outputs) of the program reading these inputs where they are: run once on a
        stream of its own, then captured on another that no CUDA call has used. A captured GEMM
        keeps the address of its cuBLAS workspace; on a stream with none cached, the capture takes
        it from the graph's own memory pool, where nothing else allocates. A workspace torch caches
        per stream would be freed under the graph when torch clears that cache (torch.compile's
        CUDA graphs do before recording) or destroys another graph captured on the same stream
        (pytorch/pytorch#193402); torch's own streams come from a pool that hands them out again."""
        device = torch.cuda.current_device()
        warm_up, capture = (torch.cuda.ExternalStream(new_stream(device)) for _ in range(2))
        warm_up.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm_up):
            self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(warm_up)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a data loader's) neither fail nor spoil it
        with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
            outputs = self.fn(*inputs)
        return graph, outputs

    def _replay(self, inputs):
        for buf, t in zip(self.static, inputs):
            if buf is not None:
                _copy_into(buf, t)
        self.graph.replay()
        return self.outputs

    def _tried(self, direct, start):
        self.trial[direct].append(time.perf_counter() - start)
        if min(len(t) for t in self.trial) < self.TRIAL_CALLS:
            return
        replay, launch = (sorted(t)[len(t) // 2] for t in self.trial)
        _LOG_RUNTIME.debug("reduce-overhead: replay %.1f us, direct %.1f us a call", replay * 1e6, launch * 1e6)
        self.trial = None
        if launch < replay:
            self._drop()
        self._fast_path()

    def _drop(self):
        self.graph = self.outputs = None
        self.static = self.placed = []
        self._fast_path()
        self.dropped = True
        if self.on_direct is not None:
            self.on_direct()


def _use_count(t) -> int:
    """References to t's storage (tensors sharing it, here or held by anyone)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Run:
    """One replay of a training graph's forward: its generation, and whether its backward has run."""
    __slots__ = ("generation", "done", "__weakref__")

    def __init__(self, generation):
        self.generation, self.done = generation, False


class TrainingGraphs:
    """mode="reduce-overhead" for a call that records a backward: the forward program and each
    backward program (one per layout of its inputs) are replayed as CUDA graphs (CudaGraphed
    each: inputs read in place or copied, the replay-or-launch trial). Replays write into the
    graphs' own buffers, so three rules keep gradients eager's:

    - the values the forward saves for backward are forward-graph buffers, which its next replay
      overwrites: the forward replays only once the backward of its last replay has run (or that
      call's autograd graph is gone); a call before that (two forwards, one backward) launches its
      program directly, into fresh memory, and so does its backward;
    - a backward of a replay whose buffers a later replay overwrote (backward with
      retain_graph=True, another call, then a second backward) raises instead of reading them;
    - gradients the backward graph writes into its own memory are handed on as new tensors
      (`.grad` takes them without a copy) and the backward replays only while none of them is
      still held (a `.grad` accumulating over steps, a gradient the caller kept): otherwise it
      launches directly. Optimizers that set `.grad` to None each step keep it replaying. A
      gradient that is an input's memory or another gradient's is handed on as the graph's own
      tensor, which autograd copies.

    A forward recorded again (an input moved) saves its values elsewhere: the backward graphs
    are then recorded again, reading them there. The forward's outputs are, as in inference,
    overwritten by its next replay (clone to keep them); each call returns new tensors (aliases),
    so an earlier call's outputs keep their own autograd history."""

    def __init__(self, forward, num_outputs):
        self.forward_program, self.num_outputs = forward, num_outputs
        # (a training graph's programs are made per layout of their inputs: backend._specialize)
        self.fw = CudaGraphed(forward, fixed_layouts=True)
        self.bw: dict = {}  # id(backward program) -> _GraphedBackward
        self.fw_recordings = 0  # the forward recording the backward graphs read the saved values of
        self.generation = 0
        self.last = None  # weakref to the _Run of the last forward replay

    def forward(self, *inputs):
        """(outputs, the _Run whose buffers they are; None: fresh memory)."""
        fw, last = self.fw, self.last and self.last()
        if fw.dropped or (last is not None and not last.done):
            return self.forward_program(*inputs), None
        outs = fw(*inputs)
        if outs is not fw.outputs:  # warm-up, a trial's direct launch, a graph just dropped
            return outs, None
        if fw.recordings != self.fw_recordings:  # its saved values now lie elsewhere: backward
            self.fw_recordings = fw.recordings  # graphs are recorded again reading them there,
            self.bw.clear()                      # instead of copying them on each replay
        self.generation += 1
        run = _Run(self.generation)
        self.last = weakref.ref(run)
        n = self.num_outputs
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs[:n]) + tuple(outs[n:]), run

    def check(self, run):
        """Before a backward unpacks what its forward saved: raises if a later replay overwrote it."""
        if run is None:
            return
        if run.generation != self.generation:
            raise RuntimeError(
                "fuselens (mode='reduce-overhead'): this backward needs values that a later call of the "
                "compiled function overwrote (each call replays a CUDA graph into the same buffers). Run "
                "backward before calling the function again, or compile with mode='default'.")
        run.done = True

    def backward(self, run, programs, args, stored=0):
        """The backward of the forward call `run` on `args` by `programs` (training.py's
        _StridedPrograms: every gradient defined, or the variant without some; `stored`: its)."""
        return programs.run(args, stored=stored) if run is None else \
            programs.run(args, replay=self._replay, stored=stored)

    def _replay(self, program, args):
        bw = self.bw.get(id(program))
        if bw is None:
            bw = self.bw[id(program)] = _GraphedBackward(program)
        return bw(*args)


class _GraphedBackward:
    """A backward program replayed as a CUDA graph, its gradients handed on by TrainingGraphs's
    third rule."""

    def __init__(self, program):
        self.program, self.graphed = program, CudaGraphed(program, fixed_layouts=True)  # (_StridedPrograms)
        self.recorded = 0  # the recording that `alias` and `counts` describe
        self.alias = self.counts = None

    def __call__(self, *inputs):
        graphed = self.graphed
        if graphed.dropped:
            return self.program(*inputs)
        if self.counts is not None and any(
                c is not None and _use_count(o) > c for o, c in zip(graphed.outputs, self.counts)):
            return self.program(*inputs)  # a gradient of the last replay is still held: fresh memory
        outs = graphed(*inputs)
        if outs is not graphed.outputs:  # warm-up, a trial's direct launch, a graph just dropped
            return outs
        if self.recorded != graphed.recordings:
            self._describe(inputs)
        return tuple(o.detach() if alias else o for o, alias in zip(outs, self.alias))

    def _describe(self, inputs):
        """Right after a recording: which outputs are the graph's own memory (not an input's or a
        copied input's buffer's), which of those share it with no other output (handed on as
        aliases), and how many references each such storage has now (nothing else holds them)."""
        graphed = self.graphed
        held = {t.untyped_storage().data_ptr() for t in (*inputs, *graphed.static)
                if isinstance(t, torch.Tensor)}
        ptrs = [o.untyped_storage().data_ptr() if isinstance(o, torch.Tensor) else None for o in graphed.outputs]
        owned = [p is not None and p not in held for p in ptrs]
        self.alias = [own and ptrs.count(p) == 1 for own, p in zip(owned, ptrs)]
        self.counts = [_use_count(o) if own else None for o, own in zip(graphed.outputs, owned)]
        self.recorded = graphed.recordings
