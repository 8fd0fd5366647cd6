"""Captures kept across processes (runtime/capture_cache.py): a second process takes the capture
an earlier one kept, with its own model's objects, and computes what eager does; a capture whose
code, closure values, model or hooks differ is made afresh; one with a constant that has no name
in another process is not kept.

The processes run this file as a script on a user's model written to a temporary directory (so
that a test can edit it between them): eager and compiled, a training step each, from the same
weights."""
from __future__ import annotations

import copy
import fractions
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import os
import numpy as np
import torch
import torch.nn as nn
import helpers  # another file of the user's


def make_act(scale):
    def act(x):
        return torch.relu(x) * scale
    return act


act = make_act(float(os.environ.get("ACT_SCALE", "1.0")))  # values each process decides
SHIFT = float(os.environ.get("SHIFT", "0.0"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return act(x + self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 5)
        self.gain = np.float32(0.75)

    def forward(self, x, shift=SHIFT):
        x = self.blocks(self.stem(x))
        if helpers.DEBUG:  # a module's setting, read as a constant of the process
            x = x + 1
        if os.environ.get("USER_MODE") == "negate":  # the environment, read on every call (guarded)
            x = -x
        x = x * self.gain  # a NumPy scalar: kept by value
        return helpers.scale(self.head(x.mean((2, 3)))) + shift
'''
HELPERS = '''
import os
DEBUG = os.environ.get("USER_DEBUG") == "1"


def scale(x):
    return x * 2.0
'''


def step(model, x):
    """A training step's results: the output, the parameters' gradients, the buffers after it."""
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


def child(out_path):
    import fuselens
    from fuselens import stats
    import usermodel
    torch.manual_seed(0)
    model, x = usermodel.Net().train(), torch.randn(2, 3, 8, 8)
    reference = step(copy.deepcopy(model), x)
    result = step(fuselens.compile(model), x)
    torch.save(dict(reference=reference, result=result, capture=dict(stats.capture)), out_path)


def process(tmp_path, tag, **env):
    out = tmp_path / f"{tag}.pt"
    # (the runtime's log: why a kept capture was not taken, in a failing assertion's message)
    env = dict(os.environ, FUSELENS_PROGRAM_CACHE="1", FUSELENS_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "compiler"), str(tmp_path / "user")]),
               FUSELENS_LOG="runtime", **env)
    env.pop("FUSELENS_CAPTURE_CACHE", None)
    p = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    res = torch.load(out)
    (out_, grads, buffers), (ref, ref_grads, ref_buffers) = res["result"], res["reference"]
    torch.testing.assert_close(out_, ref)
    for a, b in zip(grads + buffers, ref_grads + ref_buffers):
        torch.testing.assert_close(a, b)
    return Captures((res["capture"]["functions"], res["capture"]["kept"]),
                    [line for line in p.stderr.splitlines() if "capture cache" in line or "kept capture" in line])


class Captures(tuple):
    """(captures a process made, kept captures it took), and `log`: its runtime log's lines on kept
    captures (why one was not taken), the message of an assertion on them."""

    def __new__(cls, counts, log):
        t = super().__new__(cls, counts)
        t.log = log
        return t


@pytest.fixture
def user(tmp_path):
    d = tmp_path / "user"
    d.mkdir()
    (d / "usermodel.py").write_text(MODEL)
    (d / "helpers.py").write_text(HELPERS)
    return d


def test_second_process_takes_the_kept_capture(tmp_path, user):
    first = process(tmp_path, "first")
    assert first == (1, 0), first.log
    second = process(tmp_path, "second")
    assert second == (0, 1), second.log


@pytest.mark.parametrize("edit", ["method", "function", "other_file", "closure_value", "default_value",
                                  "module_setting", "environment_read"])
def test_what_changed_since_is_captured_again(tmp_path, user, edit):
    process(tmp_path, "first")
    env = {}
    if edit == "method":  # a module's forward (inlined: no guard names it)
        (user / "usermodel.py").write_text(MODEL.replace("x + self.bn(", "x - self.bn("))
    elif edit == "function":  # a function it calls (a constant of the capture)
        (user / "usermodel.py").write_text(MODEL.replace("torch.relu(x) * scale", "torch.relu(x) * scale + 1"))
    elif edit == "other_file":  # a function it calls, in another file
        (user / "helpers.py").write_text(HELPERS.replace("2.0", "3.0"))
    elif edit == "closure_value":  # the same code, a closure holding another value
        env["ACT_SCALE"] = "0.5"
    elif edit == "default_value":  # the same code, the function's default another value
        env["SHIFT"] = "1.0"
    elif edit == "module_setting":  # the same code, a module's attribute (read without a guard) another value
        env["USER_DEBUG"] = "1"
    else:  # the same code, an environment variable read in forward another value (its guard fails)
        env["USER_MODE"] = "negate"
    second = process(tmp_path, "second", **env)  # (each equal to eager: `process`)
    assert second == (1, 0), second.log
    third = process(tmp_path, "third", **env)  # kept beside the first
    assert third == (0, 1), third.log


# -- in one process: another model of the same code ------------------------------------------------
class Net(nn.Module):
    def __init__(self, width=4, act=nn.ReLU):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), act()
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))).mean((2, 3)))


@pytest.fixture
def kept(tmp_path, monkeypatch):
    from fuselens import stats
    monkeypatch.setenv("FUSELENS_PROGRAM_CACHE", "1")
    monkeypatch.delenv("FUSELENS_CAPTURE_CACHE", raising=False)
    monkeypatch.setenv("FUSELENS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(stats, "capture", dict.fromkeys(stats.capture, 0))
    return stats.capture


def compiled_step(model, x):
    """The compiled step's results (a new compile of `model`), checked against eager's."""
    import fuselens
    reference = step(copy.deepcopy(model), x)
    result = step(fuselens.compile(model), x)
    for a, b in zip([result[0]] + result[1] + result[2], [reference[0]] + reference[1] + reference[2]):
        torch.testing.assert_close(a, b)
    return result


def test_another_instance_takes_the_kept_capture_with_its_own_modules(kept):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    a = Net().train()
    compiled_step(a, x)
    a_buffers = [b.clone() for b in a.buffers()]
    b = Net().train()  # other weights, other modules, the same code
    compiled_step(b, x)  # its own BatchNorm statistics written (checked against eager's)
    assert (kept["functions"], kept["kept"]) == (1, 1)
    assert all(torch.equal(u, v) for u, v in zip(a.buffers(), a_buffers))  # not a's


def _rows_scaled(x, w):
    return (x @ w).softmax(-1) * x.shape[0]


@pytest.mark.parametrize("how", ["recompile", "mark_dynamic"])
def test_a_capture_with_dynamic_dims_is_kept_and_taken_dynamic(kept, how):
    import fuselens
    w = torch.randn(8, 8)
    first = fuselens.compile(_rows_scaled)
    if how == "recompile":  # the second size makes dim 0 dynamic: that capture is kept too
        for rows in (3, 4):
            first(torch.randn(rows, 8), w)
    else:
        x = torch.randn(3, 8)
        torch._dynamo.mark_dynamic(x, 0)
        first(x, w)
    assert fuselens.inspect(first)[-1].dynamic_dims == {"x": [0]}
    captured = kept["functions"]
    again = fuselens.compile(_rows_scaled)  # as in another process: the kept dynamic capture
    for rows in (5, 9, 2):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(again(x, w), _rows_scaled(x, w))
    entries = fuselens.inspect(again)
    assert (kept["functions"], kept["kept"], len(entries)) == (captured, 1, 1)
    assert entries[0].dynamic_dims == {"x": [0]}
    again(torch.randn(4, 8), torch.randn(8, 6))  # a static dim changed: a recompile, dim 0 still dynamic
    assert fuselens.inspect(again)[-1].dynamic_dims == {"w": [1], "x": [0]}


def test_lambdas_on_one_line_are_captured_apart(kept):
    # (the same file, qualified name `<lambda>` and line: a kept capture's key names its column too;
    # the second lambda had taken the first's capture and doubled instead of tripling)
    import fuselens
    x = torch.randn(8)
    for fn in [lambda x: x * 2, lambda x: x * 3]:
        torch.testing.assert_close(fuselens.compile(fn)(x), fn(x))
    assert kept["kept"] == 0 and kept["functions"] == 2


@pytest.mark.parametrize("other", [
    lambda: Net(width=6),  # other shapes: tensor guards
    lambda: Net().eval(),  # another mode: module guards
    lambda: Net(act=nn.GELU),  # another class at the same place
    lambda: hooked(Net()),  # a hook on a submodule: capture breaks there
], ids=["shapes", "eval", "class", "hook"])
def test_another_model_is_captured_afresh(kept, other):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    compiled_step(Net().train(), x)
    compiled_step(other(), x)  # (equal to eager: the hook's doubling included)
    assert kept["kept"] == 0 and kept["functions"] >= 2


class Act(nn.Module):
    def forward(self, x):
        return self.scaled(torch.relu(x))

    def scaled(self, x):
        return x * 2


@pytest.mark.parametrize("method", ["forward", "scaled"])
def test_a_module_class_whose_method_changed_is_captured_afresh(kept, monkeypatch, method):
    # (a class's methods are not guarded: a library that patches one in one process and not in
    # another, as here between two compiles)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    compiled_step(Net(act=Act).train(), x)
    monkeypatch.setattr(Act, method, lambda self, x: torch.sigmoid(x))
    compiled_step(Net(act=Act).train(), x)
    assert (kept["functions"], kept["kept"]) == (2, 0)


def hooked(net):
    net.act.register_forward_hook(lambda mod, args, out: out * 2)
    return net


def _views(x, w):
    q, k, v = (x @ w).split(4, dim=-1)  # parts of one storage, at offsets 0, 4 and 8
    att = (q @ k.transpose(-1, -2)).softmax(-1) @ v
    out = att.view(2, -1)
    out[:, 0] += 1  # an in-place write into a view
    return out, k.t()


def test_a_kept_graph_is_the_captured_graph():
    # what the backend reads of a graph (each node's target, arguments and metadata as the program
    # cache's key writes them: meta values' layouts and offsets) and which values share storage
    from fuselens.capture.capture import capture
    from fuselens.capture.source import function_source
    from fuselens.backend import program_cache
    from fuselens.runtime import capture_cache
    x, w = torch.randn(2, 3, 8), torch.randn(8, 12, requires_grad=True)
    graph = capture(function_source(_views), (x, w), {}).graph.gm.graph
    again = capture_cache._graph(capture_cache._nodes(graph))

    def described(g):
        storages, out = {}, []
        for n in g.nodes:
            vals = n.meta.get("val")
            vals = vals if isinstance(vals, (tuple, list)) else (vals,)
            shared = [storages.setdefault(v.untyped_storage()._cdata, len(storages))
                      for v in vals if isinstance(v, torch.Tensor)]
            out.append((n.op, n.name, program_cache._canonical(n.target), program_cache._canonical(n.args),
                        program_cache._canonical(dict(n.kwargs)), program_cache._canonical(dict(n.meta)), shared))
        return out
    assert described(again) == described(graph)
    assert any(len(set(d[-1])) == 1 and len(d[-1]) == 3 for d in described(graph))  # (the split)
    assert any(v.storage_offset() for n in again.nodes for v in (
        n.meta["val"] if isinstance(n.meta.get("val"), tuple) else ()))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = fractions.Fraction(1, 2)  # a number of no type kept by value

    def forward(self, x):
        return x * 0.5 if self.scale == 0.5 else x


def test_a_capture_with_a_constant_of_no_builtin_type_is_not_kept(kept, tmp_path):
    import fuselens
    for _ in range(2):
        torch.testing.assert_close(fuselens.compile(Scaled())(torch.ones(4)), torch.full((4,), 0.5))
    assert (kept["functions"], kept["kept"]) == (2, 0)
    assert not list((tmp_path / "captures").glob("*"))


def test_a_corrupt_entry_is_captured_afresh(kept, tmp_path):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    compiled_step(Net().train(), x)
    entry, = (tmp_path / "captures").glob("*")
    entry.write_bytes(entry.read_bytes()[:-100])
    compiled_step(Net().train(), x)
    assert (kept["functions"], kept["kept"]) == (2, 0)
    compiled_step(Net().train(), x)  # kept again, whole
    assert (kept["functions"], kept["kept"]) == (2, 1)


def test_a_kept_capture_that_does_not_build_is_captured_afresh(kept, monkeypatch):
    from fuselens.runtime import capture_cache
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    compiled_step(Net().train(), x)
    real = capture_cache._capture

    def broken(*args):
        cap = real(*args)
        cap.codes, cap.guard_source = {}, "def __fl_guard(:"  # (as an entry made by a bug would be)
        return cap
    monkeypatch.setattr(capture_cache, "_capture", broken)
    compiled_step(Net().train(), x)  # compiled, not the eager fallback of an internal error
    assert (kept["functions"], kept["kept"]) == (2, 0)


if __name__ == "__main__":
    child(sys.argv[1])
