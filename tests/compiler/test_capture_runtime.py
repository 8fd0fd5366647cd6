"""The runtime around captured code: guards and recompiles, dynamic dims after a size change,
the recompile limit, input mutation, eager fallbacks (more in test_fallback.py), and the public
API's inputs."""
from __future__ import annotations

import collections
import enum
import functools
import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuselens
from fuselens import FuselensWarning
from fuselens.runtime import compiled as runtime
from fl_capture_testing import check

torch.manual_seed(0)
X = torch.randn(4, 8)
SCALE = 2.0


def n_entries(cf):
    return len(fuselens.inspect(cf))


def _pointwise(x):
    return x.sin() * 2 + 1


# ------------------------------------------------------------------------------ tensor guards
def test_same_inputs_hit_the_cache():
    cf = fuselens.compile(_pointwise)
    for _ in range(5):
        x = torch.randn(4, 8)
        torch.testing.assert_close(cf(x), _pointwise(x))
    assert n_entries(cf) == 1


def test_dtype_change_recompiles():
    cf = fuselens.compile(_pointwise)
    cf(X)
    x64 = X.double()
    out = cf(x64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, _pointwise(x64))
    assert n_entries(cf) == 2
    cf(X), cf(x64)
    assert n_entries(cf) == 2


def test_stride_change_recompiles():
    cf = fuselens.compile(_pointwise)
    sq = torch.randn(8, 8)
    cf(sq)
    t = sq.t()
    torch.testing.assert_close(cf(t), _pointwise(t))
    assert n_entries(cf) == 2


def test_requires_grad_change_recompiles_and_grads_flow():
    cf = fuselens.compile(_pointwise)
    cf(X)
    xg = X.clone().requires_grad_(True)
    out = cf(xg)
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(xg.grad, 2 * X.cos())
    assert n_entries(cf) == 2


def test_shape_change_recompiles_once_then_dim_is_dynamic():
    def f(x):
        n = x.shape[0]
        return x.softmax(-1) * n + x.sum(0)
    cf = fuselens.compile(f)
    for rows in (4, 5, 6, 7, 16):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(cf(x), f(x))
    assert n_entries(cf) == 2, [e.guards for e in fuselens.inspect(cf)]
    first, last = fuselens.inspect(cf)
    assert any("?x8" in g.reason for g in last.guards), [g.reason for g in last.guards]
    # each recompile says why (the guard that failed) and which dims are dynamic from then on
    assert first.recompiled_because is None and first.dynamic_dims == {}
    assert "4x8" in last.recompiled_because and last.dynamic_dims == {"x": [0]}, last.recompiled_because
    # the other dim is still static: changing it recompiles
    x = torch.randn(5, 3)
    torch.testing.assert_close(cf(x), f(x))
    assert n_entries(cf) == 3
    assert "?x8" in fuselens.inspect(cf)[-1].recompiled_because


def test_dynamic_dim_used_as_python_value_is_correct():
    def f(x):
        out = x
        for i in range(x.shape[0]):  # specializes: guarded on the exact size
            out = out + i
        return out.view(x.shape[0] * 2, -1)
    cf = fuselens.compile(f)
    for rows in (2, 3, 4, 3):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(cf(x), f(x))


def test_dynamic_false_recompiles_per_size():
    cf = fuselens.compile(_pointwise, dynamic=False)
    for rows in (2, 3, 4):
        cf(torch.randn(rows, 8))
    assert n_entries(cf) == 3


# ------------------------------------------------------------------------------ value guards
def test_constant_arguments_guarded_by_value():
    def f(x, k, flag=True, name="a"):
        y = x * k
        return y + 1 if flag and name == "a" else y - 1
    cf = fuselens.compile(f)
    for args in [(2,), (2,), (3,), (3, False), (2.0,), (2, True, "b"), (2,)]:
        torch.testing.assert_close(cf(X, *args), f(X, *args))
    # 2 and 2.0 are different constants (int vs float)
    assert n_entries(cf) == 5


def test_list_argument_length_and_items_guarded():
    def f(x, ks):
        for k in ks:
            x = x * k
        return x
    cf = fuselens.compile(f)
    for ks in ([1, 2], [1, 2], [1, 2, 3], (1, 2), [2, 2]):
        torch.testing.assert_close(cf(X, ks), f(X, ks))
    assert n_entries(cf) == 4


def test_global_value_change_recompiles():
    global SCALE

    def f(x):
        return x * SCALE
    cf = fuselens.compile(f)
    old = SCALE
    try:
        torch.testing.assert_close(cf(X), X * 2.0)
        SCALE = 5.0
        torch.testing.assert_close(cf(X), X * 5.0)
    finally:
        SCALE = old
    assert n_entries(cf) == 2


def test_closure_value_change_recompiles():
    k = 2.0

    def f(x):
        return x * k
    cf = fuselens.compile(f)
    torch.testing.assert_close(cf(X), X * 2.0)
    k = 7.0  # noqa: F841 (read through the closure cell)
    torch.testing.assert_close(cf(X), X * 7.0)


def _plus_one(t):
    return t + 1


def _plus_two(t):
    return t + 2


HELPER = _plus_one


def test_global_helper_rebound_recompiles():
    global HELPER

    def f(x):
        return HELPER(x) * 2
    cf = fuselens.compile(f)
    try:
        torch.testing.assert_close(cf(X), (X + 1) * 2)
        HELPER = _plus_two
        torch.testing.assert_close(cf(X), (X + 2) * 2)
    finally:
        HELPER = _plus_one


_LOG_BUF = io.StringIO()
_LOG_LIST: list = []


@pytest.mark.parametrize("effect", ["buf", "list"])
def test_a_c_method_of_an_object_does_not_recompile(effect):
    """`buf.write` and `lst.append` are new objects at each lookup: their guard is the
    receiver's type and the method's name, not identity (every call recompiled)."""
    def f(x):
        y = x * 2
        if effect == "buf":
            _LOG_BUF.write("a")
        else:
            _LOG_LIST.append(1)
        return y + 1
    check(f, X, calls=3)


_D1, _D2 = {"k": 1.0}, {"k": 2.0}
GET = _D1.get


def test_a_c_method_of_another_object_recompiles():
    """A bound C method read from a global: rebound to the same method of another object (or a
    pybind11 function to another of the same name), the call is another one."""
    global GET

    def f(x):
        return x * GET("k")
    cf = fuselens.compile(f)
    try:
        torch.testing.assert_close(cf(X), X * 1.0)
        GET = _D2.get
        torch.testing.assert_close(cf(X), X * 2.0)
    finally:
        GET = _D1.get


def test_a_c_method_of_another_type_recompiles():
    def f(x, log):
        log.append(1)
        return x + 1
    cf = fuselens.compile(f)
    a, b = [], collections.deque()
    cf(X, a), cf(X, b)
    assert a == [1] and list(b) == [1]


# ------------------------------------------------------------------------------ module guards
def test_module_identity_guarded():
    def f(m, x):
        return m(x)
    cf = fuselens.compile(f)
    a, b = nn.Linear(8, 3), nn.Linear(8, 3)
    torch.testing.assert_close(cf(a, X), a(X))
    torch.testing.assert_close(cf(b, X), b(X))
    torch.testing.assert_close(cf(a, X), a(X))
    assert n_entries(cf) == 2


def test_module_training_flag_guarded():
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    cm = fuselens.compile(m)
    m.eval()
    torch.testing.assert_close(cm(X), m[0](X))
    m.train()
    torch.manual_seed(1)
    out = cm(X)
    torch.manual_seed(1)
    torch.testing.assert_close(out, F.dropout(m[0](X), 0.5, True))
    m.eval()
    torch.testing.assert_close(cm(X), m[0](X))
    assert n_entries(cm) == 2


class _Mode(enum.Enum):
    SUM = "sum"
    MEAN = "mean"


class _Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def _double(t):
    return t * 2


class _Scaler:
    def __init__(self, k):
        self.k = k

    def scale(self, t):
        return t * self.k

    def __call__(self, t):
        return t * self.k + 1


class _Holder(nn.Module):
    """Hyper-parameters and helpers held as plain attributes, read by forward."""

    def __init__(self):
        super().__init__()
        self.act = torch.relu                 # a builtin
        self.fn = _double                     # a Python function
        self.lam = lambda t: t - 1            # a lambda
        self.cls = nn.Tanh                    # a class, made in forward
        self.method = _Scaler(2.0).scale      # a bound method of another object
        self.pool = (2, 1)                    # a tuple of ints
        self.k = 2                            # an int (float after the change: another dtype)
        self.mode = _Mode.SUM                 # an Enum member
        self.level = _Level.LOW               # an IntEnum member
        self.dtype = torch.float32
        self.fns = (torch.sin, torch.cos)     # a tuple of functions
        self.cap = float("inf")               # no literal: by a constant
        self.part = functools.partial(torch.clamp, min=0.0)
        self.obj = _Scaler(3.0)               # a callable object
        self.sl, self.rng, self.names, self.z = slice(0, 8), range(1), frozenset({"a"}), 1 + 0j
        self.np_scale = np.float32(0.5)       # a NumPy scalar: a number of no builtin type

    def forward(self, x):
        y = self.act(x) + self.fn(x) + self.lam(x) + self.cls()(x) + self.method(x)
        y = y + F.avg_pool1d(x[None], *self.pool)[0].sum() + self.fns[0](x) + self.fns[1](x)
        y = y + (x.int() * self.k).to(self.dtype) + x.clamp(max=self.cap) + self.part(x) + self.obj(x)
        y = y + x[..., self.sl].sum() * len(self.rng) * (2 if "b" in self.names else 1) * abs(self.z)
        y = y * self.np_scale
        y = y.sum(1) if self.mode is _Mode.SUM else y.mean(1)
        return y * (10 if self.level == _Level.HIGH else 1)


ATTRIBUTE_CHANGES = {
    "builtin": lambda m: setattr(m, "act", torch.sigmoid),
    "function": lambda m: setattr(m, "fn", lambda t: t * 3),
    "lambda": lambda m: setattr(m, "lam", lambda t: t + 1),
    "class": lambda m: setattr(m, "cls", nn.Sigmoid),
    "bound method of another object": lambda m: setattr(m, "method", _Scaler(5.0).scale),
    "attribute of a method's object": lambda m: setattr(m.method.__self__, "k", 7.0),
    "tuple of ints": lambda m: setattr(m, "pool", (4, 2)),
    "int to float": lambda m: setattr(m, "k", 2.0),
    "int to bool": lambda m: setattr(m, "k", True),
    "infinity": lambda m: setattr(m, "cap", 0.5),
    "Enum member": lambda m: setattr(m, "mode", _Mode.MEAN),
    "IntEnum member": lambda m: setattr(m, "level", _Level.HIGH),
    "dtype": lambda m: setattr(m, "dtype", torch.float64),
    "tuple of functions": lambda m: setattr(m, "fns", (torch.cos, torch.sin)),
    "partial": lambda m: setattr(m, "part", functools.partial(torch.clamp, min=-0.5)),
    "partial's keywords": lambda m: m.part.keywords.update(min=0.5),
    "callable object": lambda m: setattr(m, "obj", _Scaler(4.0)),
    "callable object's attribute": lambda m: setattr(m.obj, "k", 4.0),
    "slice": lambda m: setattr(m, "sl", slice(2, 5)),
    "range": lambda m: setattr(m, "rng", range(3)),
    "frozenset": lambda m: setattr(m, "names", frozenset({"b"})),
    "complex": lambda m: setattr(m, "z", 3 + 4j),
    "NumPy scalar": lambda m: setattr(m, "np_scale", np.float32(0.25)),
}


@pytest.mark.parametrize("change", list(ATTRIBUTE_CHANGES))
def test_module_attribute_changed_after_first_call_is_seen(change):
    """Whatever a module attribute forward reads holds, its change is a recompile, never a
    stale result: values by type and value, code, classes and enum members by identity."""
    m = _Holder()
    cm = fuselens.compile(m)
    x = torch.randn(4, 8)
    torch.testing.assert_close(cm(x), m(x))
    ATTRIBUTE_CHANGES[change](m)
    want = m(x)
    got = cm(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)



class _Settings:
    scale = 2.0  # a class-level setting, changed by assignment to the class


class _ReadsClassAttributes(nn.Module):
    OFFSET = 1

    def forward(self, x):
        return x * _Settings.scale + type(self).OFFSET


@pytest.mark.parametrize("change", ["through a global class", "through type(self)"])
def test_class_attribute_changed_after_first_call_is_seen(change):
    m = _ReadsClassAttributes()
    cm = fuselens.compile(m)
    torch.testing.assert_close(cm(X), X * 2.0 + 1)
    try:
        if change == "through a global class":
            _Settings.scale = 3.0
        else:
            _ReadsClassAttributes.OFFSET = 5
        torch.testing.assert_close(cm(X), m(X))
    finally:
        _Settings.scale, _ReadsClassAttributes.OFFSET = 2.0, 1

def test_module_parameter_replaced_is_seen():
    m = nn.Linear(8, 2)
    cm = fuselens.compile(m)
    cm(X)
    with torch.no_grad():
        m.weight.mul_(2)  # in-place: the same tensor, new values
    torch.testing.assert_close(cm(X), F.linear(X, m.weight, m.bias))
    m.weight = nn.Parameter(torch.randn(2, 8))
    torch.testing.assert_close(cm(X), F.linear(X, m.weight, m.bias))


# ------------------------------------------------------------------------------ global state
def test_grad_mode_guarded():
    w = torch.randn(8, requires_grad=True)

    def f(x):
        return x * w
    cf = fuselens.compile(f)
    assert cf(X).requires_grad
    with torch.no_grad():
        assert not cf(X).requires_grad
    assert cf(X).requires_grad
    assert n_entries(cf) == 2


def test_autocast_guarded():
    def f(x, y):
        return x @ y.T
    cf = fuselens.compile(f)
    assert cf(X, X).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cf(X, X)
        ref = f(X, X)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    assert n_entries(cf) == 2


def test_default_dtype_guarded():
    def f(x):
        return x + torch.ones(8)
    cf = fuselens.compile(f)
    assert cf(X).dtype == torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        x = X.double()
        out = cf(x)
        assert out.dtype == f(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert n_entries(cf) == 2


# ------------------------------------------------------------------------------ recompile limit
def test_recompile_limit_falls_back_to_eager_with_one_warning():
    def f(x, k):
        return x * k + 1
    cf = fuselens.compile(f)
    for k in range(runtime.RECOMPILE_LIMIT):
        torch.testing.assert_close(cf(X, k), f(X, k))
    assert n_entries(cf) == runtime.RECOMPILE_LIMIT
    with pytest.warns(FuselensWarning) as rec:
        torch.testing.assert_close(cf(X, 100), f(X, 100))
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "recompile limit" in msg and "k == 7" in msg, msg
    assert "f" in msg
    # from now on eager, silently; earlier entries are not used either (eager is always right)
    torch.testing.assert_close(cf(X, 101), f(X, 101))
    torch.testing.assert_close(cf(X, 3), f(X, 3))
    assert n_entries(cf) == runtime.RECOMPILE_LIMIT


def _random_spans(n):
    """Spec augment's NumPy mask, reduced: draws live across breaks, a new value on every call."""
    m = np.zeros((3, n), dtype=bool)
    k = np.random.randint(1, n // 2)
    for i in range(3):
        s = np.random.randint(0, n - k)
        m[i, s:s + k] = True
    return m


def test_recompiles_of_a_function_and_its_continuations_are_bounded_together(monkeypatch):
    """Each recompile of an entry makes continuations of its own, each with its own limit: a
    value that changes on every call had grown the tree without bound (~1,000 entries and 0.5 ms
    a call after 1,200 calls). Past the accumulated limit, a piece that misses runs eagerly."""
    monkeypatch.setattr(runtime, "ACCUMULATED_RECOMPILE_LIMIT", 3)

    def f(x):
        return x.masked_fill(torch.from_numpy(_random_spans(x.shape[1])), 0.0) * 2
    cf = fuselens.compile(f)
    x = torch.randn(3, 32)
    counts = []
    with pytest.warns(FuselensWarning, match="3 recompiles of this function and its continuations"):
        for seed in range(40):
            np.random.seed(seed)
            want = f(x)
            np.random.seed(seed)
            torch.testing.assert_close(cf(x), want, rtol=0, atol=0)
            counts.append(n_entries(cf))
    assert counts[-1] == counts[20], counts
    assert sum(e.recompiled_because is not None for e in fuselens.inspect(cf)) == 3


def test_explain_of_a_compiled_function_reports_its_recompiles():
    """`fuselens.explain(compiled)` with no arguments: what its calls compiled so far, each
    recompile's failed guard and the dims made dynamic, and the recompile limit's verdict."""
    def f(x, k):
        return x * k + 1
    cf = fuselens.compile(f)
    cf(X, 1)
    cf(torch.randn(5, 8), 1)   # a new size: recompiled, the dim dynamic from then on
    cf(X, 2)                   # a new constant: recompiled
    ex = fuselens.explain(cf)
    assert n_entries(cf) == 3 and len(ex.recompiles) == 2 and ex.disabled is None
    text = str(ex)
    assert "recompiled " in text and "k == 1" in text and "dims [0]" in text, text
    for k in range(3, runtime.RECOMPILE_LIMIT + 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FuselensWarning)
            cf(X, k)
    assert "running eagerly now: recompile limit" in str(fuselens.explain(cf))


def test_recompile_limit_names_shape_guard_when_dynamic_is_off():
    cf = fuselens.compile(_pointwise, dynamic=False)
    for rows in range(1, runtime.RECOMPILE_LIMIT + 1):
        cf(torch.randn(rows, 8))
    with pytest.warns(FuselensWarning, match=r"recompile limit.*x: float32\["):
        cf(torch.randn(50, 8))


# ------------------------------------------------------------------------------ input mutation
def test_mutation_of_input_visible_after_call():
    def f(x, y):
        x.mul_(2)
        y.add_(x)
        return (x + y).sum()
    check(f, X, torch.ones(4, 8))


def test_mutation_then_break_then_mutation():
    def f(x):
        x.add_(1)
        print("mid")
        x.mul_(3)
        return x.sum()
    check(f, X)


def test_aliased_inputs_mutation():
    def f(x, y):
        x.add_(1)
        return y * 2
    t_eager = X.clone()
    expected = f(t_eager, t_eager)
    t = X.clone()
    cf = fuselens.compile(f)
    torch.testing.assert_close(cf(t, t), expected)
    torch.testing.assert_close(t, t_eager)
    u, v = X.clone(), X.clone()
    torch.testing.assert_close(cf(u, v), X * 2)  # not aliased any more: a different entry
    torch.testing.assert_close(u, X + 1)


def test_output_aliases_input():
    def f(x):
        return x, x.view(-1), x[0]
    cf = fuselens.compile(f)
    t = X.clone()
    a, b, c = cf(t)
    t.add_(1)
    torch.testing.assert_close(a, t)
    torch.testing.assert_close(b, t.view(-1))
    torch.testing.assert_close(c, t[0])


def test_mutation_of_requires_grad_leaf_raises_like_eager():
    def f(w):
        w.add_(1)
        return w
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        f(w)
    cf = fuselens.compile(f)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        cf(w)


# ------------------------------------------------------------------------------ fallbacks
def test_internal_evaluator_error_falls_back(monkeypatch):
    from fuselens.capture.evaluator import Evaluator

    def boom(self, e, scope):
        raise ZeroDivisionError("evaluator bug")
    monkeypatch.setattr(Evaluator, "_ex_BinOp", boom)

    def f(x):
        return x * 2
    with pytest.warns(FuselensWarning, match="ZeroDivisionError"):
        torch.testing.assert_close(fuselens.compile(f)(X), X * 2)


def test_user_error_inside_compiled_function_raises_without_fallback():
    def f(x):
        return x @ x  # (4, 8) @ (4, 8): a shape error in eager too
    cf = fuselens.compile(f)
    with pytest.raises(RuntimeError):
        f(X)
    with pytest.raises(RuntimeError):
        cf(X)
    sq = torch.randn(8, 8)
    torch.testing.assert_close(cf(sq), sq @ sq)  # not disabled by the user's error


def test_user_error_after_an_input_was_written_raises_as_in_eager():
    # the compiled run writes y, then raises the program's own error; re-running eagerly from the
    # written y would take the other branch and return a value where eager raises
    def f(x, y):
        y.add_(1)
        if bool((y < 2.5).all()):
            return (x * 2).T.contiguous().T.view(-1)  # eager refuses this view
        return x
    with pytest.raises(RuntimeError, match="view size"):
        f(X, torch.ones(3))
    y = torch.ones(3)
    with pytest.raises(RuntimeError, match="view size"):
        fuselens.compile(f)(X, y)
    torch.testing.assert_close(y, torch.full((3,), 2.0))  # written once, as eager writes it


# ------------------------------------------------------------------------------ bad input
_ns: dict = {"torch": torch}
exec("def no_source(x):\n    return x * 3\n", _ns)
NO_SOURCE = _ns["no_source"]


def test_function_without_source_explain_raises_clear_error():
    with pytest.raises(fuselens.NoSourceError, match="no_source"):
        fuselens.explain(NO_SOURCE, X)


def test_function_without_source_compile_warns_and_runs_eagerly():
    cf = fuselens.compile(NO_SOURCE)
    with pytest.warns(FuselensWarning, match="cannot compile.*no_source"):
        torch.testing.assert_close(cf(X), X * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        torch.testing.assert_close(cf(X), X * 3)  # warned once


def test_builtin_function_compile_and_explain():
    cf = fuselens.compile(torch.sin)
    with pytest.warns(FuselensWarning):
        torch.testing.assert_close(cf(X), torch.sin(X))
    with pytest.raises(fuselens.NoSourceError):
        fuselens.explain(torch.sin, X)


def test_compile_rejects_bad_arguments():
    with pytest.raises(TypeError):
        fuselens.compile(42)
    with pytest.raises(ValueError, match="mode"):
        fuselens.compile(_pointwise, mode="fastest")
    with pytest.raises(TypeError):
        fuselens.inspect(_pointwise)


# ------------------------------------------------------------------------------ API
def test_compile_as_decorator_forms():
    @fuselens.compile
    def a(x):
        return x + 1

    @fuselens.compile(mode="max-autotune")
    def b(x):
        return x + 2
    torch.testing.assert_close(a(X), X + 1)
    torch.testing.assert_close(b(X), X + 2)
    assert fuselens.compile(a) is a
    assert a.__name__ == "a"


def test_decorated_method():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        @fuselens.compile
        def forward(self, x):
            return torch.relu(self.fc(x))
    m = M()
    torch.testing.assert_close(m(X), torch.relu(m.fc(X)))
    m2 = M()
    torch.testing.assert_close(m2(X), torch.relu(m2.fc(X)))


def test_kwargs_call():
    def f(x, *, scale=1.0, shift):
        return x * scale + shift
    check(f, X, scale=2.0, shift=X)


def test_inspect_entries():
    def f(x):
        y = x * 2
        print("b")
        return y + 1
    cf = fuselens.compile(f)
    cf(X)
    entries = fuselens.inspect(cf)
    assert len(entries) == 2
    top = entries[0]
    assert top.source.startswith("def f(x):") and "print(" in top.source
    assert top.guards and top.graphs and top.graphs[0].op_count == 1
    assert top.graph_break is not None and top.graph_break.code == "FL100"
    assert "after the graph break" in entries[1].function
    assert isinstance(top.kernels, list) and isinstance(top.wrappers, list)


def test_inspect_and_explain_on_module():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    cm = fuselens.compile(m)
    cm(X)
    assert len(fuselens.inspect(cm)) == 1
    ex = fuselens.explain(cm, X)
    assert len(ex.graphs) == 1 and ex.graph_breaks == []
    ex2 = fuselens.explain(nn.Linear(8, 2), X)
    assert len(ex2.graphs) == 1


def test_explain_of_compiled_function_does_not_touch_its_cache():
    cf = fuselens.compile(_pointwise)
    cf(X)
    ex = fuselens.explain(cf, X)
    assert len(ex.graphs) == 1
    assert n_entries(cf) == 1


def test_dynamic_shapes_printed_and_compared_like_eager(capsys):
    def f(x, y):
        z = x * 2
        print(x.shape, y.shape[0])
        if x.shape == y.shape:
            return z + y
        return z
    cf = fuselens.compile(f)
    for rx, ry in [(4, 4), (5, 5), (6, 6), (6, 7), (8, 8)]:
        x, y = torch.randn(rx, 8), torch.randn(ry, 8)
        torch.testing.assert_close(cf(x, y), f(x, y))
    out = capsys.readouterr().out.splitlines()
    assert out[0::2] == out[1::2]  # compiled printed what eager printed (torch.Size, ints)


def test_dynamic_dims_and_shapes_of_intermediates():
    def f(x):
        h = x.relu() * 1
        n = h.shape[0]  # an intermediate's size: must follow the input's size
        out = h * n + h.view(-1).reshape(h.shape)
        for row in h:  # unrolled for this many rows
            out = out + row
        return out, len(h)
    cf = fuselens.compile(f)
    for rows in (4, 5, 6, 7):
        x = torch.randn(rows, 8)
        out, n = cf(x)
        ref, rn = f(x)
        torch.testing.assert_close(out, ref)
        assert n == rn


def test_optimizer_step_pattern_mutates_leaf_under_no_grad():
    def step(params, grads, lr):
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
    ps = [torch.randn(5, requires_grad=True), torch.randn(3, requires_grad=True)]
    gs = [torch.randn(5), torch.randn(3)]
    pe = [p.detach().clone().requires_grad_() for p in ps]
    pc = [p.detach().clone().requires_grad_() for p in ps]
    step(pe, gs, 0.1)
    cstep = fuselens.compile(step)
    cstep(pc, gs, 0.1)
    for a, b in zip(pc, pe):
        torch.testing.assert_close(a, b)
        assert a.is_leaf and a.requires_grad


def test_inplace_under_no_grad_keeps_autograd_history():
    def f(x, w):
        h = x * w
        with torch.no_grad():
            h.mul_(2)
        return (h * h).sum(), h
    x = torch.randn(4)
    we, wc = torch.randn(4, requires_grad=True), None
    wc = we.detach().clone().requires_grad_()
    le, he = f(x, we)
    lc, hc = fuselens.compile(f)(x, wc)
    torch.testing.assert_close(lc, le)
    assert hc.requires_grad == he.requires_grad
    le.backward()
    lc.backward()
    torch.testing.assert_close(wc.grad, we.grad)


def test_inplace_under_no_grad_on_input_that_joined_autograd():
    lin = nn.Linear(8, 8)

    def f(x, y):
        y += torch.tanh(lin(x))
        with torch.no_grad():
            y -= x
        y.clamp_(-2, 2)
        return y
    check(f, X, torch.randn(4, 8))


def test_explain_guards_and_graph_lines():
    m = nn.Linear(8, 2)

    def f(x, k):
        return m(x) * k
    ex = fuselens.explain(f, X, 3)
    reasons = [g.reason for g in ex.guards]
    for needle in ("grad mode is on", "default dtype is torch.float32", "autocast on cpu is off",
                   "x: float32[4x8] on cpu", "k == 3", "training"):
        assert any(needle in r for r in reasons), (needle, reasons)
    g = ex.graphs[0]
    assert g.lines and all(isinstance(l, int) for _, l in g.lines)
    assert g.op_count == len([n for n in g.graph.nodes if n.op == "call_function"])


DROP = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))


def test_training_flag_guarded_for_module_reached_through_a_global():
    def f(x):
        return DROP(x)
    cf = fuselens.compile(f)
    try:
        for mode in ("eval", "train", "eval"):
            getattr(DROP, mode)()
            torch.manual_seed(0)
            ref = f(X)
            torch.manual_seed(0)
            torch.testing.assert_close(cf(X), ref)
    finally:
        DROP.eval()


def test_autocast_entered_around_the_compiled_call():
    """An autocast the caller enters holds inside the compiled function, as in eager (capture
    started with none: the graph computed in float32)."""
    lin = nn.Linear(8, 8)
    cf = fuselens.compile(lambda x: lin(x).relu())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = cf(X), lin(X).relu()
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    got = cf(X)  # outside it again: another cache entry, float32
    assert got.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the graph itself casts (kernels know no autocast)
        ex = fuselens.explain(lambda x: lin(x).relu(), X)
    assert any(torch.bfloat16 in n.args for n in ex.graphs[0].graph.nodes), str(ex)


def test_one_guard_keeps_inputs_written_in_place_unshared():
    def f(a, b, c):
        a.add_(1)
        b.mul_(2)
        return a + b + c
    args = [torch.randn(4) for _ in range(3)]
    ex = fuselens.explain(f, *args)
    alias_guards = [g for g in ex.guards if "share no memory" in g.reason]
    assert len(alias_guards) == 1
    cf = fuselens.compile(f)
    cf(*[t.clone() for t in args])
    a, c = torch.randn(4), torch.randn(4)
    b = c[:]  # b shares c's storage: the entry's guard fails, and the write reaches c as in eager
    ea, ec = a.clone(), c.clone()
    want = f(ea, ec[:], ec)
    torch.testing.assert_close(cf(a, b, c), want)
    torch.testing.assert_close(c, ec)
