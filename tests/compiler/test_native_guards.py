"""Guards checked natively (runtime/native_guards.py): an entry's fast guard holds exactly where its
Python guard does, for every way a tensor it checks can change without changing identity, and a
call after such a change computes what eager does."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fuselens
from fuselens.capture.guards import unshared
from fuselens.codegen.cpp_build import compiler
from fuselens.runtime.native_guards import NATIVE

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to build the native guards")


@pytest.fixture(scope="module")
def native():
    module = NATIVE.wait()
    assert module is not None, NATIVE.failed
    return module


class Mlp(nn.Module):
    shift = 0.5  # (the instance's own `shift` shadows it)

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])
        self.norm = nn.LayerNorm(6)
        self.register_buffer("scale", torch.ones(6))
        self.shift = 0.5

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).tanh()
        return self.norm(x) * self.scale + self.shift


def _fast_entry(cm, *args):
    """The one entry of `cm`, called until its guard is the native one: made at the second call
    whose guards hold (the first after the capture's is Python's: an entry called once never
    repays making it)."""
    cm(*args), cm(*args)
    (entry,) = cm._fuselens_compiled.entries
    assert not getattr(entry.guard_fn, "native", False)
    cm(*args)
    assert getattr(entry.guard_fn, "native", False), "the entry's guard was not made native"
    return entry


def _set(name, make):
    """A change of `layers[0].weight` (or the buffer) that keeps the object, as `.to()` and
    `requires_grad_` do."""
    def change(m):
        t = m.scale if name == "scale" else m.layers[0].weight
        new = make(t.detach())
        if isinstance(new, str):
            getattr(t, new)(False)
        else:
            t.data = new
    return change


CHANGES = {
    "dtype": _set("w", lambda t: t.double()),
    "shape": _set("w", lambda t: torch.randn(6, 7)),
    "strides": _set("w", lambda t: t.t().contiguous().t()),
    "rank": _set("w", lambda t: t.reshape(6, 6, 1)),
    "requires_grad": _set("w", lambda t: "requires_grad_"),
    "buffer not contiguous": _set("scale", lambda t: torch.ones(12)[::2]),
    "buffer on meta": lambda m: setattr(m, "scale", m.scale.to("meta")),
    "parameter replaced by a plain tensor": lambda m: m.layers[1]._parameters.__setitem__(
        "weight", m.layers[1].weight.detach().clone()),
    "same metadata": _set("w", lambda t: t.clone()),
    "attribute now the class's": lambda m: delattr(m, "shift"),
    "attribute changed": lambda m: setattr(m, "shift", 1.5),
    "module in train mode": lambda m: m.layers[3].train(),
    "hook added": lambda m: m.norm.register_forward_hook(lambda mod, args, out: out * 2),
    "submodule replaced": lambda m: m.layers.__setitem__(1, nn.Linear(6, 6)),
    "bias removed": lambda m: setattr(m.layers[0], "bias", None),
    "size-1 dim's stride": _set("scale", lambda t: t.reshape(6, 1).as_strided((6, 1), (1, 7)).reshape(6)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_native_guard_holds_where_the_python_guard_does(native, change):
    torch.manual_seed(0)
    m = Mlp().eval()
    cm = fuselens.compile(m)
    x = torch.randn(3, 6)
    with torch.no_grad():
        entry = _fast_entry(cm, x)
        python_guard = entry.guard_fn.python
        assert entry.guard_fn(m, x) is True and python_guard(m, x) is True
        CHANGES[change](m)
        assert entry.guard_fn(m, x) is python_guard(m, x)
        try:
            want = Mlp.forward(m, x)
        except RuntimeError as e:  # (float64 weights, a shape that no longer fits: eager's error)
            with pytest.raises(type(e)):
                cm(x)
            return
        got = cm(x)
        if want.device.type == "meta":
            assert got.device.type == "meta" and got.shape == want.shape
        else:
            torch.testing.assert_close(got, want)


def test_a_changed_tensor_recompiles_with_its_reason(native):
    m = Mlp().eval()
    cm = fuselens.compile(m)
    x = torch.randn(3, 6)
    with torch.no_grad():
        _fast_entry(cm, x)
        m.scale.data = torch.full((1,), 2.0)  # (broadcast: the same forward, another graph)
        torch.testing.assert_close(cm(x), Mlp.forward(m, x))
    entries = cm._fuselens_compiled.entries
    assert len(entries) == 2
    assert "self.scale: float32[6]" in entries[1].recompiled_because, entries[1].recompiled_because


class Cache(nn.Module):
    """A KV cache written in place (runtime/reinplace.py): its guard that the cache shares no
    storage with another input is checked natively."""

    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.register_buffer("cache", torch.zeros(8, 4))
        self.register_buffer("other", torch.zeros(8, 4))

    def forward(self, x, pos):
        for p in self.proj:
            x = p(x)
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0) + self.other.sum(0)


def test_an_input_written_in_place_that_comes_to_share_storage_is_seen(native):
    m, ref = Cache().eval(), Cache().eval()
    ref.load_state_dict(m.state_dict())
    cm = fuselens.compile(m)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(1, 4)
            torch.testing.assert_close(cm(x, torch.tensor([i])), ref(x, torch.tensor([i])))
        (entry,) = cm._fuselens_compiled.entries
        assert getattr(entry.guard_fn, "native", False)
        m.other = m.cache  # the written buffer is now read as `other` too
        ref.other = ref.cache
        for i in range(3, 5):
            x = torch.randn(1, 4)
            torch.testing.assert_close(cm(x, torch.tensor([i])), ref(x, torch.tensor([i])))


def test_a_distinct_match_agrees_with_the_python_check(native):
    """TensorMatch(distinct=True) answers True only where guards.unshared holds (False and None
    leave it to the Python guard), over every choice of tensors sharing storage or not."""
    import itertools
    base = torch.randn(10)
    items = [base[:4], base[4:], torch.randn(3), torch.empty(0), torch.empty(0), nn.Parameter(torch.randn(2)),
             base, torch.randn(3).expand(2, 3)]
    for r in (1, 2, 3):
        for combo in itertools.combinations(items, r):
            tensors, others = combo[:1], combo[1:] + (7,)
            got = native.TensorMatch((), tensors, True)(tensors, others)
            want = len({t.untyped_storage().data_ptr() for t in combo}) == len(combo)
            assert (got is True) == want, combo
            if got:
                assert unshared(combo, combo), combo


def test_a_tensor_match_is_made_only_of_tensors(native):
    with pytest.raises(TypeError):
        native.TensorMatch((), (torch.ones(2), 3), False)
    match = native.TensorMatch((), (torch.ones(2, 3), nn.Parameter(torch.ones(3))), False)
    assert match((torch.zeros(2, 3), nn.Parameter(torch.zeros(3))), None) is True
    assert match((torch.zeros(2, 3), torch.zeros(3)), None) is False  # a Parameter's type
    assert match((torch.zeros(2, 3),), None) is False
    assert match((torch.zeros(2, 3), "x"), None) is False


def test_without_a_compiler_the_guards_stay_python(monkeypatch, tmp_path):
    from fuselens.runtime import native_guards
    monkeypatch.setenv("FUSELENS_CACHE_DIR", str(tmp_path))  # (no extension built before)
    monkeypatch.setattr(native_guards, "compiler", lambda: None)
    monkeypatch.setattr(native_guards, "NATIVE", native_guards._Native())
    m = Mlp().eval()
    cm = fuselens.compile(m)
    x = torch.randn(3, 6)
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(cm(x), Mlp.forward(m, x))
    (entry,) = cm._fuselens_compiled.entries
    assert not getattr(entry.guard_fn, "native", False) and "no C++ compiler" in native_guards.NATIVE.failed


def test_a_compiled_model_that_holds_its_compiled_function_is_collected(native):
    """The native guards hold the model's modules (as the Python guards' constants do), and the
    model holds the compiled function: a cycle the collector must see through them."""
    import gc
    import weakref
    m = Mlp().eval()
    m.compiled = fuselens.compile(m)
    with torch.no_grad():
        _fast_entry(m.compiled, torch.randn(3, 6))
    gone = weakref.ref(m)
    del m
    gc.collect()
    assert gone() is None


def test_a_models_module_guards_are_all_checked_natively(native):
    """Every condition over the model's modules (identity, mode, hooks, attributes) and every
    parameter's tensor guard is taken by the C++ checks: what stays Python reads the arguments."""
    from fuselens.capture.guards import guard_function
    from fuselens.runtime.native_guards import Checks
    m = Mlp().eval()
    cm = fuselens.compile(m)
    entry = _fast_entry(cm, torch.randn(3, 6))
    sig = entry._sig[len("def __fl_guard("):-2]
    checks = Checks(entry.guard_namespace)
    source, found = guard_function(entry.guards, sig, entry.guard_namespace, native=checks)
    python = [line.strip() for line in source.split("\n") if line.startswith("    if not") and "native" not in line]
    assert len(checks.tensor_paths) == 11 and len(found) >= 30
    assert all(line.startswith(("if not (torch.", "if not (self is ")) for line in python), python
