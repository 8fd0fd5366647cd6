"""transformers' models compiled whole (issue 16): tiny configs from the library's own config
classes, random weights, no downloads (hf_zoo.py). Each model in eval and in train mode, three
calls: outputs (and, in train mode, the loss and every parameter's gradient) equal eager's, no
fallback warning, calls 2 and 3 add no cache entry, and no more graphs or breaks than
`torch._dynamo.explain` counts on the same model, computed here. The capture tests run each
graph as its FX module; two models also run end to end as generated Triton kernels (in the
interpreter on CPU)."""
from __future__ import annotations

import copy

import pytest
import torch

import fuselens
import hf_zoo
from fl_fx_backend import use_fx_backend


def assert_close_tree(got, want, path="out"):
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, msg=lambda m: f"{path}: {m}")
    elif isinstance(want, dict):  # ModelOutput: its items (and attributes, below)
        assert list(got) == list(want), path
        for k in want:
            assert_close_tree(dict.__getitem__(got, k), dict.__getitem__(want, k), f"{path}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close_tree(a, b, f"{path}[{i}]")
    elif hasattr(want, "__dict__") and type(want).__module__.startswith("transformers"):
        assert_close_tree(vars(got), vars(want), f"{path}.__dict__")  # a cache, its layers
    else:
        assert got == want, path


def dynamo_counts(model, inputs):
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(**inputs)
    return ex.graph_count, ex.graph_break_count


@pytest.fixture
def fx_backend(monkeypatch):
    """Graphs run as their FX modules: these tests are about capture (the kernels of every
    primitive are tested in tests/backend and tests/conformance)."""
    use_fx_backend(monkeypatch)


def run_and_compare(name, train, calls=3, dropout=True):
    model, inputs = hf_zoo.make(name, dropout=dropout)
    model.train(train)
    ref = copy.deepcopy(model)
    cm = fuselens.compile(model)
    entries = None
    for call in range(calls):
        torch.manual_seed(call)  # dropout in train mode draws the same numbers
        got = cm(**inputs)
        torch.manual_seed(call)
        want = ref(**inputs)
        assert_close_tree(got, want)
        if train:
            hf_zoo.loss_of(got).backward()
            hf_zoo.loss_of(want).backward()
        n = len(fuselens.inspect(cm))
        assert entries is None or n == entries, f"call {call + 1} recompiled"
        entries = n
    if train:
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), pname
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"grad of {pname}: {m}")
    return model, ref, inputs, cm


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", hf_zoo.names())
def test_model_compiles_whole_equal_to_eager(name, train, fx_backend):
    model, ref, inputs, _ = run_and_compare(name, train)
    ex = fuselens.explain(model, **inputs)
    graphs, breaks = dynamo_counts(ref, inputs)
    assert len(ex.graphs) <= graphs and len(ex.graph_breaks) <= breaks, (
        f"fuselens {len(ex.graphs)} graphs / {len(ex.graph_breaks)} breaks, "
        f"torch.compile {graphs} / {breaks}\n{ex}")


@pytest.mark.parametrize("name", ["gpt2-labels", "vit"])
def test_model_runs_as_generated_kernels(name):
    """One text and one vision model end to end through the backend (fusion, codegen, Triton
    kernels; on CPU in Triton's interpreter), forward and backward; without dropout, whose
    random numbers the kernels draw their own way."""
    cm = run_and_compare(name, train=True, calls=1, dropout=False)[-1]
    assert sum(len(e.kernels) for e in fuselens.inspect(cm)) > 10  # the graph ran as kernels
