"""The stage contracts (docs/architecture.md, "Stage contracts"): each verifier catches a broken
graph or IR with a message naming the node or buffer and the rule; the suite runs with them on."""
import os
import warnings

import pytest
import torch
import torch.fx as fx

from fl_backend_testing import DEVICE, trace
from fuselens.autograd import build_joint, partition
from fuselens.autograd.contract import check_joint, check_partition
from fuselens.capture.contract import check_captured
from fuselens.lower import lower_graph
from fuselens.lower import lowering
from fuselens.lower.contract import check_lowered
from fuselens.lower.ir import ExternCall
from fuselens.ops import contract, primitives as prim, to_primitive_graph
from fuselens.ops.contract import ContractError, check_primitive_graph
from fuselens.backend import driver as backend
from fuselens.errors import FuselensWarning
from fuselens.schedule import schedule
from fuselens.schedule.contract import check_schedule

META = dict(device="meta")


def f(x, w):
    return torch.relu(x @ w).sum(-1) * 2


def inputs():
    return [torch.randn(4, 8), torch.randn(8, 3)]


def prim_graph():
    return to_primitive_graph(trace(f), inputs(), "cpu")


def op(graph, p):
    return next(n for n in graph.nodes if n.target is p)


def captured():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta.update(val=torch.empty(3, **META), device=torch.device("cpu"), source="x")
    y = g.call_function(torch.sin, (x,))
    y.meta.update(val=torch.empty(3, **META), loc=("f.py", 2, 11, 2, 23), device=torch.device("cpu"))
    g.output((y,))
    return fx.GraphModule(torch.nn.Module(), g), y


def test_captured_graph_contract():
    gm, y = captured()
    check_captured(gm)
    del y.meta["loc"]
    with pytest.raises(ContractError, match=r"captured graph contract: node sin \(sin\): meta\['loc'\] is"):
        check_captured(gm)
    gm, y = captured()
    with gm.graph.inserting_after(y):
        z = gm.graph.call_method("cos", (y,))
    y.replace_all_uses_with(z, delete_user_cb=lambda u: u.op == "output")
    with pytest.raises(ContractError, match="node cos .* is a call_method node"):
        check_captured(gm)


def test_primitive_graph_contract():
    graph = prim_graph()
    check_primitive_graph(graph)
    op(graph, prim.where).target = torch.relu  # a torch function where a primitive belongs
    with pytest.raises(ContractError, match=r"primitive graph contract: node prim_where \(relu\): its target is a "
                                            r"Primitive registered"):
        check_primitive_graph(graph)
    graph = prim_graph()
    total = op(graph, prim.sum)
    total.args = (total.args[0], (5,))
    with pytest.raises(ContractError, match=r"node prim_sum \(prim_sum\): reduces dims \[5\] of a 2-d tensor"):
        check_primitive_graph(graph)


def test_joint_and_partition_contracts():
    x, w = (t.requires_grad_() for t in inputs())
    joint = build_joint(to_primitive_graph(trace(f), [x, w], "cpu"), [True, True], "cpu")
    check_joint(joint)
    parts = partition(joint)
    check_partition(joint, parts)
    joint.grad_inputs = [0]  # one gradient fewer than the graph returns
    with pytest.raises(ContractError, match=r"autograd \(joint graph\) contract: the outputs: are the 1 forward "
                                            r"outputs, then one gradient per input in \[0\]"):
        check_joint(joint)
    joint.grad_inputs = [0, 1]
    parts.saved.append("one_more")
    with pytest.raises(ContractError, match="the forward's outputs: are the 1 forward outputs, then the"):
        check_partition(joint, parts)


def test_lowered_contract():
    lowered = lower_graph(prim_graph(), "cpu")
    check_lowered(lowered)
    reduction = next(s for s in lowered.steps if getattr(s, "kind", None) == "reduction")
    reduction.shape = reduction.in_shape
    with pytest.raises(ContractError, match=rf"loop IR contract: buffer {reduction.name}: keeps the reduced dims"):
        check_lowered(lowered)
    lowered = lower_graph(prim_graph(), "cpu")
    out = lowered.outputs[0]
    out.offset += out.buf.numel()
    with pytest.raises(ContractError, match=rf"loop IR contract: output 0: views {out.buf.name} \[4\] within its "
                                            r"elements \(shape \[4\], stride \[1\], offset 4\)"):
        check_lowered(lowered)


def test_schedule_contract():
    lowered = lower_graph(prim_graph(), "cpu")
    sched = schedule(lowered)
    check_schedule(lowered, sched)
    sched.steps.reverse()  # the kernel before the matmul whose result it reads
    with pytest.raises(ContractError, match=r"schedule contract: buffer \w+: reads \w+ before it is stored or "
                                            r"computed in its kernel"):
        check_schedule(lowered, sched)
    lowered = lower_graph(prim_graph(), "cpu")
    sched = schedule(lowered)
    kernel = next(s for s in sched.steps if not isinstance(s, ExternCall))
    kernel.stores = set()
    with pytest.raises(ContractError, match=r"schedule contract: output 0: is buffer \w+, which a step stores"):
        check_schedule(lowered, sched)


def test_the_suite_verifies_every_hand_over(monkeypatch):
    """tests/conftest.py turns the contracts on; a broken one is an internal error (the graph
    runs eagerly, with a warning naming the rule) and fails the test it happens in."""
    assert os.environ.get("FUSELENS_VERIFY") == "1" and contract.enabled()

    def broken(lowered):
        contract.expect(False, "loop IR", "buffer buf0", "(broken for this test)")
    monkeypatch.setattr(lowering, "check_lowered", broken)
    x = torch.randn(5, 3, device=DEVICE)  # (a CPU graph on a GPU machine runs no lowering)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cg = backend.compile_graph(trace(lambda x: torch.sin(x)), [x])
        torch.testing.assert_close(cg(x)[0], torch.sin(x))
    assert any(issubclass(w.category, FuselensWarning) and
               "loop IR contract: buffer buf0: (broken for this test)" in str(w.message) for w in caught)
    assert contract.VIOLATIONS == ["loop IR contract: buffer buf0: (broken for this test)"]
    del contract.VIOLATIONS[:]  # (the suite's check after each test would fail this one)
