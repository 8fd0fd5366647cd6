"""The guard function (capture/guards.py guard_function) and the graph call's input reads: a
model's sources are read through constants and modules' dicts instead of walking module paths,
and every change of the model's structure that the guards checked before is still seen."""
from __future__ import annotations

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
        want = cm(X)
        made = []
        init = nn.ModuleList.__init__
        monkeypatch.setattr(nn.ModuleList, "__init__", lambda *a, **k: made.append(1) or init(*a, **k))
        got = cm(X)
    assert len(made) <= 1, len(made)  # (the length guard of the slice)
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
