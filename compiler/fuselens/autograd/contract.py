"""The contract of what autograd hands lower (docs/architecture.md, "Stage contracts"): the joint
graph and its partition into a forward and a backward graph, each a primitive graph
(ops/contract.py) with the inputs and outputs the partition promises. Checked where they are made
when FUSELENS_VERIFY=1."""
from __future__ import annotations

import torch.fx as fx

from ..ops.contract import check_primitive_graph, expect, is_meta_tensor

STAGE = "autograd"


def _io(graph: fx.Graph):
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return placeholders, list(next(n for n in graph.nodes if n.op == "output").args[0])


def _same_layout(a, b) -> bool:
    """Two values of the same shape and dtype (gradients and saved values: strides may differ)."""
    va, vb = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in (a, b))
    return is_meta_tensor(va) and is_meta_tensor(vb) and va.shape == vb.shape and va.dtype == vb.dtype


def check_joint(joint) -> None:
    """A JointGraph: primals, then one tangent per `tangent_outputs`; outputs: the forward's, then
    a gradient of each primal in `grad_inputs` with that primal's shape and dtype."""
    stage = f"{STAGE} (joint graph)"
    check_primitive_graph(joint.graph, stage)
    placeholders, outputs = _io(joint.graph)
    primals = placeholders[:joint.num_primals]
    tangents = placeholders[joint.num_primals:]
    expect(len(primals) == joint.num_primals and not any(p.meta.get("tangent") for p in primals), stage,
           "the placeholders", f"begin with the {joint.num_primals} primals")
    expect(len(tangents) == len(joint.tangent_outputs) and all(t.meta.get("tangent") for t in tangents), stage,
           "the placeholders", f"end with one tangent (meta['tangent']) per output in {joint.tangent_outputs}")
    for t, i in zip(tangents, joint.tangent_outputs):
        expect(_same_layout(t, outputs[i]), stage, f"tangent {t.name}", f"has forward output {i}'s shape and dtype")
    expect(len(outputs) == joint.num_fw_outputs + len(joint.grad_inputs), stage, "the outputs",
           f"are the {joint.num_fw_outputs} forward outputs, then one gradient per input in {joint.grad_inputs}")
    for g, i in zip(outputs[joint.num_fw_outputs:], joint.grad_inputs):
        expect(_same_layout(g, primals[i]), stage, f"the gradient of {primals[i].name}",
               "has its input's shape and dtype")


def check_partition(joint, parts) -> None:
    """A Partition of `joint`: the forward takes the primals and returns the forward outputs, then
    the saved values; the backward takes the saved values (each of the forward's saved output's
    shape and dtype), then the tangents, and returns the gradients. The backward draws no random
    numbers (random primitives run in the forward, their values saved)."""
    stage = f"{STAGE} (partition)"
    check_primitive_graph(parts.forward, f"{stage}, forward")
    check_primitive_graph(parts.backward, f"{stage}, backward")
    fw_in, fw_out = _io(parts.forward)
    bw_in, bw_out = _io(parts.backward)
    n_saved = len(parts.saved)
    expect(len(fw_in) == joint.num_primals, stage, "the forward's placeholders", f"are the {joint.num_primals} primals")
    expect(len(fw_out) == joint.num_fw_outputs + n_saved, stage, "the forward's outputs",
           f"are the {joint.num_fw_outputs} forward outputs, then the {n_saved} saved values")
    expect(len(bw_in) == n_saved + len(joint.tangent_outputs), stage, "the backward's placeholders",
           f"are the {n_saved} saved values, then the {len(joint.tangent_outputs)} tangents")
    for k, (saved, taken) in enumerate(zip(fw_out[joint.num_fw_outputs:], bw_in)):
        expect(_same_layout(saved, taken) or not is_meta_tensor(saved.meta.get("val")) and
               not is_meta_tensor(taken.meta.get("val")), stage,
               f"saved value {k} ({parts.saved[k]})", "has the same shape and dtype in the forward and the backward")
    expect(len(bw_out) == len(joint.grad_inputs), stage, "the backward's outputs",
           f"are the {len(joint.grad_inputs)} gradients")
    for n in parts.backward.nodes:
        expect(not (n.op == "call_function" and n.target.kind == "random") and not n.meta.get("seed"), stage,
               f"backward node {n.name}", "draws no random numbers (the forward saves them)")
