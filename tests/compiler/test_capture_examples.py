"""The runnable examples in examples/: each compiled function returns what its eager original
returns, with the graphs and breaks the example is meant to show."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fuselens
from fl_capture_testing import assert_same, clone_tree

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# example file -> (graph count, break codes) of its compiled function(s)
EXPECTED = {
    "gelu": (1, []),
    "softmax": (1, []),
    "sin_cos": (1, []),
    "nested_helper": (1, []),
    "mlp_module": (1, []),
    "graph_breaks": (None, ["FL100", "FL110", "FL120", "FL100"]),
}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_fl_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _target(mod, key):
    """The compiled callable for an EXAMPLE_INPUTS key ('fn' or 'Class.method')."""
    if "." in key:
        return None  # methods: called through the module instance (first input)
    return getattr(mod, key)


def test_every_example_is_covered():
    names = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))
    assert set(EXPECTED) <= set(names)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example(name, capsys):
    mod = _load(name)
    graphs, breaks = EXPECTED[name]
    for key, make in mod.EXAMPLE_INPUTS.items():
        torch.manual_seed(0)
        args = make()
        fn = _target(mod, key)
        if fn is None:  # a module instance and its inputs
            m, *rest = args
            compiled_call = lambda *a: m(*a)  # noqa: E731
            cf = getattr(m, "_fuselens_compiled", None) or type(m).forward
            eager = getattr(cf, "original", None) or type(m).forward
            expected = eager(m, *clone_tree(rest))
            got = compiled_call(*clone_tree(rest))
            assert_same(got, expected)
            ex = fuselens.explain(eager, m, *clone_tree(rest))
        else:
            assert isinstance(fn, fuselens.runtime.compiled.CompiledFunction), key
            expected = fn.original(*clone_tree(args))
            got = fn(*clone_tree(args))
            assert_same(got, expected)
            assert_same(fn(*clone_tree(args)), expected)  # cache hit
            ex = fuselens.explain(fn, *clone_tree(args))
        if graphs is not None:
            assert len(ex.graphs) == graphs, str(ex)
        assert [b.code for b in ex.graph_breaks] == breaks, str(ex)


def test_graph_breaks_example_break_in_helper_reports_stack():
    mod = _load("graph_breaks")
    x = torch.randn(8, 8)
    for sign in (1, -1):  # both branches of its data-dependent if
        xx = x.abs() * sign
        torch.testing.assert_close(mod.showcase(xx.clone()), mod.showcase.original(xx.clone()))
    ex = fuselens.explain(mod.showcase, x.abs())
    helper_break = ex.graph_breaks[-1]
    assert helper_break.function.endswith("log_and_double")
    assert [f.function.split(" (")[0] for f in helper_break.stack] == ["showcase"]
