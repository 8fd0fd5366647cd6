"""Errors during a compiled call: the user's own exceptions are raised as eager raises them, with
every side effect (print, list append, in-place write) done once and the function still compiled;
an internal error of fuselens (capture, the backend) becomes an eager run with one
FuselensWarning (errors.fall_back), its side effects once too."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import fuselens
from fuselens import FuselensWarning, errors
from fuselens.backend import driver
from fuselens.runtime import compiled as runtime

REAL_COMPILE_GRAPH = driver.compile_graph  # before the capture tests' eager fixture patches it
LOG: list = []


class MyError(Exception):
    pass


def helper_raises(x, bad):
    if bad:
        raise MyError("from a helper")
    return x


# Each: f(x, bad) raises with `bad` (a Python bool, or a tensor where the point is a tensor op) at
# one point of a compiled call, after prints, appends and an in-place write into x.
def before_any_break(x, bad):
    x.add_(1)
    LOG.append(len(LOG))
    if bad:
        raise ValueError("before any break")
    print("after")
    return x * 2


def tensor_op_in_first_graph(x, bad):
    LOG.append(len(LOG))
    y = x.view(5, -1) if bad else x.view(-1)  # a shape error: capture's meta evaluation sees it
    return y.sum()


def inside_break_statement(x, bad):
    x.mul_(2)
    print("value", int("zz") if bad else 1)
    return x + 1


def helper_called_by_break(x, bad):
    y = x.sin()
    LOG.append(len(LOG))
    print(helper_raises(y, bad).sum())
    return y


def after_the_break(x, bad):
    print("one")
    x.add_(1)
    LOG.append(len(LOG))
    if bad:
        raise KeyError("after the break")
    return x.cos()


def in_a_later_resume(x, bad):
    print("one")
    y = x * 3
    LOG.append(len(LOG))
    print("two")
    x.sub_(1)
    assert not bad, "in a later resume"
    return y + x


def in_a_data_dependent_branch(x, bad):
    LOG.append(len(LOG))
    if x.sum() > 0:
        print("then")
        return {"ok": x}["bad" if bad else "ok"]
    return x


def inside_an_inlined_call(x, bad):
    y = x + 1
    z = _inner(y, bad)
    return z * 2


def _inner(y, bad):
    print("inner")
    LOG.append(len(LOG))
    if bad:
        raise IndexError("in the callee, after its break")
    return y


def graph_op_on_values(x, bad):
    # value-dependent: shapes are fine, the graph itself raises (a Cholesky factorization of a
    # matrix that is not positive-definite; an embedding's index out of range is not it: in Triton
    # kernels it reads 0, where eager's CUDA kernel asserts)
    print("before the graph")
    LOG.append(len(LOG))
    m = x[:4].view(2, 2)
    return torch.linalg.cholesky(m @ m.T + torch.eye(2) * (-100.0 if bad else 1.0)).sum() + x.sum()


CASES = [before_any_break, tensor_op_in_first_graph, inside_break_statement, helper_called_by_break,
         after_the_break, in_a_later_resume, in_a_data_dependent_branch, inside_an_inlined_call,
         graph_op_on_values]


def _run(fn, x, bad):
    """(outcome, stdout, LOG, x after): outcome is the result or (exception type, message)."""
    LOG.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            result = fn(x, bad)
        except Exception as e:  # noqa: BLE001 (compared with eager's)
            # the first line: pytest adds its explanation to this module's own `assert`s only
            result = (type(e), str(e).split("\n")[0])
    return result, out.getvalue(), list(LOG), x


def _same(got, expected):
    assert got[1:3] == expected[1:3], f"prints/appends: compiled {got[1:3]}, eager {expected[1:3]}"
    torch.testing.assert_close(got[3], expected[3])  # in-place writes once
    if isinstance(expected[0], tuple):
        assert got[0] == expected[0]
    else:
        assert not isinstance(got[0], tuple), got[0]
        if isinstance(expected[0], torch.Tensor):
            torch.testing.assert_close(got[0], expected[0])
        else:
            assert got[0] == expected[0]


def _disabled(cf):
    return [cf.disabled] if cf.disabled else [d for c in cf.children for d in _disabled(c)]


@pytest.mark.parametrize("real_backend", [False, True], ids=["fx", "backend"])
@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_users_error_raised_as_in_eager_side_effects_once(fn, real_backend, monkeypatch):
    if real_backend:
        monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    # (inputs of their own: printed sums are compared as text, and another order of a sum's terms
    # may round the last printed digit otherwise for some inputs)
    x0 = torch.randn(8, generator=torch.Generator().manual_seed(0)).abs() + 0.5
    cf = fuselens.compile(fn)
    for bad in (True, False, True, False):  # the function keeps working after the user's error
        expected = _run(fn, x0.clone(), bad)
        got = _run(cf, x0.clone(), bad)
        _same(got, expected)
        assert _disabled(cf) == []


def raises_on_odd_calls(x, unused):
    y = x * 2
    print("call")
    LOG.append(1)
    if len(LOG) % 2 == 1:  # a re-run would not raise: the append changed the state it reads
        raise ValueError("odd call")
    return y + 1


def test_users_error_that_a_rerun_would_not_raise():
    results = {}
    for fn in (raises_on_odd_calls, fuselens.compile(raises_on_odd_calls)):
        LOG.clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            seen = []
            for _ in range(4):
                try:
                    seen.append(fn(torch.ones(2), None).tolist())
                except ValueError as e:
                    seen.append(str(e))
        results[fn] = (seen, out.getvalue(), list(LOG))
    eager, compiled = results.values()
    assert compiled == eager, (compiled, eager)


def _warned_once(rec, *parts):
    msgs = [str(w.message) for w in rec if issubclass(w.category, FuselensWarning)]
    assert len(msgs) == 1, msgs
    text = errors.fallback_message(*parts)
    assert msgs[0] == f"fuselens: {text}", msgs[0]


def _effects(x, unused):
    print("start")
    x.add_(1)
    LOG.append(len(LOG))
    y = x.sin() * 2
    print("mid")
    LOG.append(len(LOG))
    return y.cos() + x


def test_internal_capture_error_runs_eagerly_once_with_one_warning(monkeypatch):
    cause = KeyError("synthetic capture bug")

    def boom(*a, **k):
        raise cause
    monkeypatch.setattr(runtime, "capture", boom)
    x0 = torch.randn(6)
    expected = _run(_effects, x0.clone(), None)
    cf = fuselens.compile(_effects)
    with pytest.warns(FuselensWarning) as rec:
        got = _run(cf, x0.clone(), None)
    _same(got, expected)
    _warned_once(rec, "capture", cf._name(), cause)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        _same(_run(cf, x0.clone(), None), expected)  # eager from now on, silently


def test_internal_capture_error_in_a_resume_runs_the_rest_eagerly(monkeypatch):
    real = runtime.capture
    cause = ZeroDivisionError("resume capture bug")

    def boom_in_resume(fs, *a, **k):
        if fs.generated:
            raise cause
        return real(fs, *a, **k)
    monkeypatch.setattr(runtime, "capture", boom_in_resume)
    x0 = torch.randn(6)
    expected = _run(_effects, x0.clone(), None)
    cf = fuselens.compile(_effects)
    with pytest.warns(FuselensWarning) as rec:
        got = _run(cf, x0.clone(), None)
    _same(got, expected)  # "start" and the first append were not repeated
    (resume,) = [c for c in cf.children if c.disabled]
    _warned_once(rec, "capture", resume._name(), cause)
    assert cf.disabled is None and len(cf.entries) == 1  # only the resume runs eagerly


@pytest.mark.parametrize("where", ["build", "run"])
def test_internal_backend_error_runs_the_graph_eagerly_with_one_warning(where, monkeypatch):
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    monkeypatch.setattr(driver, "runs_kernels", lambda inputs: True)  # the compiled path, any device
    cause = NotImplementedError(f"synthetic backend bug ({where})")

    def boom(*a, **k):
        raise cause
    # building the graph's programs fails, or the built program fails when run
    build = boom if where == "build" else lambda self, inputs: driver._Specialization(boom)
    monkeypatch.setattr(driver.CompiledGraph, "_build", build)
    x0 = torch.randn(6)
    expected = _run(_one_graph, x0.clone(), None)
    cf = fuselens.compile(_one_graph)
    with pytest.warns(FuselensWarning) as rec:
        got = _run(cf, x0.clone(), None)
    _same(got, expected)
    (graph,) = [g.info for e in cf.all_entries() for g in e.graph_calls]
    _warned_once(rec, "the backend", f"{graph.name} of {graph.function}", cause)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        _same(_run(cf, x0.clone(), None), expected)  # that graph eagerly, silently
    assert _disabled(cf) == []


def _one_graph(x, unused):
    print("start")
    x.add_(1)
    return x.sin() * 2 + x


def test_users_error_in_a_compiled_graph_is_not_taken_for_ours(monkeypatch):
    # the compiled program raises; the graph run eagerly raises too: the user's error, no warning,
    # and the program stays in use
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    monkeypatch.setattr(driver, "runs_kernels", lambda inputs: True)
    runs = []

    def build(self, inputs):
        def program(*inputs):  # fails on an index out of range, as an extern call would
            runs.append(1)
            if any(not t.is_floating_point() and bool((t >= 4).any()) for t in inputs):
                raise RuntimeError("program failed")
            return self._eager(*inputs)
        return driver._Specialization(program)
    monkeypatch.setattr(driver.CompiledGraph, "_build", build)

    def f(x, idx):
        return F.embedding(idx, x).sum()
    cf = fuselens.compile(f)
    x = torch.randn(4, 2)
    torch.testing.assert_close(cf(x, torch.tensor([0, 3])), f(x, torch.tensor([0, 3])))
    with pytest.raises(IndexError):
        f(x, torch.tensor([0, 9]))
    with pytest.raises(IndexError):
        cf(x, torch.tensor([0, 9]))
    graph = cf.entries[0].graph_calls[0].compiled
    assert not any(s.eager for s in graph._specializations.values())
    torch.testing.assert_close(cf(x, torch.tensor([1, 2])), f(x, torch.tensor([1, 2])))
    assert len(runs) == 3  # the program is still the one that runs


def test_generated_code_error_is_raised_not_rerun(monkeypatch):
    # an exception out of a transformed function is never re-checked by running the function
    # again: the statements it ran (the print) must not repeat
    real = runtime.build_function

    def broken(source, name, globals_, consts, code=None):
        fn = real(source, name, globals_, consts, code)
        if name != "_effects":
            return fn

        def bad(*a, **k):
            fn(*a, **k)
            raise IndexError("generated code bug")
        return bad
    monkeypatch.setattr(runtime, "build_function", broken)
    x0 = torch.randn(6)
    expected = _run(_effects, x0.clone(), None)
    got = _run(fuselens.compile(_effects), x0.clone(), None)
    assert got[0] == (IndexError, "generated code bug")
    assert got[1:3] == expected[1:3]
    torch.testing.assert_close(got[3], expected[3])


def test_no_eager_form_is_an_internal_error():
    fs = dataclasses.replace(runtime.function_source(_effects), source_text="def _effects(:")
    cf = runtime.CompiledFunction(None, fs=fs)
    with pytest.raises(fuselens.InternalError, match="no eager form"):
        cf._eager_generated


# ------------------------------------------------------------------------------ eager's exception
def unbound_after_data_dependent_if(x):
    if x.sum() > 0:
        a = x
    return a + 1


def unbound_in_break_statement(x):
    if x.shape[0] > 100:
        a = 1
    print("a is", a)
    return x


def unbound_in_callee(x):
    return _unbound_inner(x + 1) * 2


def _unbound_inner(y):
    if y.sum() > 100:
        b = y
    print("inner")
    return b


def unused_op_eager_rejects(x):
    m = (x > 0).abs()  # noqa: F841  (abs of a bool tensor: NotImplementedError in eager)
    return x + 1


def used_op_eager_rejects(x):
    return (x > 0).abs() * x + (x.long() & x.long().float())


@pytest.mark.parametrize("fn", [unbound_after_data_dependent_if, unbound_in_break_statement,
                                unbound_in_callee, unused_op_eager_rejects, used_op_eager_rejects],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("real_backend", [False, True], ids=["fx", "backend"])
def test_eagers_exception_type(fn, real_backend, monkeypatch):
    if real_backend:  # a kernel computes what eager refuses (abs of a bool tensor)
        monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    x = -torch.ones(3)
    with pytest.raises(Exception) as eager:
        fn(x)
    cf = fuselens.compile(fn)
    with pytest.raises(Exception) as compiled:
        cf(x)
    assert compiled.type is eager.type and str(compiled.value) == str(eager.value)


def test_an_input_without_storage_is_captured():
    # a wrapper subclass (TwoTensor here; DTensor alike) has no storage of its own: capture does
    # not ask which storage it shares unless something writes into an input
    from torch.testing._internal.two_tensor import TwoTensor
    a = TwoTensor(torch.randn(3), torch.randn(3))

    def f(x):
        return x * 2 + 1
    cf = fuselens.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FuselensWarning)  # (its graph runs eagerly: the backend's call)
        got = cf(a)
    want = f(a)
    assert type(got) is TwoTensor
    torch.testing.assert_close(got.a, want.a)
    torch.testing.assert_close(got.b, want.b)
    assert len(fuselens.inspect(cf)[0].graphs) == 1
