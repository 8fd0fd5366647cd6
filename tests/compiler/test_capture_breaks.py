"""One test per graph-break type: the break's code, location and message, the graphs on either
side of it, and resume correctness (values after the break equal eager's)."""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import warnings
import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn

import fuselens
from fuselens.capture import breaks as B
from fl_capture_testing import check, line_of

torch.manual_seed(0)
X = torch.randn(4, 8)
Y = torch.randn(4, 8)
log = logging.getLogger("fuselens.tests.user")


def only_break(ex, code):
    assert [b.code for b in ex.graph_breaks] == [code], str(ex)
    return ex.graph_breaks[0]


# ------------------------------------------------------------------------------ print
def test_print_breaks_and_resumes(capsys):
    def f(x, y):
        a = x.sin() + y
        print("between graphs", a.shape)
        b = a.cos() * x
        return b + 1
    _, ex = check(f, X, Y, graphs=2, breaks=["FL100"])
    b = ex.graph_breaks[0]
    assert b.line == line_of(f, "print(") and b.col == 8
    assert b.end_line == b.line and b.end_col == b.col + len('print("between graphs", a.shape)')
    assert b.title == B.PRINT.title and b.torch_code == "GB0007" and b.hint
    assert b.filename == __file__ and b.stack == () and b.function.endswith("f")
    # print ran once per call, exactly as eagerly (check: eager, 2 compiled calls, eager and
    # compiled on other values, explain)
    assert capsys.readouterr().out.count("between graphs torch.Size([4, 8])") == 6


def test_print_of_tensor_value_computed_by_graph(capsys):
    def f(x):
        s = x.sum()
        print("sum is", s * 2)
        return s
    check(f, X, graphs=1, breaks=["FL100"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == out[1]  # eager and compiled printed the same thing


# ------------------------------------------------------------------------------ logging
def test_logging_call_breaks(caplog):
    def f(x):
        y = x * 2
        log.warning("y has %d elements", y.numel())
        return y + 1
    with caplog.at_level(logging.WARNING, logger=log.name):
        _, ex = check(f, X, graphs=2, breaks=["FL101"])
    # eager, two compiled calls, explain: four records, as four eager calls would log
    assert [r.getMessage() for r in caplog.records].count("y has 32 elements") == 6  # (+ eager and compiled on other values)
    assert ex.graph_breaks[0].line == line_of(f, "log.warning")


def test_warnings_warn_breaks():
    class MyWarning(UserWarning):
        pass

    def f(x):
        y = x * 2
        warnings.warn("careful", MyWarning)
        return y + 1
    with pytest.warns(MyWarning, match="careful"):
        _, ex = check(f, X, graphs=2, breaks=["FL101"])
    assert ex.graph_breaks[0].torch_code == "GB0291"


# ------------------------------------------------------------------------------ data reads
def test_item_breaks_and_value_flows_into_next_graph():
    def f(x):
        m = x.abs().max().item()
        y = x / m
        return y * 2, m
    _, ex = check(f, X, graphs=2, breaks=["FL110"])
    b = ex.graph_breaks[0]
    line = line_of(f, ".item()")
    assert (b.line, b.col) == (line, 12)
    assert "Tensor.item()" in b.explanation


def test_tolist_breaks():
    def f(x):
        vals = x[0].tolist()
        return x * vals[0] + len(vals)
    check(f, X, graphs=2, breaks=["FL111"])


def test_numpy_breaks():
    def f(x):
        a = (x + 1).numpy()
        # NumPy arithmetic is guarded by the array's type only, so it runs in Python (FL151)
        return torch.from_numpy(a * 2) + x
    check(f, X, breaks=["FL112", "FL151"])


@pytest.mark.parametrize("conv", ["int", "float", "bool"])
def test_tensor_to_python_scalar_breaks(conv):
    def f(x, conv):
        s = x.sum()
        v = {"int": int, "float": float, "bool": bool}[conv](s > 0 if conv == "bool" else s)
        return x * (2 if v else 3) + 1
    check(f, X, conv, breaks=["FL113"])


# ------------------------------------------------------------------------------ data-dependent if
def _branchy(x):
    y = x * 2
    if y.sum() > 0:
        z = y + 1
        w = z * 3
    else:
        z = y - 1
        w = z / 3
    return w + z


def test_data_dependent_if_both_branches():
    pos, neg = X.abs(), -X.abs()
    cf = fuselens.compile(_branchy)
    torch.testing.assert_close(cf(pos), _branchy(pos))
    torch.testing.assert_close(cf(neg), _branchy(neg))
    torch.testing.assert_close(cf(pos), _branchy(pos))
    funcs = [e.function for e in fuselens.inspect(cf)]
    assert any("then branch" in f for f in funcs) and any("else branch" in f for f in funcs), funcs
    assert len(funcs) == 3  # the function and one resume per branch: no recompiles
    for x in (pos, neg):
        ex = fuselens.explain(_branchy, x)
        b = only_break(ex, "FL120")
        assert b.line == line_of(_branchy, "if y.sum()") and b.torch_code == "GB0170"
        assert len(ex.graphs) == 2


def test_data_dependent_if_without_else_and_early_return():
    def f(x):
        if x.mean() > 0:
            return x * 10
        x = x + 1
        if (x > 100).any():
            x = x * 0
        return x
    cf = fuselens.compile(f)
    for x in (X.abs(), -X.abs(), -X.abs() + 200):
        torch.testing.assert_close(cf(x), f(x))


def test_data_dependent_ifexp_and_boolop():
    def f(x):
        y = x * 2 if x.sum() > 0 else x * 3
        if y.max() > 1 and y.min() < 0:
            y = y + 1
        return y
    cf = fuselens.compile(f)
    for x in (X, X.abs(), -X.abs()):
        torch.testing.assert_close(cf(x), f(x))


def test_data_dependent_if_inside_inlined_helper_both_branches():
    def clip(t):
        if t.max() > 1:
            t = t.clamp(max=1)
        return t * 2

    def f(x):
        return clip(x + 1) - 1
    cf = fuselens.compile(f)
    for x in (X, X * 0 - 5):
        torch.testing.assert_close(cf(x), f(x))


# ------------------------------------------------------------------------------ data-dependent while / assert
def test_data_dependent_while():
    def f(x):
        n = 0
        while x.abs().sum() < 1000:
            x = x * 2
            n += 1
        return x, n
    _, ex = check(f, X, breaks=["FL121"])
    assert ex.graph_breaks[0].line == line_of(f, "while")


def test_data_dependent_assert_passes_and_fails():
    def f(x):
        y = x.abs()
        assert (y >= 0).all(), "negative"
        return y + 1
    _, ex = check(f, X, graphs=2, breaks=["FL122"])
    assert ex.graph_breaks[0].line == line_of(f, "assert")

    def g(x):
        y = x - 100
        assert (y >= 0).all(), "negative"
        return y
    cg = fuselens.compile(g)
    with pytest.raises(AssertionError, match="negative"):
        cg(X)


# ------------------------------------------------------------------------------ data-dependent shapes
def test_nonzero_breaks():
    def f(x):
        idx = torch.nonzero(x > 0)
        return idx.shape[0] * x + 1, idx
    _, ex = check(f, X, breaks=["FL130"])
    assert "nonzero" in ex.graph_breaks[0].explanation


def test_boolean_mask_indexing_breaks():
    def f(x, y):
        z = x * y
        sel = z[z > 0]
        return sel.sum() + z.mean(), sel * 2
    _, ex = check(f, X, Y, breaks=["FL130"])
    assert "boolean-mask" in ex.graph_breaks[0].explanation


@pytest.mark.parametrize("which", ["masked_select", "unique", "repeat_interleave"])
def test_other_data_dependent_shape_ops(which):
    def f(x, which):
        y = x.round()
        if which == "masked_select":
            r = y.masked_select(y > 0)
        elif which == "unique":
            r = torch.unique(y)
        else:
            r = y.repeat_interleave(torch.tensor([1, 2, 0, 1]), dim=0)
        return r * 2 + 1
    check(f, X, which, breaks=["FL130"])


# ------------------------------------------------------------------------------ unknown calls
def test_call_without_source_breaks():
    def f(x):
        y = x + 1
        c = zlib.crc32(b"fuselens") % 7
        return y * c
    _, ex = check(f, X, graphs=2, breaks=["FL140"])
    assert "crc32" in ex.graph_breaks[0].explanation


def test_module_with_backward_hooks_breaks():
    """Forward hooks are evaluated (test_torch_api_surface.py); a backward hook is autograd's."""
    lin = nn.Linear(8, 8)
    lin.register_full_backward_hook(lambda m, gi, go: None)

    def f(x):
        return lin(x + 1) - 1
    check(f, X, breaks=["FL140"])


# ------------------------------------------------------------------------------ unsupported code
def test_try_with_a_break_inside_runs_in_python():
    """A `try` is captured (tests/compiler/test_model_idioms.py); one whose body breaks runs
    in Python as a whole, and the break is reported where it happens."""
    def f(x):
        y = x * 2
        try:
            z = y + 1
            print(z.shape)
        except RuntimeError:
            z = y
        return z * 3
    _, ex = check(f, X, graphs=2, breaks=["FL100"])
    assert ex.graph_breaks[0].line == line_of(f, "print(")


def test_unknown_context_manager_runs_in_python():
    """A context manager of C code (a lock): what it does is not known, so the `with` runs in
    Python (managers written in Python are interpreted: test_capture_python_blocks.py)."""
    import threading
    cm = threading.Lock()

    def f(x):
        y = x * 2
        with cm:
            y = y + 1
        return y * 3
    check(f, X, breaks=["FL150"])


def test_unsupported_tensor_attribute_is_a_break():
    def f(x):
        y = x * 2
        g = x.grad
        return y if g is None else y + g
    check(f, X, breaks=["FL151"])


def test_inplace_on_view_of_input_is_captured_and_written_back():
    def f(x):
        y = x * 2
        x[0].mul_(3)
        v = x.T
        v[1].add_(1)  # through a view of a view: the input and `v` both see it
        return y + x, v
    check(f, X, graphs=1, breaks=[])


def test_inplace_through_a_dtype_view_runs_in_python():
    def f(x):
        y = x * 2
        x.diagonal().mul_(3)  # by strides, in the graph
        a, b = y.split(2)
        a.add_(1)
        y.view(torch.int32).bitwise_and_(0x7FFFFFFF)
        return y + x
    _, ex = check(f, torch.randn(4, 4), breaks=["FL181"])
    assert ex.graph_breaks[0].line == line_of(f, "bitwise_and_")


def test_unsupported_op_in_meta_evaluation_is_a_break():
    def f(x):
        y = x * 2
        c = torch.cov(y)
        return c + 1
    _, ex = check(f, X, breaks=["FL180"])
    assert "cov" in ex.graph_breaks[0].explanation


# ------------------------------------------------------------------------------ inline depth
def _deep(x, n):
    if n == 0:
        return x + 1
    return _deep(x * 1.01, n - 1)


def test_recursion_past_inline_depth_breaks():
    def f(x):
        return _deep(x, 60) * 2  # past MAX_INLINE_DEPTH (40)
    check(f, X)
    ex = fuselens.explain(f, X)
    assert "FL170" in [b.code for b in ex.graph_breaks], str(ex)


# ------------------------------------------------------------------------------ breaks in helpers
def _helper_with_print(t):
    s = t.sin()
    print("in helper")
    return s.cos()


def test_break_inside_inlined_function_breaks_there_only():
    def f(x):
        a = x + 1
        b = _helper_with_print(a)
        return b * 2
    _, ex = check(f, X, graphs=2, breaks=["FL100"])  # torch.compile: 4 graphs
    b = ex.graph_breaks[0]
    assert b.line == line_of(_helper_with_print, 'print("in helper")')
    assert b.function.endswith("_helper_with_print")
    assert len(b.stack) == 1
    frame = b.stack[0]
    assert frame.line == line_of(f, "_helper_with_print(a)") and frame.function.endswith("f")
    assert frame.col == 12 and frame.filename == __file__
    # the first graph holds the caller's and the helper's code before the print
    assert ex.graphs[0].op_count == 2 and ex.graphs[1].op_count == 2
    report = str(ex)
    assert "called from" in report and "FL100" in report


def test_break_two_levels_deep_reports_call_stack():
    def middle(t):
        return _helper_with_print(t * 3) + 1

    def f(x):
        y = middle(x - 1)
        return y / 2
    _, ex = check(f, X, graphs=2, breaks=["FL100"])
    stack = ex.graph_breaks[0].stack
    assert [fr.function.split(".")[-1] for fr in stack] == ["f", "middle"]
    assert [fr.line for fr in stack] == [line_of(f, "middle(x - 1)"), line_of(middle, "_helper_with_print(")]


def test_break_in_helper_called_inside_expression_and_loop():
    def f(x):
        out = x
        for i in range(3):
            out = out + _helper_with_print(out) * i
        return [out, _helper_with_print(x) + out]
    check(f, X, breaks=["FL100"] * 4)


def _returns_from_try_finally(t):
    try:
        if t.dim() == 2:
            return t * 2
    finally:
        print("in helper")  # a break in a `finally`: the whole `try` runs in Python
    return t


def _returns_from_loop(t):
    for k in itertools.count():  # an iterator capture does not unroll: the loop runs in Python
        if k == 1:
            return t + k
    return t


@pytest.mark.parametrize("helper", [_returns_from_try_finally, _returns_from_loop])
def test_helper_returning_from_a_statement_run_in_python(helper):
    """A callee's `return` inside the statement that Python runs whole at a break ends the
    callee: the caller goes on with its value (it was once taken for the callee's live values)."""
    def f(x):
        return helper(x + 1).sin() + 1
    check(f, X, breaks=["FL100" if helper is _returns_from_try_finally else "FL160"])


def test_break_in_method_of_module():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            scale = h.abs().mean().item()
            return h / scale

    m = Noisy()
    cm = fuselens.compile(m)
    torch.testing.assert_close(cm(X), m.forward.__wrapped__(m, X) if hasattr(m.forward, "__wrapped__")
                               else type(m).forward(m, X))
    ex = fuselens.explain(m, X)
    assert [b.code for b in ex.graph_breaks] == ["FL110"] and len(ex.graphs) == 2


# ------------------------------------------------------------------------------ breaks in blocks
def test_break_inside_no_grad_block_resumes_inside_it():
    w = torch.randn(8, requires_grad=True)

    def f(x):
        with torch.no_grad():
            a = x * w
            print("in no_grad")
            b = a * w
        return a, b, x * w
    check(f, X, graphs=2, breaks=["FL100"])


def test_break_inside_autocast_block_resumes_inside_it():
    def f(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ y.T
            print("in autocast")
            b = a @ y
        return a, b
    check(f, X, Y, graphs=2, breaks=["FL100"])


def test_break_inside_unrolled_for_loop_resumes_rest_of_loop():
    def f(x):
        acc = x
        for i in range(4):
            acc = acc * 2 + i
            if i == 1:
                print("iteration", i)
            acc = acc - 1
        return acc
    check(f, X, graphs=2, breaks=["FL100"])


def test_item_in_every_loop_iteration():
    def f(x):
        total = 0.0
        for row in x:
            total += row.sum().item()
        return x * total
    check(f, X)


def test_break_inside_comprehension():
    def f(x):
        scales = [t.item() for t in x[0, :3]]
        return [x * s for s in scales]
    check(f, X, breaks=["FL110"])


def test_break_inside_comprehension_over_static_list():
    def f(x, ys):
        return [print(i) or y * i for i, y in enumerate(ys)], x
    check(f, X, [X, Y])


def _breaks_then_scales(i):
    d = dict.fromkeys(range(2))  # (a graph break, then more of the callee)
    return i + len(d)


COMPREHENSIONS_OVER_A_BREAKING_CALL = {
    "list": lambda x: torch.stack([x * _breaks_then_scales(i) for i in range(3)]).sin(),
    "generator": lambda x: sum(x * _breaks_then_scales(i) for i in range(3)).sin(),
    "dict": lambda x: torch.stack(list({i: x * _breaks_then_scales(i) for i in range(3)}.values())),
    "set": lambda x: x * sum({_breaks_then_scales(i) for i in range(3)}),
    "nested": lambda x: torch.stack([torch.stack([x * _breaks_then_scales(i) * j for j in range(2)])
                                     for i in range(2)]),
}


@pytest.mark.parametrize("kind", COMPREHENSIONS_OVER_A_BREAKING_CALL)
def test_a_comprehension_calling_a_function_that_breaks_runs_each_call(kind):
    """A break inside a call from a comprehension: the statement runs in Python (the callee
    compiled on its own). Resumed after the call, the rest of the comprehension had taken that
    one call's result for every element (Jamba's cache: every layer the first one's kind)."""
    def f(x):
        y = x.cos() + 1
        return COMPREHENSIONS_OVER_A_BREAKING_CALL[kind](y) * 2
    check(f, X)


def test_break_in_while_static_condition():
    def f(x):
        i = 0
        while i < 3:
            x = x + 1
            print(i)
            i += 1
        return x
    check(f, X)


def test_multiple_breaks_in_sequence():
    def f(x):
        a = x + 1
        print("one")
        b = a.sum().item()
        c = a * b
        print("two")
        if c.mean() > 0:
            c = c + 1
        return c, a
    _, ex = check(f, X, breaks=["FL100", "FL110", "FL100", "FL120"])
    lines = [b.line for b in ex.graph_breaks]
    assert lines == sorted(lines)


def test_variables_defined_before_break_are_live_after():
    def f(x, k: int = 3):
        a = x * k
        unused_after = x - 1
        name = "tag"
        pair = (a, k)
        print(name)
        return pair[0] + a * len(name) + unused_after * 0, {"k": k}
    check(f, X)


# ------------------------------------------------------------------------------ unrollable loops
class _Countdown:
    """An iterable of a Python class: its `__iter__` is evaluated (an object read by guards)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def test_loop_over_object_with_python_iter_is_unrolled():
    def f(x, it):
        for i in it:
            x = x * 2 + i
        return x
    check(f, X, _Countdown(3), graphs=1, breaks=[])
    cf = fuselens.compile(f)
    for n in (3, 4):  # `it.n` is guarded: another count is another unrolling
        torch.testing.assert_close(cf(X, _Countdown(n)), f(X, _Countdown(n)))


def test_loop_over_opaque_iterator_runs_in_python():
    def f(x, it):
        for i in it:
            x = x * 2 + i
        return x
    cf = fuselens.compile(f)  # a generator object has no source to evaluate
    torch.testing.assert_close(cf(X, (i for i in range(3))), f(X, (i for i in range(3))))
    ex = fuselens.explain(f, X, (i for i in range(3)))
    assert [b.code for b in ex.graph_breaks] == ["FL160"]
    assert ex.graph_breaks[0].line == line_of(f, "for i in")


def test_an_iterator_live_across_breaks_gives_each_item_once(capsys):
    """`iter(...)` capture made, live at a break: the resume gets one over the items not yet
    given, made each call (capture's own object, a constant, had been consumed by the resume's
    capture: later calls got the following item or StopIteration; LLaVA's `Signature.bind`).
    One from outside, a resume's too, is advanced by Python."""
    def f(x, y):
        it = iter((x, y, 3))
        print("break")
        a = next(it)
        print("break")
        return a * next(it) + next(it)
    check(f, X, X + 1, calls=3)


def test_loop_too_long_to_unroll_runs_in_python():
    def f(x):
        for i in range(600):
            x = x + 0.001
        return x * 2
    check(f, X, breaks=["FL160"])


def test_loop_whose_breaking_statement_is_a_jump_runs_in_python():
    """Python would run `if <value read>: break` outside any loop (the transformed function):
    the loop runs in Python. (A data-dependent `if` with a `break` resumes in each iteration:
    test_capture_python_blocks.py.)"""
    def f(x):
        for i in range(10):
            x = x * 2
            if x.abs().sum().item() > 500:
                break
        return x, i
    _, ex = check(f, X, breaks=["FL160"])
    assert "Tensor.item()" in ex.graph_breaks[0].explanation


def test_loop_with_continue_and_print_runs_in_python(capsys):
    def f(x):
        for i in range(4):
            if i == 2:
                continue
            print("step", i)
            x = x + i
        return x
    check(f, X)
    assert capsys.readouterr().out.count("step 3") == 5  # (+ eager and compiled on other values)


# ------------------------------------------------------------------------------ fullgraph
def test_fullgraph_raises_at_first_break():
    def f(x):
        y = x + 1
        v = y.sum().item()
        print(v)
        return y * v
    cf = fuselens.compile(f, fullgraph=True)
    with pytest.raises(fuselens.GraphBreakError) as info:
        cf(X)
    gb = info.value.graph_break
    assert gb.code == "FL110" and gb.line == line_of(f, ".item()")
    assert "FL110" in str(info.value) and "hint" in str(info.value)


def test_fullgraph_without_breaks_compiles():
    def f(x):
        return x.sin() * 2
    cf = fuselens.compile(f, fullgraph=True)
    torch.testing.assert_close(cf(X), f(X))


def test_fullgraph_break_in_helper():
    def f(x):
        return _helper_with_print(x)
    with pytest.raises(fuselens.GraphBreakError) as info:
        fuselens.compile(f, fullgraph=True)(X)
    assert info.value.graph_break.code == "FL100" and len(info.value.graph_break.stack) == 1


# ------------------------------------------------------------------------------ report
def test_explain_report_has_carets_and_doc_anchor():
    def f(x):
        y = x * 2
        s = y.sum().item()
        return y + s
    ex = fuselens.explain(f, X)
    text = str(ex)
    assert text.startswith("2 graph(s), 1 graph break(s)")
    lines = text.splitlines()
    i = next(k for k, l in enumerate(lines) if "s = y.sum().item()" in l)
    caret = lines[i + 1]
    src = lines[i]
    assert caret.strip() == "^" * len("y.sum().item()")
    assert caret.index("^") == src.index("y.sum()")
    b = ex.graph_breaks[0]
    assert b.doc_url.endswith("#fl110")
    g = ex.graphs[0]
    assert g.op_count == g.op_count and g.line_range() == str(line_of(f, "y = x * 2")) + "-" + \
        str(line_of(f, ".item()"))
    assert isinstance(g.gm, torch.fx.GraphModule) and g.graph is g.gm.graph
    assert ex.guards and all(gd.expr and gd.reason for gd in ex.guards)


def test_local_function_live_across_break():
    def f(x):
        g = lambda t: t * 2  # noqa: E731
        s = x.sum().item()
        return g(x) + s
    check(f, X, graphs=2, breaks=["FL110"])


def test_compiled_lambda():
    f = lambda x: x.sin() + 1  # noqa: E731
    check(f, X, graphs=1, breaks=[])


def test_compiled_lambda_with_break():
    f = lambda x: x * x.sum().item()  # noqa: E731
    check(f, X, breaks=["FL110"])


def test_data_dependent_condition_in_while_test_reevaluated_each_iteration():
    def f(x, y):
        c = 0
        while y.abs().sum() < 20 and c < 3:
            y = y * 2 + 0.1
            c += 1
        return y, c

    def g(x):
        while x.sum().item() < 10:
            x = x + 1
        return x
    cf, cg = fuselens.compile(f), fuselens.compile(g)
    for scale in (0.1, 1.0, 10.0):
        y = Y * scale
        assert_same_out = f(X, y)
        got = cf(X, y)
        torch.testing.assert_close(got[0], assert_same_out[0])
        assert got[1] == assert_same_out[1]
        torch.testing.assert_close(cg(X * scale), g(X * scale))


def test_comprehension_variable_is_not_live_after_a_loop_that_runs_in_python():
    def f(x, y):
        for _ in range(3):
            v = torch.stack([x * i for i in range(3)]).sum(0)
            if y.sum() > 0:
                break
        return v + sum(t for t in [x, y]) + torch.stack([y * i for i in range(2)]).sum(0)
    check(f, X, Y)
    check(f, X, -Y.abs())


def test_inplace_on_input_inside_loop_that_runs_in_python():
    def f(x, y):
        v = x * 0.5
        for _ in range(3):
            x.add_(v.relu())
            if y.sum() > x.sum():
                break
        return x * 2, v
    check(f, X, Y)
    check(f, X, Y + 100)


def test_inplace_after_break_on_non_leaf_that_requires_grad():
    lin = nn.Linear(8, 8)

    def f(x):
        h = torch.tanh(lin(x))
        s = h[0].tolist()[-1]
        h.mul_(2)  # h is an input of the resume, but not a leaf: allowed as in eager
        return h + s
    check(f, X)


def _scale_(a, k):
    a.mul_(k)
    return a


def _accumulate_until(a, b):
    v = a
    _ = a + b[b > 0].sum()  # a break (FL130) before the loop
    for _i in range(3):
        v.add_(b)
        if v.sum() > b.sum():  # the loop runs in Python (FL160)
            break
    return a + a


def test_loop_in_python_inside_helper_mutating_the_callers_tensor():
    def f(x, y):
        v = _scale_(y, 1.5)
        w = _accumulate_until(v, y)
        return v, y, w
    check(f, X, Y)


def test_inplace_on_an_input_aliasing_another_input_runs_in_python():
    # after the print, the resume receives `a` and its view `v` as two inputs sharing memory
    def f(x):
        a = x * 2
        v = a.T
        print("break")
        v[0].add_(1)
        return a * 1, v
    _, ex = check(f, X, breaks=["FL100", "FL181"])
    assert "shares memory" in ex.graph_breaks[1].detail


def test_data_dependent_if_inside_no_grad_and_autocast_blocks():
    w = torch.randn(8, requires_grad=True)

    def f(x):
        with torch.no_grad():
            if x.sum() > 0:
                y = x * w
            else:
                y = x * 2 * w
        return y, x * w  # after the block: grad mode is on again

    def g(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if x.sum() > 0:
                v = x @ y.T
            else:
                v = y @ x.T
        return v, x @ y.T  # after the block: float32 again
    for sign in (1, -1):
        check(f, X.abs() * sign)
        check(g, X.abs() * sign, Y)


COUNTER = 0


def test_raise_on_static_condition_not_taken_is_no_break_and_taken_raises():
    def f(x):
        if x.dim() != 2:
            raise ValueError("expected a matrix")
        return x * 2
    check(f, X, graphs=1, breaks=[])
    with pytest.raises(ValueError, match="expected a matrix"):
        fuselens.compile(f)(X[0])


@pytest.mark.parametrize("kind", ["del_item", pytest.param("class", marks=pytest.mark.xfail(
    strict=True, reason="a class defined in the function is a new object on every call and the "
    "resume is guarded on its identity: every call recompiles (then eager at the limit)")),
    "attr_assign"])
def test_other_unsupported_statements_run_in_python(kind):
    store = {"n": 0}
    box = [1, 2, 3]

    class Obj:
        pass
    obj = Obj()

    def f_global(x):
        global COUNTER
        COUNTER += 1
        return x * 2

    def f_nonlocal(x):
        n = 0

        def bump():
            nonlocal n
            n += 1
            return n
        return x * bump()

    def f_del_item(x):
        tmp = list(box)
        del tmp[0]
        return x * len(tmp)

    def f_class(x):
        class Local:
            k = 3
        return x * Local.k

    def f_attr_assign(x):
        y = x * 2
        obj.last = 5
        return y + obj.last
    f = locals()[f"f_{kind}"]
    check(f, X)


@pytest.mark.parametrize("kind", ["global", "nonlocal"])
def test_global_and_nonlocal_declarations_run_the_function_eagerly(kind):
    def f_global(x):
        global COUNTER
        COUNTER += 1
        return x * COUNTER

    def f_nonlocal(x):
        n = 0

        def bump():
            nonlocal n
            n += 1
            return n
        return x * bump() + bump()
    f = {"global": f_global, "nonlocal": f_nonlocal}[kind]
    before = COUNTER
    expected = [f(X) for _ in range(2)]
    cf = fuselens.compile(f)
    with pytest.warns(fuselens.FuselensWarning, match=kind):
        got = [cf(X) for _ in range(2)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b + (X * 2 if kind == "global" else 0))
    if kind == "global":
        assert COUNTER == before + 4  # every call incremented it, compiled ones too


def _layer_drop(compare, p, flipped):
    """HF's LayerDrop: skip a layer where a uniform draw is below `p` (compare(draw, p))."""
    def f(x):
        for _ in range(2):
            draw = torch.rand([])
            if (compare(p, draw) if flipped else compare(draw, p)):
                continue
            x = x.sin() * 2
        return x
    return f


@pytest.mark.parametrize("flipped", [False, True], ids=["draw_first", "number_first"])
@pytest.mark.parametrize("compare", [operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("p", [0.0, -0.5, 1.0, 3, 0.5])
def test_a_condition_the_draws_bounds_decide_is_no_break(compare, p, flipped):
    """`torch.rand` draws from [0, 1): against a number outside (0, 1) most comparisons are known
    without the data (capture/bounds.py); those that are not break, as any tensor condition."""
    # decided where the interval's two ends give the same answer: [0, 1) (1.0 itself is never drawn)
    ends = {compare(p, end) if flipped else compare(end, p) for end in (0.0, 1.0 - 2 ** -24)}
    decided = len(ends) == 1 and not 0 < p < 1
    f = _layer_drop(compare, p, flipped)
    if decided:
        check(f, torch.randn(4), graphs=1, breaks=[])
    else:  # (which branches run, and so the graphs, depends on the draws)
        check(f, torch.randn(4))
        assert fuselens.explain(f, torch.randn(4)).graph_breaks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_number_is_compared_with_a_draw_in_the_draws_dtype(dtype):
    """-1e-50 is -0.0 in these dtypes, and 0.0 can be drawn: `draw > -1e-50` is not known (eager
    compares in the tensor's dtype), while `draw > -1.0` is."""
    def undecided(x):
        if torch.rand([], dtype=dtype) > -1e-50:
            return x + 1
        return x - 1

    def decided(x):
        if torch.rand([], dtype=dtype) > -1.0:
            return x + 1
        return x - 1
    assert fuselens.explain(undecided, torch.randn(2)).graph_breaks
    check(decided, torch.randn(2), graphs=1, breaks=[])


def _operator_functions(x, y):
    total = functools.reduce(operator.add, [x, y, x * y])
    parts = [operator.mul(total, 2), operator.neg(y), operator.truediv(1.0, x.abs() + 1), operator.getitem(x, 0),
             operator.pow(y, 2), operator.lt(x, y).float(), operator.getitem(x, (slice(None), 1))]
    return functools.reduce(operator.add, [p.sum() for p in parts])


def test_operator_functions_on_tensors_are_the_syntax():
    """`operator.add(t, u)`, `reduce(operator.mul, ts)`: recorded as `t + u` is, not a break."""
    check(_operator_functions, torch.randn(3, 4), torch.randn(3, 4), graphs=1, breaks=[])


def _count_of(t, k):
    return (k, int(t.sum()))  # a break inside a call (a tensor read into Python)


def _collect(*values):
    return values


def breaks_in_several_arguments(x, y, k, d):
    return _collect(x * 2, _count_of(x, k), y * 3, _count_of(y, d), x + y)


def test_several_calls_of_one_statement_that_break_keep_each_result():
    """Each argument's call breaks: the statement continues in a resume function that reads the
    first call's result (`__fl_ret`) and the graph's temporaries (`__fl_t0`), and whose own second
    break must not take their names: it did, and every argument became the last call's result."""
    check(breaks_in_several_arguments, torch.ones(3), torch.full((3,), 2.0), 4, 5, breaks=["FL113", "FL113"])


def _calls_after_a_break(fn, *args, **kwargs):
    return print(end="") or fn(*args, **kwargs)  # (a break: Python runs the statement, calling `fn`)


def test_local_functions_that_python_code_receives_at_a_break():
    """A `def` or `lambda` of the captured code given to Python at a break (Mamba's combine
    function, passed to `associative_scan`; a closure passed down to a helper that breaks) is a
    real function made from its source, with its free variables and defaults: the whole function
    had run eagerly (CannotResume)."""
    def f(x, k):
        y = x.sin()
        s = 3.0

        def scaled(t, scale=s * 2, *, off=1.0):
            return t * scale + off + k + y

        twice = lambda t: scaled(t) * s  # noqa: E731
        a = _calls_after_a_break(twice, x)
        b = _calls_after_a_break(lambda t, q=s: t - q, a)
        return _calls_after_a_break(scaled, b, off=2.0).cos()
    check(f, X, 1.5)


def test_a_loop_that_breaks_in_every_iteration_resumes_a_few_times_then_runs_in_python():
    """BigBird's mask building breaks in each of its iterations: after a few resumes Python runs
    the rest of the loop (each resume had been one more capture and one more nested call: 60
    iterations took seconds, then Python's recursion limit, and the function ran eagerly)."""
    def collect(n):
        out = []
        for i in range(n):
            a = np.zeros(2)
            a[0] = i  # (a break: an item assignment on an array)
            out.append(int(a[0]))
        return out

    def f(x):
        for k in range(3):
            x = x * 0.5 + len(collect(300)) + sum(collect(k + 2))
        return x.sin()
    check(f, X)

    def nested(x):  # (loops in loops: each inner loop resumes, the chain is bounded too)
        for j in range(40):
            for k in range(3):
                x = x + len(collect(20)) * 0.001 + k
        return x
    check(nested, X, calls=1)


class _Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b


def test_signature_bind_and_slotted_objects_across_breaks(capsys):
    """`inspect.Signature.bind` (transformers' `select_hidden_states`: LLaVA) breaks inside its
    loop over the parameters, which then runs in Python: an iterator capture advanced in that
    statement goes back where it was (it had skipped `self`: TypeError, missing an argument); its
    BoundArguments keeps its state in slots, which a break's rebuild carries."""
    import inspect

    def method(self, x, layer=-1, strategy="default"):
        return x

    sig = inspect.signature(method)

    def f(x):
        bound = sig.bind(object(), x, layer=2)
        bound.apply_defaults()
        return x * bound.arguments["layer"]

    def slotted(x):
        o = _Slotted(x * 2, 3)
        print("break")
        return o.a * o.b
    check(f, X)
    check(slotted, X, breaks=["FL100"])
