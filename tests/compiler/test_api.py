"""The public API's edges: what users pass in, and the errors they get."""
import warnings

import pytest
import torch
import torch.nn as nn

import fuselens
from fl_capture_testing import DictMapping


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()

    def scaled(self, x, k=2.0):
        return self.fc(x) * k


def test_bound_method_compiles_and_explains():
    m = Net()
    x = torch.randn(3, 4)
    cm = fuselens.compile(m.scaled)
    torch.testing.assert_close(cm(x), m.scaled(x))
    torch.testing.assert_close(cm(x, k=3.0), m.scaled(x, k=3.0))
    ex = fuselens.explain(m.scaled, x)
    assert len(ex.graphs) == 1 and ex.graph_breaks == []
    assert any("self.fc.weight" in s for s in ex.graphs[0].inputs)


def test_compiled_module_shares_the_module_and_leaves_it_eager():
    m = Net()
    cm = fuselens.compile(m)  # as torch.compile: a wrapper module, the original untouched
    assert isinstance(cm, fuselens.CompiledModule) and cm._orig_mod is m
    assert "forward" not in m.__dict__
    assert dict(cm.named_parameters())["_orig_mod.fc.weight"] is m.fc.weight
    assert list(cm.state_dict()) == ["_orig_mod.fc.weight", "_orig_mod.fc.bias"]
    assert cm.fc is m.fc and cm.scaled.__func__ is Net.scaled  # other attributes: the module's
    x = torch.randn(2, 4)
    torch.testing.assert_close(cm(x), m(x))
    assert len(fuselens.inspect(cm)) == 1
    with torch.no_grad():
        m.fc.weight.mul_(2)  # shared parameters: the compiled module sees the change
    torch.testing.assert_close(cm(x), m(x))
    cm.eval()  # reaches the module, and switches the cache entry (guarded on .training)
    assert not m.training
    cm(x)
    assert len(fuselens.inspect(cm)) == 2
    m(x)
    assert len(fuselens.inspect(cm)) == 2  # calling the original runs eager


def test_compile_in_place_keeps_the_module():
    m = Net()
    assert fuselens.compile_in_place(m) is m
    assert list(m.state_dict()) == ["fc.weight", "fc.bias"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(m(x), Net.forward(m, x))
    assert len(fuselens.inspect(m)) == 1
    with pytest.raises(TypeError, match="use fuselens.compile for a function"):
        fuselens.compile_in_place(lambda x: x)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="unknown mode 'fast'.*default"):
        fuselens.compile(lambda x: x, mode="fast")
    with pytest.raises(TypeError, match="expects a function or an nn.Module"):
        fuselens.compile(3)
    with pytest.raises(TypeError, match="what fuselens.compile returned"):
        fuselens.inspect(lambda x: x)
    with pytest.raises(fuselens.NoSourceError):
        fuselens.explain(torch.sin, torch.randn(2))


def test_lambdas_sharing_a_line_compile_the_right_one():
    make = lambda: lambda x, y: torch.relu(x) * y  # noqa: E731  (two lambdas start on this line)
    plus, times = (lambda x: torch.relu(x) + 1), (lambda x: torch.relu(x) * 2)  # the same parameters
    nested = lambda x: lambda x: x * 3  # noqa: E731
    x, y = torch.randn(5), torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)  # no eager fallback
        torch.testing.assert_close(fuselens.compile(make())(x, y), torch.relu(x) * y)
        torch.testing.assert_close(fuselens.compile(times)(x), torch.relu(x) * 2)
        torch.testing.assert_close(fuselens.compile(plus)(x), torch.relu(x) + 1)
        torch.testing.assert_close(fuselens.compile(nested(None))(x), x * 3)
    assert fuselens.explain(make(), x, y).graph_count == 1


def test_functions_without_a_source_file_are_called_without_a_search(monkeypatch):
    # a dataclass's generated __init__ (`<string>`) has no source: capture calls it as it is,
    # without inspect's scan of every loaded module for one (~5 ms each with transformers
    # loaded); a frozen module's method (`<frozen _collections_abc>` Mapping.get) is read from
    # the standard library's file, without that scan either
    import dataclasses
    import inspect

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        scale: float = 2.0

    def f(x, p):
        o = Out(x.relu())
        return o.y * o.scale + p.get("b", 0.0)

    def no_scan(*a, **k):
        raise AssertionError("inspect.getsourcelines was called")

    monkeypatch.setattr(inspect, "getsourcelines", no_scan)
    x, p = torch.randn(4), DictMapping({"b": 1.5})
    torch.testing.assert_close(fuselens.compile(f)(x, p), f(x, p))


@pytest.mark.parametrize("enabled", [True, False])
def test_compiling_leaves_the_garbage_collector_as_it_was(enabled):
    # capture and the backend pause it (stats.py gc_paused), also where they fail
    import gc

    def f(x):
        return (x * 2).sin()

    def bad(x):
        return torch.relu(x) + undefined_name  # noqa: F821  (NameError in the user's code)

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        fuselens.compile(f)(torch.randn(3))
        with pytest.raises(NameError):
            fuselens.compile(bad)(torch.randn(3))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
