"""A compiled function raises what eager raises, and leaves its inputs as eager leaves them when it
does, whatever graph breaks lie around the error: writes autograd refuses (a leaf that requires
grad and its views, an output of an operator that returns several views), a value saved for
backward written afterwards, an op whose result is unused but whose shapes stop matching once a
dim is dynamic, and inputs written before the function raises."""
from __future__ import annotations

import importlib.util
import itertools
import warnings

import pytest
import torch

import fuselens
from fl_capture_testing import check

# where a graph break lies around the statement under test
BREAKS = {"no break": ("", ""), "break after": ("", "if x.float().mean() < 0.1:\n        print('small')"),
          "break before": ("print('before')", "")}


def _function(tmp_path, name, args, body, ret="x * 2"):
    """`def f(args)` in a real file (capture reads source) running `body` (lines)."""
    path = tmp_path / f"{name}.py"
    lines = [ln for ln in body if ln]
    path.write_text("import torch\n\n\ndef f(" + args + "):\n" + "".join(f"    {ln}\n" for ln in lines) +
                    f"    return {ret}\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.f


def _outcome(fn, *args):
    """(the error eager's message names, or None) and the arguments after the call."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - compared with eager's
        return f"{type(e).__name__}: {str(e).splitlines()[0]}", args
    return None, args


def _same_outcome(fn, make_args):
    torch.manual_seed(0)
    want, eager_args = _outcome(fn, *make_args())
    torch.manual_seed(0)
    got, compiled_args = _outcome(fuselens.compile(fn), *make_args())
    assert got == want
    for a, b in zip(compiled_args, eager_args):
        torch.testing.assert_close(a.detach(), b.detach())
    return want


# -- writes autograd refuses --------------------------------------------------------------------
LEAF_WRITES = ["x[:, -1] = 3", "x[...] = 0", "x[x > 0] = 0", "x[1] = x[0] * 2", "x.add_(1)", "x[1:] += 1",
               "x.view(-1)[0] = 2", "x.t().sub_(1)", "x.clamp_(-2, 2)", "x.unsqueeze(0)[0, 1].zero_()"]


@pytest.mark.parametrize("where,write", list(itertools.product(BREAKS, LEAF_WRITES)))
def test_a_write_into_a_leaf_that_requires_grad_raises_as_eager(tmp_path, where, write):
    before, after = BREAKS[where]
    f = _function(tmp_path, f"leaf_{abs(hash((where, write)))}", "x", [before, write, after])
    error = _same_outcome(f, lambda: (torch.randn(4, 3, requires_grad=True),))
    assert "leaf Variable that requires grad" in error


@pytest.mark.parametrize("write", ["with torch.no_grad():\n        x[:, -1] = 3",  # an optimizer step
                                   "x.detach()[0] = 1", "x.data[1:] += 1"])
def test_a_write_autograd_does_not_record_into_a_leaf_equals_eager(tmp_path, write):
    f = _function(tmp_path, f"leaf_ok_{abs(hash(write))}", "x", [write, BREAKS["break after"][1]])
    check(f, torch.randn(4, 3, requires_grad=True))


MULTI_OUTPUT_VIEWS = ["t.chunk(2, dim=-1)[0]", "t.split(2, dim=-1)[1]", "t.unbind(0)[1]",
                      "t.split_with_sizes([1, 3], dim=0)[1]", "t.chunk(2)[0][1:]", "t.unbind(1)[0].view(2, 2)"]
MULTI_OUTPUT_WRITES = ["v /= 4", "v[0] = 1", "v.add_(y[0, 0])"]


@pytest.mark.parametrize("where,view,write", list(itertools.product(BREAKS, MULTI_OUTPUT_VIEWS,
                                                                MULTI_OUTPUT_WRITES)))
def test_a_write_into_one_of_several_views_an_op_returned_raises_as_eager(tmp_path, where, view, write):
    before, after = BREAKS[where]
    f = _function(tmp_path, f"multi_{abs(hash((where, view, write)))}", "y",
                  [before.replace("x", "y"), "t = y * 2", f"v = {view}", write, after.replace("x", "y")], "t")
    error = _same_outcome(f, lambda: (torch.randn(4, 4, requires_grad=True),))
    assert "view" in error and "inplace" in error


@pytest.mark.parametrize("body", [
    ["t = y * 2", "t.tensor_split(2)[0].mul_(2)"],  # views of one operator each
    ["t = y.detach() * 2", "t.chunk(2)[0].mul_(3)"],  # nothing requires grad
    ["t = y * 2", "with torch.no_grad():\n        t.chunk(2)[0].mul_(3)"],  # not recorded
])
def test_writes_into_views_of_a_split_eager_allows_equal_eager(tmp_path, body):
    f = _function(tmp_path, f"multi_ok_{abs(hash(tuple(body)))}", "y", body, "t")
    check(f, torch.randn(4, 4, requires_grad=True))


# -- a value saved for backward, written afterwards ----------------------------------------------
@pytest.mark.parametrize("write,raises", [
    ("s.add_(1)", True), ("s[0] = 1", True), ("s[1:].zero_()", True), ("s[torch.tensor([0, 2])] = 3.0", True),
    ("with torch.no_grad():\n        s.mul_(2)", True),  # a write under no_grad moves the version too
    ("u = x * 3\n    u[0] = 1", False),  # a value nothing saved
])
def test_a_value_saved_for_backward_and_written_later_fails_backward_as_eager(tmp_path, write, raises):
    """`s` is saved by `maximum`; its write is unused afterwards (the graph drops the op, not its
    effect on autograd's version counter)."""
    f = _function(tmp_path, f"saved_{abs(hash(write))}", "x, y",
                  ["acc = torch.zeros_like(y)", "for w in (x, y):\n        acc = acc + w", "s = torch.sign(x) * x",
                   "m = torch.maximum(acc, s)", write], "m")

    def backward(fn):
        torch.manual_seed(0)
        x = torch.randn(5, 3).requires_grad_()
        try:
            fn(x, torch.randn(5, 3)).sum().backward()
        except RuntimeError as e:
            return str(e).split(":")[0], None
        return None, x.grad

    (want, want_grad), (got, grad) = backward(f), backward(fuselens.compile(f))
    assert got == want
    assert (want is not None) == raises
    if not raises:
        torch.testing.assert_close(grad, want_grad)


# -- dead ops under dynamic dims, and writes before an error -------------------------------------
def _with_shapes(fn, shapes):
    """Calls `fn` with inputs of each of `shapes` (seeded): each call's outcome and inputs after."""
    out = []
    for i, shape in enumerate(shapes):
        torch.manual_seed(i)
        out.append(_outcome(fn, *[torch.randn(s) for s in shape]))
    return out


def _same_outcomes(f, shapes):
    cf = fuselens.compile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)  # the user's error: no fallback
        got = _with_shapes(cf, shapes)
    want = _with_shapes(f, shapes)
    for (g, g_args), (w, w_args) in zip(got, want):
        assert g == w
        for a, b in zip(g_args, w_args):
            torch.testing.assert_close(a, b)
    assert any(w is not None for w, _ in want) and any(w is None for w, _ in want)
    return cf


# x, y: (n, 4) and (m, 4); n and m change on the second call (dynamic dims), then disagree
ROWS = [((4, 4), (4, 4)), ((6, 4), (6, 4)), ((7, 4), (5, 4)), ((8, 4), (8, 4)), ((2, 4), (2, 4))]
DEAD_OPS = ["z = x + y", "z = torch.cat([x, y], dim=1)", "z = (x * 2).view(-1, 8)", "z = x.reshape(2, -1, 4)",
            "z = torch.where(y > 0, x, 0.0)", "z = x.t() @ y[:, :1].expand(-1, 4).t()"]


@pytest.mark.parametrize("dead", DEAD_OPS)
def test_an_unused_op_raises_at_sizes_where_eager_raises(tmp_path, dead):
    f = _function(tmp_path, f"dead_{abs(hash(dead))}", "x, y", [dead], "x * 2 + y.sum()")
    _same_outcomes(f, ROWS)


ERRORS = {"a shape check": "z = x + y",  # (n, 4) + (m, 4): raises where n != m
          "a raise statement": "if x.shape[0] != y.shape[0]:\n        raise ValueError('rows differ')",
          "an assert": "assert x.shape[0] == y.shape[0], 'rows differ'",
          "an index": "z = [0] * y.shape[0]\n    z[x.shape[0] - 1] = 1"}


@pytest.mark.parametrize("where,error", list(itertools.product(BREAKS, ERRORS)))
def test_inputs_written_before_an_error_are_as_eager_left_them(tmp_path, where, error):
    before, after = BREAKS[where]
    f = _function(tmp_path, f"err_{abs(hash((where, error)))}", "x, y",
                  [before, "x.add_(1)", "y[:, 0] = 7", "x.t()[1:].mul_(2)", after, ERRORS[error]], "x * 2")
    _same_outcomes(f, ROWS)
