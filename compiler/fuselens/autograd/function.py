"""Running a partitioned graph under torch.autograd: forward and backward are both compiled programs."""
from __future__ import annotations

import logging

import torch
from torch.autograd.function import once_differentiable

from ..ops import to_primitive_graph
from ..ops.trace import meta_like
from .joint import build_joint
from .partition import partition


class _StridedPrograms:
    """A compiled backward program per layout of its inputs: compiled at its first call and again
    only for new layouts. The incoming gradients come with whatever strides the caller gave them;
    the saved values with the forward's, unless saved-tensor hooks (`save_on_cpu`, offloading)
    hand back copies of another layout: both are looked at on every call."""

    def __init__(self, graph, device, mode, dynamic, build_program, first_kernel_index):
        self.graph, self.device, self.mode, self.dynamic, self.build = graph, device, mode, dynamic, build_program
        self.first_kernel_index = first_kernel_index
        self.programs: dict = {}

    def get(self, inputs):
        key = tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs)
        program = self.programs.get(key)
        if program is None:
            vals = [meta_like(t) for t in inputs]
            program = self.programs[key] = self.build(self.graph, self.device, self.mode, self.dynamic,
                                                      input_vals=vals, first_kernel_index=self.first_kernel_index)
        return program

    def __call__(self, *inputs):
        program = self.get(inputs)
        program.compile_ahead()  # a layout first seen here: its kernels together (no-op later)
        return program(*inputs)


class _State:
    def __init__(self, forward, backward, num_fw_outputs, tangent_outputs, grad_inputs, num_inputs):
        self.forward, self.backward = forward, backward
        self.graphs = None  # mode="reduce-overhead": runtime/cudagraphs.py TrainingGraphs
        self.num_fw_outputs, self.tangent_outputs = num_fw_outputs, tangent_outputs
        self.non_differentiable = [i for i in range(num_fw_outputs) if i not in set(tangent_outputs)]
        self.grad_slots = [None] * (1 + num_inputs)  # backward's result, `state` first: None where no gradient
        self.grad_inputs = [1 + i for i in grad_inputs]  # the slots that get one


class CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, *inputs):
        if state.graphs is None:
            outs = state.forward(*inputs)
        else:
            outs, ctx.run = state.graphs.forward(*inputs)
        ctx.state = state
        ctx.save_for_backward(*outs[state.num_fw_outputs:])
        if state.non_differentiable:
            ctx.mark_non_differentiable(*[o for o in (outs[i] for i in state.non_differentiable)
                                          if isinstance(o, torch.Tensor)])
        return outs[:state.num_fw_outputs]

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # backward(create_graph=True): kernels have no derivative
            return _backward_once(ctx, *grad_outputs)
        state, graphs = ctx.state, ctx.state.graphs
        if graphs is not None:
            graphs.check(ctx.run)  # before the saved values are unpacked (a copy may have bumped a version)
        args = (*ctx.saved_tensors, *[grad_outputs[i] for i in state.tangent_outputs])
        grads = state.backward(*args) if graphs is None else graphs.backward(ctx.run, *args)
        result = list(state.grad_slots)
        for i, g in zip(state.grad_inputs, grads):
            result[i] = g
        return tuple(result)


# a second derivative through the compiled backward is an error when it is asked for (as
# torch.compile's); the check costs a few microseconds, so only where grad mode is on
_backward_once = once_differentiable(CompiledFunction.backward)
# Function.apply is a Python wrapper that handles functorch transforms around the C++ apply (and
# unwraps tensors left over from a finished one); with neither, the C++ apply itself saves its
# overhead on every training call
_apply = super(torch.autograd.Function, CompiledFunction).apply
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def apply(state, *inputs):
    if torch._C._are_functorch_transforms_active() or \
            any(isinstance(t, torch.Tensor) and _functorch_wrapped(t) for t in inputs):
        return CompiledFunction.apply(state, *inputs)
    return _apply(state, *inputs)


def compile_training(gm, inputs, device, mode, dynamic, build_program, graphs=None):
    """Forward and backward programs for `gm` at these inputs: (run, check, [forward, backward]),
    the backward being the program for contiguous gradients. `graphs(forward, backward,
    num_outputs)`: what replays them (mode="reduce-overhead"), or None."""
    prim_graph = to_primitive_graph(gm, inputs, device)
    requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
    joint = build_joint(prim_graph, requires_grad, device)
    parts = partition(joint)
    logging.getLogger("fuselens.autograd").debug("forward saves for backward: %s", ", ".join(parts.saved))
    forward = build_program(parts.forward, device, mode, dynamic)
    # the backward is compiled now (shown with the forward) for the saved values in the layouts the
    # forward stores them in (their traced ones) and contiguous gradients; others compile on first use
    bw_vals = [n.meta["val"] for n in parts.backward.nodes if n.op == "placeholder"]
    num_saved = len(parts.saved)
    expected = [v if i < num_saved or not isinstance(v, torch.Tensor) else
                torch.empty(v.shape, dtype=v.dtype, device="meta") for i, v in enumerate(bw_vals)]
    backward = _StridedPrograms(parts.backward, device, mode, dynamic, build_program, len(forward.kernels))
    state = _State(forward, backward, parts.num_fw_outputs, joint.tangent_outputs, joint.grad_inputs, len(inputs))
    bw_program = backward.get(expected)
    # a replay would freeze a random op's seed; graphs read tensors only (no sizes passed as values)
    if graphs is not None and not forward.has_seed and all(isinstance(v, torch.Tensor) for v in (*inputs, *bw_vals)):
        state.graphs = graphs(forward, backward, parts.num_fw_outputs)

    def run(*xs):
        return apply(state, *xs)

    def check(*xs):
        """Both halves once, with zero incoming gradients: a kernel that fails to compile shows up
        here, where the graph can still run eagerly, rather than inside backward()."""
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # leaves the seed sequence as it was
            outs = forward(*xs)
            tangents = [outs[i].new_zeros(outs[i].shape) for i in joint.tangent_outputs]  # contiguous, as compiled
            backward(*outs[parts.num_fw_outputs:], *tangents)
    return run, check, [forward, bw_program]
