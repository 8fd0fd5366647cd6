"""Running a partitioned graph under torch.autograd: forward and backward are both compiled programs."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from ..ops import to_primitive_graph
from ..ops.attention import save_attention_statistics
from ..ops.trace import meta_like
from ..autograd.cotangents import without_tangents
from ..autograd.facts import eager_autograd
from ..autograd.joint import build_joint
from ..autograd.partition import partition
from .. import stats


def layout_key(inputs):
    """The layouts of `inputs` as programs see them: a dim of size 1 has no stride (its index is 0;
    codegen/wrapper.py's ensure_layout keeps an extern's result whose strides differ there only)."""
    return tuple((t.shape, tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride())), t.dtype)
                 if isinstance(t, torch.Tensor) else None for t in inputs)


class _StridedPrograms:
    """A compiled backward program per layout of its inputs: compiled at its first call and again
    only for new layouts. The incoming gradients come with whatever strides the caller gave them:
    looked at on every call; the saved values with the forward's (its program's, one layout: read
    once), unless saved-tensor hooks (`save_on_cpu`, offloading) hand back copies of another
    layout: then they are looked at on every call too (~0.5 us a tensor; a ResNet-50's backward
    reads ~300). `graph()`: the
    backward graph (a program-cache hit has its programs only: partitioned again when a new
    layout comes). `ran_new()`: called after a layout's program first ran (the program cache
    stores it with the others)."""

    def __init__(self, graph, device, mode, dynamic, build_program, first_kernel_index, programs, ran_new=None,
                 variant_programs=None):
        self.graph, self.device, self.mode, self.dynamic, self.build = graph, device, mode, dynamic, build_program
        self.first_kernel_index, self.programs, self.ran_new = first_kernel_index, programs, ran_new
        self.variants: dict = {}  # frozenset of undefined tangents -> _StridedPrograms
        self._saved_key = None  # layout_key of the saved values as the forward stores them
        # frozenset of undefined tangents -> {layout_key: Program}: stored with the rest (Compiled)
        self.variant_programs = {} if variant_programs is None else variant_programs

    def get(self, inputs):
        return self._get(inputs)[0]

    def _get(self, inputs, stored=0):
        """(program, seconds it took to build or None where it was there). `stored`: the first
        `stored` inputs are values the forward saved, unpacked as it stored them (no hooks)."""
        if stored and not self.dynamic:
            if self._saved_key is None:
                self._saved_key = layout_key(inputs[:stored])
            key = self._saved_key + layout_key(inputs[stored:])
        else:
            key = layout_key(inputs)
        program = self.programs.get(key)
        if program is not None:
            return program, None
        start = time.perf_counter()
        vals = [meta_like(t) for t in inputs]
        program = self.programs[key] = self.build(self.graph(), self.device, self.mode, self.dynamic,
                                                  input_vals=vals, first_kernel_index=self.first_kernel_index,
                                                  boxed=True)
        return program, time.perf_counter() - start

    def __call__(self, *inputs):
        return self.run(list(inputs))

    def run(self, args: list, replay=None, stored=0):
        """The backward on `args`, which it empties: each saved value is freed after its last use
        (where the caller holds no other reference), as eager autograd frees them. `replay(program,
        args)`: what runs the layout's program instead of a launch (a CUDA graph's replay), whose
        inputs are of the layout it was made for. `stored`: see _get."""
        program, seconds = self._get(args, stored)
        program.compile_ahead()  # a layout first seen here: its kernels together (no-op later)
        out = program.call_boxed(args) if replay is None else replay(program, args)
        if seconds is not None:
            stats.backend["backward_layouts"] += 1
            stats.backend["seconds"] += seconds
            if self.ran_new is not None:
                self.ran_new()
        return out

    def without(self, missing: frozenset) -> "_StridedPrograms":
        """The backward programs for calls where the tangents `missing` (indices) are undefined."""
        variant = self.variants.get(missing)
        if variant is None:  # (a language model's logits beside its loss get no gradient: on every call)
            graph = functools.cache(lambda: without_tangents(self.graph(), missing, self.device))
            variant = self.variants[missing] = _StridedPrograms(
                graph, self.device, self.mode, self.dynamic, self.build, self.first_kernel_index,
                self.variant_programs.setdefault(missing, {}), self.ran_new)
        return variant


class _State:
    def __init__(self, forward, backward, num_fw_outputs, tangent_outputs, grad_inputs, num_inputs, eager,
                 tangent_dtypes, device):
        self.forward, self.backward = forward, backward
        self.graphs = None  # mode="reduce-overhead": backend/cudagraphs.py TrainingGraphs
        self.check_backward = None  # during the first call: callable(forward's outputs) (compile_training)
        self.num_fw_outputs, self.tangent_outputs = num_fw_outputs, tangent_outputs
        # an output without a gradient gets an unread stand-in of its tangent's dtype (backward)
        self.tangent_dtypes, self.device = tangent_dtypes, device
        self._stand_ins: dict = {}
        self.non_differentiable = [i for i in range(num_fw_outputs) if not eager.output_requires_grad[i]]
        # kept for backward only for autograd's version check, as eager keeps them
        self.checked_inputs, self.checked_outputs = sorted(eager.saved_inputs), sorted(eager.saved_outputs)
        self.reaches, self.raises = eager.reaches, eager.raises
        self.raising = any(eager.raises)
        self.grad_inputs = [(1 + i, i) for i in grad_inputs]  # (slot in backward's result, input)
        self.num_slots = 1 + num_inputs  # backward's result: `state` first, None where no gradient
        self._gradient_slots: dict = {}

    def stand_in(self, k, shape):
        """The unread tangent `k` passed where its output got no gradient: one element, expanded
        (zeros of a language model's logits were a 412 MB allocation and fill a GPT-2 step), and
        the same tensor every call of a shape (a backward replayed as a CUDA graph reads it in
        place; one kept per tangent, for its last shape)."""
        t = self._stand_ins.get(k)
        if t is None or t.shape != shape:
            t = self._stand_ins[k] = torch.empty((), dtype=self.tangent_dtypes[k], device=self.device).expand(shape)
        return t

    def gradient_slots(self, defined):
        """(result slot, index among the program's gradients) of each input that gets a gradient
        when the outputs `defined` (bits) have one: those that eager's backward from them reaches."""
        slots = self._gradient_slots.get(defined)
        if slots is None:
            reached = 0
            for j, bits in enumerate(self.reaches):
                if defined >> j & 1:
                    reached |= bits
            slots = self._gradient_slots[defined] = [(slot, k) for k, (slot, i) in enumerate(self.grad_inputs)
                                                     if reached >> i & 1]
        return slots


class CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, *inputs):
        if state.graphs is None:
            outs = state.forward(*inputs)
        else:
            outs, ctx.run = state.graphs.forward(*inputs)
        if state.check_backward is not None:
            state.check_backward(outs)
        ctx.state = state
        # saved-tensor hooks may hand the saved values back in another layout (backward looks)
        ctx.hooked = _saved_tensor_hooks is None or _saved_tensor_hooks(False) is not None
        n = state.num_fw_outputs
        ctx.num_saved = len(outs) - n
        ctx.save_for_backward(*outs[n:], *[inputs[i] for i in state.checked_inputs],
                              *[outs[j] for j in state.checked_outputs])
        ctx.tangent_shapes = [outs[j].shape for j in state.tangent_outputs]
        if state.non_differentiable:
            ctx.mark_non_differentiable(*[o for o in (outs[i] for i in state.non_differentiable)
                                          if isinstance(o, torch.Tensor)])
        # an output unused by the loss gets None, not zeros: its gradient path is not taken (as
        # eager's), so the inputs only it reaches get no gradient
        ctx.set_materialize_grads(False)
        return outs[:n]

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():
            raise RuntimeError(SECOND_DERIVATIVE)
        state, graphs = ctx.state, ctx.state.graphs
        defined = 0
        for j, g in enumerate(grad_outputs):
            if g is not None:
                defined |= 1 << j
                if state.raising and state.raises[j] is not None:
                    raise RuntimeError(state.raises[j])
        if not defined:  # reached only through an input of a later graph that it does not use:
            return (None,) * state.num_slots  # eager runs none of this backward, checks no version
        if graphs is not None:
            graphs.check(ctx.run)  # before the saved values are unpacked (a copy may have bumped a version)
        args = list(ctx.saved_tensors[:ctx.num_saved])  # (all unpacked: each one's version is checked)
        # autograd's references go (unless retain_graph) and the program frees each saved value
        # after its last use: the backward's peak memory is eager's, not all saved values at once
        ctx.maybe_clear_saved_tensors()
        given = [grad_outputs[j] for j in state.tangent_outputs]
        del grad_outputs
        programs = state.backward
        if any(g is None for g in given):  # eager runs no VJP from an output without a gradient
            programs = programs.without(frozenset(k for k, g in enumerate(given) if g is None))
            given = [g if g is not None else state.stand_in(k, shape)
                     for k, (g, shape) in enumerate(zip(given, ctx.tangent_shapes))]
        args += given
        del given
        stored = 0 if ctx.hooked else ctx.num_saved
        grads = programs.run(args, stored=stored) if graphs is None else \
            graphs.backward(ctx.run, programs, args, stored)
        result = [None] * state.num_slots
        for slot, k in state.gradient_slots(defined):
            result[slot] = grads[k]
        return tuple(result)


# backward(create_graph=True) runs backward under grad mode, to be differentiated again. The
# compiled backward's kernels have no derivative, and gradients returned without a graph would be
# wrong where they are: a second derivative through them silently missing from a sum (a gradient
# penalty added to a loss), or "does not require grad" where it is alone. So it is refused there,
# with what to do (torch.compile refuses at the second derivative)
SECOND_DERIVATIVE = (
    "fuselens: backward with create_graph=True (a second derivative: a gradient penalty, a Hessian) "
    "reached a compiled function; its compiled backward cannot be differentiated again, as "
    "torch.compile's cannot. Take the gradient that is differentiated again through the uncompiled "
    "function or module (the one given to fuselens.compile), or pass create_graph=False where no "
    "second derivative is needed.")
# Function.apply is a Python wrapper that handles functorch transforms around the C++ apply (and
# unwraps tensors left over from a finished one); with neither, the C++ apply itself saves its
# overhead on every training call
_apply = super(torch.autograd.Function, CompiledFunction).apply
# the innermost saved-tensor hooks (None: none), where this torch tells
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def apply(state, *inputs):
    if torch._C._are_functorch_transforms_active() or \
            any(isinstance(t, torch.Tensor) and _functorch_wrapped(t) for t in inputs):
        return CompiledFunction.apply(state, *inputs)
    return _apply(state, *inputs)


@dataclass
class Compiled:
    """What compile_training made of a graph, without its graphs: what the program cache stores
    (backend/program_cache.py; the programs pickle as their sources)."""
    eager: object  # autograd/facts.py EagerAutograd
    num_fw_outputs: int
    tangent_outputs: list
    grad_inputs: list
    tangent_dtypes: list
    saved: list  # the names of the values the forward saves for the backward
    forward: object  # Program
    backward: dict  # layout_key of the backward's inputs -> Program over every gradient
    # frozenset of tangents undefined in a backward call -> {layout_key: Program} (_StridedPrograms.without)
    variants: dict = field(default_factory=dict)
    ahead: frozenset = frozenset()  # the tangents undefined in the backward compiled ahead (_expected_missing)


def _expected_missing(tangents) -> frozenset:
    """The tangents a first backward is expected to come without: beside a loss (a 0-dim output),
    the other outputs (a language model's logits) get no gradient in a training loop. Their
    backward program is the one compiled ahead, not the one over every gradient (GPT-2 training's
    first call built both: a third of its graph work); any other set compiles at its first use."""
    if not any(isinstance(t, torch.Tensor) and t.ndim == 0 and t.dtype.is_floating_point for t in tangents):
        return frozenset()
    return frozenset(k for k, t in enumerate(tangents) if isinstance(t, torch.Tensor) and t.ndim > 0)


def _partition(gm, inputs, requires_grad, device, eager):
    prim_graph = to_primitive_graph(gm, inputs, device, requires_grad)
    save_attention_statistics(prim_graph, device, requires_grad)
    joint = build_joint(prim_graph, requires_grad, device, eager.output_requires_grad)
    private_inputs = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and i not in eager.saved_inputs]
    parts = partition(joint, private_inputs, [j for j in range(joint.num_fw_outputs) if j not in eager.saved_outputs],
                      device)
    logging.getLogger("fuselens.autograd").debug("forward saves for backward: %s", ", ".join(parts.saved))
    return joint, parts


def compile_training(gm, inputs, device, mode, dynamic, build_program, graphs=None, cached=None, ran_new=None):
    """Forward and backward programs for `gm` at these inputs: (run, first_run, [forward, backward],
    compiled), the backward being the one compiled ahead. `graphs(forward, num_outputs)`: what
    replays them (mode="reduce-overhead"), or None. `cached`: the `Compiled` of an earlier
    compile of this graph for these inputs (the program cache): no graph work.
    `ran_new()`: called when a backward program compiled for a new layout has run."""
    requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
    if cached is None:
        eager = eager_autograd(gm, inputs)
        joint, parts = _partition(gm, inputs, requires_grad, device, eager)
        forward = build_program(parts.forward, device, mode, dynamic, free_outputs=parts.num_fw_outputs)
        # the backward is compiled now (shown with the forward) for the saved values in the layouts the
        # forward stores them in and contiguous gradients; others compile on first use
        bw_vals = [n.meta["val"] for n in parts.backward.nodes if n.op == "placeholder"]
        num_saved = len(parts.saved)
        stored = forward.output_layouts[parts.num_fw_outputs:]
        expected = [(v if stored[i] is None else torch.empty_strided(*stored[i], dtype=v.dtype, device="meta"))
                    if i < num_saved else
                    torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
                    for i, v in enumerate(bw_vals)]
        tangents = bw_vals[num_saved:]
        compiled = Compiled(eager, parts.num_fw_outputs, joint.tangent_outputs, joint.grad_inputs,
                            [v.dtype for v in tangents], list(parts.saved), forward, {},
                            ahead=_expected_missing(tangents))
        backward = _StridedPrograms(lambda: parts.backward, device, mode, dynamic, build_program, len(forward.kernels),
                                    compiled.backward, ran_new, compiled.variants)
        for k in compiled.ahead:  # (as CompiledFunction.backward passes an output without a gradient)
            expected[num_saved + k] = torch.empty((), dtype=tangents[k].dtype, device="meta").expand(tangents[k].shape)
        (backward.without(compiled.ahead) if compiled.ahead else backward).get(expected)
    else:
        compiled, eager, forward = cached, cached.eager, cached.forward
        metas = [meta_like(t) for t in inputs]

        def graph():  # the same partition as the compile that was stored (it is a function of gm and inputs)
            parts = _partition(gm, metas, requires_grad, device, eager)[1]
            if list(parts.saved) != compiled.saved:
                raise RuntimeError(f"the backward of a cached program saves {compiled.saved}, partitioned again "
                                   f"{list(parts.saved)}")
            return parts.backward
        backward = _StridedPrograms(functools.cache(graph), device, mode, dynamic, build_program,
                                    len(forward.kernels), compiled.backward, ran_new, compiled.variants)
    # the backward compiled ahead: (layout of its inputs, program)
    bw_layout, bw_program = next(iter((compiled.variants[compiled.ahead] if compiled.ahead else compiled.backward).items()))
    state = _State(forward, backward, compiled.num_fw_outputs, compiled.tangent_outputs, compiled.grad_inputs,
                   len(inputs), eager, compiled.tangent_dtypes, device)
    # a replay would freeze a random op's seed; graphs read tensors only (no sizes passed as values)
    if graphs is not None and not forward.has_seed and all(isinstance(v, torch.Tensor) for v in inputs) and \
            all(t is not None for t in bw_layout):
        state.graphs = graphs(forward, compiled.num_fw_outputs)

    def run(*xs):
        return apply(state, *xs)

    def check_backward(outs):
        """The backward once, with zero incoming gradients, on what the first call's forward saved
        (before autograd holds any of it): a kernel that fails to compile or run shows up here,
        where the graph can still run eagerly, rather than inside backward()."""
        with torch.random.fork_rng(devices=[]):  # (a backward's draws leave the seed sequence as it was)
            # contiguous zeros, as compiled; an unread stand-in where no gradient is expected
            tangents = [outs[i].new_zeros(outs[i].shape) if k not in compiled.ahead else
                        state.stand_in(k, outs[i].shape) for k, i in enumerate(compiled.tangent_outputs)]
            (backward.without(compiled.ahead) if compiled.ahead else backward)(*outs[compiled.num_fw_outputs:], *tangents)

    def first_run(*xs):
        """`run` that checks the backward too (the first call: one forward, not a second for the
        check). Where it fails, the seed sequence is left as the call found it, for the eager run."""
        seeds = torch.random.get_rng_state()
        state.check_backward = check_backward
        try:
            return run(*xs)
        except BaseException:
            torch.random.set_rng_state(seeds)
            raise
        finally:
            state.check_backward = None
    return run, first_run, [forward, bw_program], compiled
