"""The guard function (capture/guards.py guard_function) and the graph call's input reads: a
model's sources are read through constants and modules' dicts instead of walking module paths,
and every change of the model's structure that the guards checked before is still seen."""
from __future__ import annotations

import ast
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import fuselens
from fuselens.capture.frames import Guard
from fuselens.capture.guards import guard_function

X = torch.randn(4, 8)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x)).relu()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.named = nn.Sequential(OrderedDict(a=nn.Linear(8, 8), b=nn.ReLU()))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        x = self.seq[0](x) + self.seq(x)
        return self.named[0](x) + self.named(x) + self.blocks[-1].fc.bias


class Double(nn.Module):
    def forward(self, w):
        return w * 2


def _plain_weight(m):
    w = m.weight
    del m.weight  # what weight_norm does: the name becomes an ordinary attribute
    m.weight = w.detach() * 2


CHANGES = {
    "submodule replaced": lambda n: setattr(n.blocks[0], "fc", nn.Linear(8, 8)),
    "ModuleList item replaced": lambda n: n.blocks.__setitem__(1, Block()),
    "ModuleList appended": lambda n: n.blocks.append(Block()),
    "ModuleList item deleted": lambda n: n.blocks.__delitem__(0),
    "ModuleList items swapped": lambda n: n.blocks.__init__([n.blocks[1], n.blocks[0]]),
    "Sequential item replaced": lambda n: n.seq.__setitem__(2, nn.Linear(8, 8)),
    "Sequential item deleted": lambda n: n.seq.__delitem__(1),
    "Sequential item inserted": lambda n: n.seq.insert(0, nn.Linear(8, 8)),
    "named Sequential item replaced": lambda n: setattr(n.named, "a", nn.Linear(8, 8)),
    "parameter replaced": lambda n: setattr(n.seq[0], "weight", nn.Parameter(torch.randn(8, 8))),
    "parameter set to None": lambda n: setattr(n.seq[2], "bias", None),
    "buffer replaced": lambda n: setattr(n.blocks[0].bn, "running_mean", torch.randn(8)),
    "parametrized": lambda n: parametrize.register_parametrization(n.seq[0], "weight", Double()),
    "parameter made a plain attribute": lambda n: _plain_weight(n.seq[0]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_model_change_after_first_call_seen(change):
    torch.manual_seed(0)
    net = Net().eval()
    cm = fuselens.compile(net)
    with torch.no_grad():
        torch.testing.assert_close(cm(X), net(X))
        CHANGES[change](net)
        torch.testing.assert_close(cm(X), net(X))
        torch.testing.assert_close(cm(X), net(X))


def test_cached_call_walks_no_module_path(monkeypatch):
    net = Net().eval()
    net.named = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # by position: item i is `_modules[str(i)]`
    cm = fuselens.compile(net)
    with torch.no_grad():
        want = cm(X)
        calls = []
        for cls, name in ((nn.Module, "__getattr__"), (nn.Sequential, "__getitem__"), (nn.ModuleList, "__getitem__")):
            fn = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda *a, fn=fn, name=name: calls.append((name, a[1:])) or fn(*a))
        got = cm(X)
    assert calls == [], calls
    torch.testing.assert_close(got, want)
    assert len(fuselens.inspect(cm)) == 1


class SlicedLayers(nn.Module):
    """transformers' decoders: `for layer in self.layers[: self.config.num_hidden_layers]`"""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])
        self.n = 4

    def forward(self, x):
        for layer in self.layers[: self.n]:
            x = layer(x).tanh()
        return x


def test_modules_of_a_sliced_module_list_are_read_by_position(monkeypatch):
    # a slice of a ModuleList is a new ModuleList: guards reading each layer's parameters through
    # it made one per source (Llama-style decoders, 8 layers: 30 ms a call on an H100)
    cm = fuselens.compile(SlicedLayers())
    with torch.no_grad():
        for _ in range(3):  # (the second call's guards make the native guard: runtime/native_guards.py)
            want = cm(X)
        made = []
        init = nn.ModuleList.__init__
        monkeypatch.setattr(nn.ModuleList, "__init__", lambda *a, **k: made.append(1) or init(*a, **k))
        got = cm(X)
    assert made == []  # (the slice's length guarded as a range's: 26 us a call for 16 layers)
    torch.testing.assert_close(got, want)
    assert len(fuselens.inspect(cm)) == 1


def _holds(exprs, sig, consts, **args):
    ns = dict(consts, torch=torch)
    exec(guard_function([Guard(e, e) for e in exprs], sig, consts), ns)
    try:
        return ns["__fl_guard"](**args)
    except Exception:  # as the runtime reads a guard that raises
        return False


class Obj:
    pass


@pytest.mark.parametrize("value, want", [([1, 2], True), (Obj(), False), (None, False)])
def test_source_read_twice_behind_a_condition_is_not_read_early(value, want):
    # `x.a` is read twice, but only where `x` is no list: reading it first would fail for lists
    exprs = ["isinstance(x, list) or x.a == 1", "isinstance(x, list) or x.a > 0"]
    assert _holds(exprs, "x", {}, x=value) is want
    o = Obj()
    o.a = 1
    assert _holds(exprs, "x", {}, x=o) is True


@pytest.mark.parametrize("n, want", [(3, True), (2, False), (0, False)])
def test_source_read_twice_after_a_length_guard(n, want):
    exprs = ["type(x) is list and len(x) == 3", "x[2] == 7", "x[2] > 0"]
    assert _holds(exprs, "x", {}, x=[5, 6, 7][:n] if n < 3 else [5, 6, 7]) is want


def test_a_comprehensions_own_variable_is_not_a_source():
    # `x` inside the generator is its own variable, not the parameter `x` read elsewhere
    exprs = ["x.a == 1", "x.a == 1 and all(x.a > 0 for x in ys)"]
    o, p = Obj(), Obj()
    o.a, p.a = 1, -1
    assert _holds(exprs, "x, ys", {}, x=o, ys=[o]) is True
    assert _holds(exprs, "x, ys", {}, x=o, ys=[p]) is False


def _capture_sources(net, *args):
    from fuselens.capture.capture import capture
    from fuselens.capture.source import function_source
    return capture(function_source(type(net).forward), (net, *args), {})


def test_templated_guards_read_as_the_same_guards_written_out():
    # guards written over their sources (Sources.guard's templates) and the same guards written
    # out (parsed: Reads._templatize) make the same facts and hold for the same models
    from fuselens.capture.guards import Reads
    results = {}
    for change in [None, *CHANGES]:
        torch.manual_seed(0)
        net = Net().train()
        cap = _capture_sources(net, X)
        assert all(g.template is not None for g in cap.guards if ".shape" in g.expr)
        sig = cap.guard_source.split("\n")[0][len("def __fl_guard("):-2]
        written_out = [Guard(g.expr, g.reason) for g in cap.guards]
        assert Reads(cap.guards, sig, cap.namespace).facts == Reads(written_out, sig, cap.namespace).facts
        if change is not None:
            CHANGES[change](net)
        got = [_holds([g.expr for g in gs], sig, cap.namespace, self=net, x=X) if gs is written_out else
               _holds_source(cap.guard_source, cap.namespace, self=net, x=X) for gs in (cap.guards, written_out)]
        assert got[0] == got[1], change
        results[change] = got[0]
    assert results.pop(None) is True
    # a tensor replaced by one of the same metadata is read anew by the graph call: no recompile
    assert {c for c, held in results.items() if held} == {"parameter replaced", "buffer replaced"}


def _holds_source(source, consts, **args):
    ns = dict(consts, torch=torch)
    exec(source, ns)
    try:
        return ns["__fl_guard"](**args)
    except Exception:
        return False


def test_a_template_over_no_plain_source_is_parsed():
    # a size expression (a dynamic dim used as a value) is no chain of attributes and items
    from fuselens.capture.guards import SRC, Sources
    s = Sources({"x": torch.randn(3, 4)})
    s.guard(f"{SRC} == 12", "size", "(x.shape[0] * x.shape[1])")
    s.guard(f"{SRC} is not None", "x given", "x")
    ns = {"torch": torch}
    exec(s.function_source("x"), ns)
    assert ns["__fl_guard"](torch.randn(3, 4)) and ns["__fl_guard"](torch.randn(2, 6))
    assert not ns["__fl_guard"](torch.randn(3, 5))


@pytest.mark.parametrize("hint", ["_0_", "__1_", "_12_name"])
def test_a_constants_name_is_never_a_templates_placeholder(hint):
    from fuselens.capture.guards import Sources, _ARG
    name = Sources({}).constant(object(), hint)
    assert not _ARG.search(name), name


def _by_mode(x, mode):
    return x + 1 if mode == "__fl__0_" else x - 1


def _by_bytes(x, mode):
    return x + 1 if mode == b"__fl__1_ __fl__0_" else x - 1


def _by_key(x, table):
    return x + table["__fl__0_"] if "__fl__0_" in table else x - 1


@pytest.mark.parametrize("f, args", [
    (_by_mode, ["__fl__0_", "mode", "__fl__0_", "other"]),
    (_by_bytes, [b"__fl__1_ __fl__0_", b"mode", b"__fl__1_ __fl__0_"]),
    (_by_key, [{"__fl__0_": 2.0}, {"table": 2.0}, {"__fl__0_": 2.0}, {"other": 1.0}])])
def test_a_placeholders_text_in_a_value_is_the_value(f, args):
    # a guard's template writes its sources as `__fl__<i>_`: the same text in a guarded string
    # (a mode, a dict's key) is compared as the string, not read as a source
    cf = fuselens.compile(f)
    x = torch.zeros(2)
    for a in args:
        torch.testing.assert_close(cf(x, a), f(x, a))


def test_a_template_with_a_placeholders_text_in_a_literal_is_filled_by_its_syntax():
    # (a guard written without `literal`: Sources.guard fills it by its tree, and the guard
    # function takes it as it is)
    from fuselens.capture.guards import SRC, Sources
    s = Sources({"m": "__fl__0_"})
    s.guard(f"{SRC} == '{SRC}'", "m", "m")
    assert s.guards[0].expr == "m == '__fl__0_'" and s.guards[0].template is None
    ns = {"torch": torch}
    exec(s.function_source("m"), ns)
    assert ns["__fl_guard"]("__fl__0_") and not ns["__fl_guard"]("m")


class CountingConfig:
    """transformers' PretrainedConfig: attributes read through a Python __getattribute__."""
    reads = 0

    def __init__(self, scale):
        self.scale = scale

    def __getattribute__(self, name):
        if name == "scale":
            CountingConfig.reads += 1
        return object.__getattribute__(self, name)


class ConfigLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.fc = config, nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * self.config.scale


class ConfiguredNet(nn.Module):
    def __init__(self, config, n=4):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([ConfigLayer(config) for _ in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.config.scale


@pytest.mark.parametrize("change", ["none", "one layer's config replaced", "the shared config's value"])
def test_an_object_held_by_every_layer_is_read_once_a_call(change):
    net = ConfiguredNet(CountingConfig(0.5)).eval()
    cm = fuselens.compile(net)
    with torch.no_grad():
        for _ in range(3):
            cm(X)
        CountingConfig.reads = 0
        cm(X)
        assert CountingConfig.reads == 1  # (the guard's; each layer's source is that object)
        if change == "one layer's config replaced":
            net.layers[2].config = CountingConfig(3.0)
        elif change == "the shared config's value":
            net.config.scale = 2.0
        torch.testing.assert_close(cm(X), net(X))
