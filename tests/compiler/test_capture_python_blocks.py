"""Blocks whose Python semantics capture keeps: context managers written in Python (their
`__enter__`/`__exit__` interpreted, exceptions passed to `__exit__`), and graph breaks inside
`with`, `for`/`while` bodies with `continue`/`break`, and `try` bodies (resumed inside the
block). Each compiled call equals eager's: values, the exception raised, and side effects made
once per call; graph and break counts are exact."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import fuselens
from fl_capture_testing import check

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))  # counts depend on values


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
    assert counts(make([]), X) == (1, [])


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
    run_both(make, X, calls=3)
    assert capsys.readouterr().out.count("exit") == 6  # once per call, eager's 3 and compiled 3
    assert counts(make([]), X) == (1, ["FL100"])


def make_scope(log, suppress=()):
    """A `@contextlib.contextmanager` with code before and after its `yield`, in a `try`."""
    @contextlib.contextmanager
    def scope(tag, scale):
        log.append(("enter", tag))
        try:
            v = yield scale * 2
            log.append(("sent", v))
        except suppress as e:
            log.append(("handled", type(e).__name__))
        finally:
            log.append(("exit", tag))
    return scope


def test_context_manager_generator_is_interpreted_around_the_body():
    def make(log):
        scope = make_scope(log)

        def f(x):
            with scope("a", 3) as k:
                log.append("body")
                y = x * k
            return y + 1
        return f
    run_both(make, X, calls=3)
    assert counts(make([]), X) == (1, [])


@pytest.mark.parametrize("suppress", [(), KeyError], ids=["raised", "handled"])
def test_exception_in_body_is_thrown_into_the_generator(suppress):
    def make(log):
        scope = make_scope(log, suppress)

        def f(x):
            y = x + 1
            with scope("b", 1):
                y = y * 2
                {}["missing"]
            return y
        return f
    run_both(make, X)


def test_context_manager_generator_with_a_break_in_the_body_runs_in_python():
    def make(log):
        scope = make_scope(log)

        def f(x):
            with scope("c", 2) as k:
                y = x * k
                log.append(y.sum().item() > 0)
            return y - 1
        return f
    run_both(make, X, calls=3)
    assert counts(make([]), X)[1] == ["FL110"]


def test_grad_mode_set_around_the_yield_holds_in_the_body():
    """`with torch.no_grad(): yield`: the body runs without grad, as in eager (the `with` runs
    in Python: the evaluator's grad-mode block ends where the generator is suspended)."""
    w = torch.randn(8, requires_grad=True)

    @contextlib.contextmanager
    def frozen():
        with torch.no_grad():
            yield

    def f(x):
        with frozen():
            y = x * w
        return y, x * w
    check(f, X)


def test_context_manager_generator_that_yields_twice_raises_as_in_eager():
    def make(log):
        @contextlib.contextmanager
        def twice():
            yield 1
            log.append("between")
            yield 2

        def f(x):
            with twice() as k:
                y = x * k
            return y
        return f
    run_both(make, X)


# ------------------------------------------------------------------------------ loops
def layerdrop(x, layers, p):
    """transformers' LayerDrop: a data-dependent `if` with `continue` in a loop over layers."""
    for w in layers:
        if torch.rand([]) < p:
            continue
        x = torch.tanh(x @ w)
    return x


W = [torch.randn(8, 8) * 0.3 for _ in range(3)]


@pytest.mark.parametrize("p", [1e-9, 0.5, 1 - 1e-6])
def test_data_dependent_continue_resumes_inside_the_loop(p):
    """Each iteration's `if` is a break (as under torch.compile); the rest of the iteration and
    the next ones continue in resumes: one graph per layer run."""
    _, ex = check(layerdrop, X, W, p, breaks=["FL120"] * 3)
    if p == 1e-9:  # every layer runs: 3 graphs of (rand, layer) and a last one of (layer)
        assert len(ex.graphs) == 4
    if p == 1 - 1e-6:  # no layer runs (a draw above p: one in a million): the three draws
        assert len(ex.graphs) == 3


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_layerdrop_the_draws_bounds_decide_is_one_graph(p):
    """`torch.rand([]) < 0.0` is False and `< 1.0` True for every draw (capture/bounds.py): no break."""
    check(layerdrop, X, W, p, graphs=1, breaks=[])


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
    # X: the sum passes 100 in the second iteration: one `if` per iteration run
    assert counts(make([]), X) == (2, ["FL120"] * 2)


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


# ------------------------------------------------------------------------------ try
def test_break_in_try_body_resumes_inside_the_try():
    """The rest of the body, `else` and `finally` continue in a graph after the break, and an
    exception raised there goes to the handler."""
    def make(log):
        def f(x):
            y = x + 1
            try:
                z = y * 2
                v = z.sum().item()
                log.append(v > 0)
                if v > 0:
                    raise KeyError("positive")
                z = z - v
            except KeyError as e:
                log.append(str(e))
                z = y * 3
            else:
                log.append("else")
            finally:
                log.append("finally")
                z = z + 1
            return z
        return f
    run_both(make, X)
    run_both(make, -X.abs())
    assert counts(make([]), -X.abs()) == (2, ["FL110"])


@pytest.mark.parametrize("handled", [True, False])
def test_exception_of_the_breaking_statement_goes_to_the_handlers(handled):
    """`.item()` of a tensor with several elements raises where Python runs it: the `try`
    around it decides, as in eager (its `finally` runs once)."""
    def make(log):
        def f(x):
            try:
                y = x * 2
                v = y.item()
                log.append("not reached")
            except (RuntimeError if handled else KeyError):
                log.append("handled")
                v = -1.0
            finally:
                log.append("finally")
            return y + v
        return f
    run_both(make, X)


def test_break_in_a_callee_inside_the_callers_try_finally():
    """transformers' output-capturing wrapper: `try: out = forward(...) finally: reset()`. The
    callee's break resumes inside the caller's `try` (no frame compiled twice: one break).
    What the breaking statement raises (`.item()` of 2 elements) passes through the wrapper's
    `finally` to the handler of the function compiled, as in eager."""
    def make(log):
        def forward(x, k, bad):
            h = torch.tanh(x)
            n = h[0, :k].item()
            if bad:
                raise ValueError(f"bad {n > 0}")
            return h * n

        def wrapper(x, k, bad):
            log.append("set")
            try:
                out = forward(x, k, bad)
            finally:
                log.append("reset")
            return out + 1

        def f(x, k=1, bad=False):
            try:
                return wrapper(x * 2, k, bad) - 1
            except RuntimeError as e:
                log.append(type(e).__name__)
                return x
        return f
    run_both(make, X)
    run_both(make, X, 1, True)
    run_both(make, X, 2)
    assert counts(make([]), X) == (2, ["FL110"])


def test_exception_after_the_break_in_a_callee_reaches_the_callers_handler():
    def make(log):
        def forward(x):
            n = x.sum().item()
            log.append("after break")
            return {}[n > 0]  # KeyError, raised in the resumed code

        def f(x):
            try:
                out = forward(x)
            except KeyError as e:
                log.append(("caught", e.args))
                out = x * 0
            return out
        return f
    run_both(make, X)


def test_break_in_a_handler_runs_the_try_in_python():
    def make(log):
        def f(x):
            try:
                y = {}["missing"]
            except KeyError:
                log.append(x.sum().item() > 0)
                y = x * 2
            finally:
                log.append("finally")
            return y + 1
        return f
    run_both(make, X)
    assert counts(make([]), X)[1] == ["FL110"]


def test_return_of_a_breaking_expression_inside_try_finally():
    """`return v.item()` in a `try`: the `finally` runs before the function returns (the
    statement runs in Python with its `try`)."""
    def make(log):
        def f(x):
            try:
                y = x * 2
                return y.sum().item()
            finally:
                log.append("finally")
        return f
    run_both(make, X, calls=3)


def test_try_inside_a_loop_with_continue():
    def make(log):
        def f(x):
            for i in range(4):
                try:
                    x = x * 2
                    if x.sum() > 0:
                        continue
                    log.append(i)
                finally:
                    log.append(("finally", i))
                x = x - 1
            return x
        return f
    run_both(make, X)
    run_both(make, -X.abs())
    assert counts(make([]), -X.abs())[1] == ["FL120"] * 4  # one `if` per iteration


@pytest.mark.parametrize("k", [1, 2, 3])
def test_break_in_a_callees_own_try(k):
    """The callee's `try` around its break resumes inside it too: the break helper hands what
    the breaking statement raises (`.item()` of k > 1 elements) back to the callee's handlers,
    whose code (a `return` from the handler, the `finally`, a re-raise) then continues, and so
    do the caller's blocks."""
    def make(log):
        def layer(h, k):
            try:
                h = torch.tanh(h)
                n = h[0, :k].item()
                log.append("read")
                h = h * n
            except RuntimeError:
                log.append("handled")
                if k == 3:
                    raise
                return h - 1
            finally:
                log.append("layer finally")
            return h + 1

        def f(x, k):
            try:
                y = layer(x * 2, k)
            except RuntimeError:
                log.append("caller handled")
                y = x
            return y.sum(0)
        return f
    run_both(make, X, k)
    if k == 1:
        assert counts(make([]), X, k) == (2, ["FL110"])


_FINALLY_LOG: list = []
_SINK = io.StringIO()


def _finally_breaks_after_a_resumed_try(x, y):
    try:
        x = x * 2
        _FINALLY_LOG.append("body")  # (an effect capture replays: no break)
        if x.sum() > y.sum():  # data-dependent: a break inside the try body, resumed in
            raise ValueError("data")
    except ValueError:
        x = x + 1
    finally:
        print("finally", file=_SINK)  # a break in the finally of the resumed try
    return x


def test_a_break_in_finally_after_a_try_body_resumed_in():
    for x, y in [(torch.ones(3), torch.zeros(3)), (torch.zeros(3), torch.ones(3))]:
        check(_finally_breaks_after_a_resumed_try, x, y)


def _else_breaks_in_a_loop(x, y):
    for t in [x, y]:
        try:
            x = x * 2
        except ValueError:
            v = x + 1  # (never runs: `v` stays unbound, and nothing reads it)
        else:
            _SINK.write("else\n")  # a break in `else`: the whole `try` runs in Python
        w = x * 3 + t
    return w


def _else_breaks_in_a_callee(x, t):
    try:
        x = x * 2
    except ValueError:
        v = x + 1
    else:
        _SINK.write("else\n")
    w = x * 3 + t
    if w.sum() > 1000:
        return v
    return w


def _calls_a_callee_whose_try_runs_in_python(x, y):
    return _else_breaks_in_a_callee(x, y) + 1


def _reads_a_name_a_try_left_unbound(x, y):
    k = 0
    for t in [x, y]:
        if k:
            return v  # eager: UnboundLocalError (the handler never ran)
        try:
            x = x * 2
            if t.sum() > 100:
                raise ValueError
        except ValueError:
            v = x + 1
        else:
            _SINK.write("else\n")
        k += 1
    return x


@pytest.mark.parametrize("fn", [_else_breaks_in_a_loop, _calls_a_callee_whose_try_runs_in_python])
def test_a_name_a_try_run_in_python_leaves_unbound(fn):
    """Names assigned only in a handler that did not run stay unbound after the break: passing
    them on to the code after it raises nothing..."""
    check(fn, torch.ones(2), torch.ones(2))


def test_reading_a_name_a_try_left_unbound_raises_eagers_error():
    """...and reading them there raises eager's UnboundLocalError; when the handler ran, the
    name has its value."""
    cf = fuselens.compile(_reads_a_name_a_try_left_unbound)
    with pytest.raises(UnboundLocalError, match="'v'"):
        _reads_a_name_a_try_left_unbound(torch.ones(2), torch.ones(2))
    with pytest.raises(UnboundLocalError, match="'v'"):
        cf(torch.ones(2), torch.ones(2))
    check(_reads_a_name_a_try_left_unbound, torch.full((2,), 100.0), torch.ones(2))


def _deletes_a_bound_name_in_a_try_run_in_python(x, flag):
    z = x + 1
    try:
        del z
    finally:
        print("finally", file=_SINK)  # a break in finally: the whole `try` runs in Python
    x = x * 2
    if flag:
        return (z,)  # eager: UnboundLocalError (deleted above)
    return (x,)


def _deletes_a_name_only_some_paths_bind(x, flag):
    if flag:
        w = x + 1
    x = x * 2
    del w  # eager: UnboundLocalError where `flag` is false
    return x


def _shadows_locals(x, flag):
    locals = 2  # noqa: F841 (generated code must not call this one)
    try:
        if flag:
            raise ValueError
        z = x + 1
    except ValueError:
        pass
    finally:
        print("finally", file=_SINK)
    if not flag:
        x = x + z  # `z`, maybe unbound after the `try`, reaches the code after it
    return x * locals


@pytest.mark.parametrize("fn,flag,raises", [
    (_deletes_a_bound_name_in_a_try_run_in_python, False, None),
    (_deletes_a_bound_name_in_a_try_run_in_python, True, UnboundLocalError),
    (_deletes_a_name_only_some_paths_bind, True, None),
    (_deletes_a_name_only_some_paths_bind, False, UnboundLocalError),
    (_shadows_locals, True, None), (_shadows_locals, False, None)])
def test_deleted_and_unbound_names_behave_as_in_eager(fn, flag, raises):
    """A name a statement run in Python deletes is unbound after it; `del` of an unbound name
    raises; the generated code's own `locals()` is not the user's `locals`."""
    if raises is None:
        check(fn, torch.ones(2), flag)
        return
    with pytest.raises(raises):
        fn(torch.ones(2), flag)
    with pytest.raises(raises):
        fuselens.compile(fn)(torch.ones(2), flag)


def _closure_breaks_then_reads_the_enclosing_flag(x, flag):
    def inner(y):
        print("inner", file=_SINK)  # a break inside the local function
        return y * 2 if flag else y
    return inner(x) + 1


def _closure_breaks_then_reads_an_enclosing_tensor(x, flag):
    scale = x.sum() if flag else x.mean()

    def inner(y):
        z = y * 3
        print("inner", file=_SINK)
        return z * scale
    return inner(x * 2)


@pytest.mark.parametrize("fn", [_closure_breaks_then_reads_the_enclosing_flag,
                                _closure_breaks_then_reads_an_enclosing_tensor])
@pytest.mark.parametrize("flag", [True, False])
def test_a_break_in_a_local_function_that_reads_its_enclosing_scope(fn, flag):
    """After a break inside a local function, its code reads the enclosing function's variables
    (they raised NameError: the generated continuation had no closure)."""
    check(fn, torch.ones(3), flag)
