"""Blocks whose Python semantics capture keeps: context managers written in Python (their
`__enter__`/`__exit__` interpreted, exceptions passed to `__exit__`), and graph breaks inside
`with`, `for`/`while` bodies with `continue`/`break`, and `try` bodies (resumed inside the
block). Each compiled call equals eager's: values, the exception raised, and side effects made
once per call; graph and break counts are exact."""
from __future__ import annotations

import contextlib

import pytest
import torch

import fuselens
from fl_capture_testing import check

X = torch.randn(4, 8)


class Counting:
    """A context manager with side effects on entry and exit, and an optional suppression."""

    def __init__(self, log, suppress=()):
        self.log, self.suppress, self.entered = log, suppress, 0

    def __enter__(self):
        self.entered += 1
        self.log.append("enter")
        return self.entered

    def __exit__(self, typ, exc, tb):
        self.log.append(("exit", None if typ is None else typ.__name__))
        return typ is not None and issubclass(typ, self.suppress)


def run_both(make_fn, *args, calls=2):
    """`make_fn(log)` -> the function under test, closing over a fresh log (and context
    manager): eager and compiled each called `calls` times on their own state. Returns both
    (results, log) pairs; each result is a value or the exception raised."""
    out = []
    for compiled in (False, True):
        log = []
        fn = make_fn(log)
        run = fuselens.compile(fn) if compiled else fn
        results = []
        for _ in range(calls):
            try:
                results.append(run(*args))
            except Exception as e:  # noqa: BLE001 (compared with eager's)
                results.append(e)
        out.append((results, log))
    (want, want_log), (got, got_log) = out
    assert got_log == want_log
    for a, b in zip(got, want):
        if isinstance(b, Exception):
            assert type(a) is type(b) and str(a) == str(b)
        else:
            torch.testing.assert_close(a, b)
    return make_fn


def counts(fn, *args):
    ex = fuselens.explain(fn, *args)
    return len(ex.graphs), [b.code for b in ex.graph_breaks]


# ------------------------------------------------------------------------------ context managers
def test_nullcontext_is_captured_with_its_enter_result():
    def f(x):
        with contextlib.nullcontext(3) as k:
            y = x * k
        with contextlib.nullcontext():
            y = y + 1
        return y
    check(f, X, graphs=1, breaks=[])


def test_transformers_maybe_autocast_idiom_is_one_graph():
    """transformers' rotary embeddings: `with maybe_autocast(..., enabled=False)`, a
    `nullcontext()` where autocast is off."""
    def maybe_autocast(device_type, enabled=True):
        if torch.is_autocast_enabled(device_type) or enabled:
            return torch.autocast(device_type, enabled=enabled)
        return contextlib.nullcontext()

    def f(x):
        with maybe_autocast(device_type="cpu", enabled=False):
            freqs = (x @ x.T).float()
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
    check(f, X, graphs=1, breaks=[])


def test_user_context_manager_effects_once_per_call():
    def make(log):
        cm = Counting(log)

        def f(x):
            with cm as n:
                log.append("body")
                y = x * 2
            return y + len(log)
        return f
    run_both(make, X, calls=3)
    assert counts(make([]), X) == (1, [])


def test_exception_in_body_goes_to_exit_and_is_suppressed_or_raised():
    def make(log):
        cm = Counting(log, suppress=KeyError)

        def f(x):
            y = x + 1
            with cm:
                y = y * 2
                raise KeyError("swallowed")
            with cm:
                log.append(y.shape[0])
                raise ValueError("raised")
            return y
        return f
    run_both(make, X)


def test_exception_suppressed_keeps_graph_whole():
    def make(log):
        cm = Counting(log, suppress=(KeyError,))

        def f(x):
            y = x + 1
            with cm:
                y = y * 2
                {}["missing"]
            return y - 1
        return f
    run_both(make, X)
    assert counts(make([]), X) == (1, [])


def test_nested_items_enter_and_exit_in_order():
    def make(log):
        a, b = Counting(log), Counting(log)

        def f(x):
            with a as i, b as j:
                log.append("body")
                y = x * (i + j)
            return y
        return f
    run_both(make, X)


def test_break_inside_user_context_manager_runs_the_with_in_python():
    """A break in the body: the whole `with` runs in Python (a resume would enter the manager
    again), so its effects happen once; the code around it still runs in graphs."""
    def make(log):
        cm = Counting(log)

        def f(x):
            y = x + 1
            with cm as n:
                log.append("body")
                print("in body")
                y = y * n
            return y.sum()
        return f
    run_both(make, X, calls=3)
    assert counts(make([]), X) == (2, ["FL100"])


def test_break_in_exit_runs_the_with_in_python(capsys):
    class Printing(Counting):
        def __exit__(self, typ, exc, tb):
            print("exit")
            return super().__exit__(typ, exc, tb)

    def make(log):
        cm = Printing(log)

        def f(x):
            with cm:
                y = x * 2
            return y + 1
        return f
    run_both(make, X)
    assert counts(make([]), X)[1] == ["FL100"]


def test_context_manager_from_generator_runs_in_python():
    """`@contextlib.contextmanager`: its code after `yield` runs at exit, which the evaluator
    does not interpret (a generator runs to its end when called): the `with` runs in Python."""
    def make(log):
        @contextlib.contextmanager
        def scope():
            log.append("enter")
            try:
                yield 2
            finally:
                log.append("exit")

        def f(x):
            with scope() as k:
                log.append("body")
                y = x * k
            return y + 1
        return f
    run_both(make, X)
    assert counts(make([]), X) == (1, ["FL150"])


# ------------------------------------------------------------------------------ loops
def layerdrop(x, layers, p):
    """transformers' LayerDrop: a data-dependent `if` with `continue` in a loop over layers."""
    for w in layers:
        if torch.rand([]) < p:
            continue
        x = torch.tanh(x @ w)
    return x


W = [torch.randn(8, 8) * 0.3 for _ in range(3)]


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_data_dependent_continue_resumes_inside_the_loop(p):
    """Each iteration's `if` is a break (as under torch.compile); the rest of the iteration and
    the next ones continue in resumes: one graph per layer run."""
    _, ex = check(layerdrop, X, W, p, breaks=["FL120"] * 3)
    if p == 0.0:  # every layer runs: 3 graphs of (rand, layer) and a last one of (layer)
        assert len(ex.graphs) == 4
    if p == 1.0:  # no layer runs: the three draws
        assert len(ex.graphs) == 3


def test_loop_break_else_and_side_effects_after_a_resume():
    def make(log):
        def f(x):
            for i in range(5):
                x = x * 2
                if x.abs().sum() > 100:
                    log.append(("big", i))
                    break
                log.append(i)
                if i == 1:
                    continue
                x = x - 1
            else:
                log.append("no break")
                x = -x
            return x, i
        return f
    run_both(make, X)
    run_both(make, X * 0.001)  # no break: the loop's `else` runs


def test_value_read_mid_iteration_then_continue_and_break_in_while():
    def make(log):
        def f(x):
            i, acc = 0, x
            while i < 6:
                i += 1
                v = (acc * i).sum().item()
                log.append(round(v, 3))
                if v > 10:
                    continue
                if i == 4:
                    break
                acc = acc + v
            return acc, i
        return f
    for x in (torch.tensor([0.5, -0.2]), torch.tensor([3.5, 1.2])):
        run_both(make, x)
    g, codes = counts(make([]), torch.tensor([0.5, -0.2]))
    assert codes == ["FL110"] * 6 and g == 6  # one value read per iteration (6 iterations)
