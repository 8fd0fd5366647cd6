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
    """A compiled program per layout of its inputs. The backward's inputs (saved values, incoming
    gradients) come with whatever strides the forward and the caller gave them, so it is compiled
    at its first call and again only for new layouts."""

    def __init__(self, graph, device, mode, dynamic, build_program, first_kernel_index):
        self.graph, self.device, self.mode, self.dynamic, self.build = graph, device, mode, dynamic, build_program
        self.first_kernel_index = first_kernel_index
        self.programs: dict = {}

    def get(self, inputs):
        key = tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs)
        if key not in self.programs:
            vals = [meta_like(t) for t in inputs]
            self.programs[key] = self.build(self.graph, self.device, self.mode, self.dynamic, input_vals=vals,
                                            first_kernel_index=self.first_kernel_index)
        return self.programs[key]

    def __call__(self, *inputs):
        return self.get(inputs)(*inputs)


class _State:
    def __init__(self, forward, backward, num_fw_outputs, tangent_outputs, grad_inputs, num_inputs):
        self.forward, self.backward = forward, backward
        self.num_fw_outputs, self.tangent_outputs = num_fw_outputs, tangent_outputs
        self.grad_inputs, self.num_inputs = grad_inputs, num_inputs


class CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, *inputs):
        outs = state.forward(*inputs)
        user, saved = outs[:state.num_fw_outputs], outs[state.num_fw_outputs:]
        ctx.state = state
        ctx.save_for_backward(*saved)
        differentiable = set(state.tangent_outputs)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(user)
                                      if isinstance(o, torch.Tensor) and i not in differentiable])
        return tuple(user)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        state = ctx.state
        tangents = [grad_outputs[i] for i in state.tangent_outputs]
        grads = state.backward(*ctx.saved_tensors, *tangents)
        result = [None] * (1 + state.num_inputs)
        for i, g in zip(state.grad_inputs, grads):
            result[1 + i] = g
        return tuple(result)


def compile_training(gm, inputs, device, mode, dynamic, build_program):
    """Forward and backward programs for `gm` at these inputs: (run, check, kernels, wrapper_source)."""
    prim_graph = to_primitive_graph(gm, inputs, device)
    requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
    joint = build_joint(prim_graph, requires_grad, device)
    parts = partition(joint)
    logging.getLogger("fuselens.autograd").debug("forward saves for backward: %s", ", ".join(parts.saved))
    forward = build_program(parts.forward, device, mode, dynamic)
    backward = _StridedPrograms(parts.backward, device, mode, dynamic, build_program, len(forward.kernels))
    state = _State(forward, backward, parts.num_fw_outputs, joint.tangent_outputs, joint.grad_inputs, len(inputs))
    # the backward is compiled now for contiguous gradients (shown with the forward); other
    # layouts compile on first use
    saved_vals = [n.meta["val"] for n in parts.backward.nodes if n.op == "placeholder"]
    contiguous = [torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
                  for v in saved_vals]
    bw_program = backward.get(contiguous)

    def run(*xs):
        return CompiledFunction.apply(state, *xs)

    def check(*xs):
        """Both halves once, with zero incoming gradients: a kernel that fails to compile shows up
        here, where the graph can still run eagerly, rather than inside backward()."""
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # leaves the seed sequence as it was
            outs = forward(*xs)
            tangents = [torch.zeros_like(outs[i]) for i in joint.tangent_outputs]
            backward(*outs[parts.num_fw_outputs:], *tangents)
    kernels = forward.kernels + bw_program.kernels
    source = f"# forward\n{forward.wrapper_source}\n# backward\n{bw_program.wrapper_source}"
    return run, check, kernels, source
