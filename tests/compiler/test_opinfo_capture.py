"""Classes of bugs the OpInfo full matrix (tests/conformance, FUSELENS_OPINFO=full) found, each
as a test of its class: compiled results equal eager's, errors included."""
from __future__ import annotations

import pytest
import torch

from fl_capture_testing import check

# a lambda that torch's own testing code defines (OpInfo's `op=lambda ...` of multinomial):
# its module is torch's, but no graph can name it, so it is Python to inline
_TORCH_LAMBDA = lambda x: torch.sin(x) * 2  # noqa: E731
_TORCH_LAMBDA.__module__ = "torch.testing._internal.common_methods_invocations"


def _calls_torch_lambda(x):
    return _TORCH_LAMBDA(x) + 1


def test_unnamed_python_function_of_torch_is_inlined():
    check(_calls_torch_lambda, torch.randn(5), graphs=1, breaks=[])


# out= of another dtype than the op computes: eager casts into it, or refuses (an exact dtype
# for torch.complex and multinomial); meta kernels do not check it
def _complex_out(a, b, out):
    return torch.complex(a, b, out=out) * 1


def _multinomial_out(p, out):
    return torch.multinomial(p, 2, out=out)


def _add_out(a, b, out):
    return torch.add(a, b, out=out) + 1


def _raises_as_eager(fn, *args):
    try:
        fn(*[a.clone() for a in args])
    except RuntimeError as e:
        expected = str(e)
    else:
        pytest.fail("eager does not raise")
    import fuselens
    with pytest.raises(RuntimeError) as got:
        fuselens.compile(fn)(*[a.clone() for a in args])
    assert str(got.value) == expected


@pytest.mark.parametrize("fn, args", [
    (_complex_out, (torch.randn(3), torch.randn(3), torch.zeros(3, dtype=torch.complex128))),
    (_multinomial_out, (torch.rand(4), torch.zeros(2, dtype=torch.float64))),
    (_add_out, (torch.randn(3), torch.randn(3), torch.zeros(3, dtype=torch.int64))),
], ids=["complex exact dtype", "multinomial long", "add cannot cast"])
def test_out_of_a_dtype_eager_refuses_raises_its_error(fn, args):
    _raises_as_eager(fn, *args)


def test_out_of_a_dtype_eager_casts_into():
    check(_add_out, torch.randn(3), torch.randn(3), torch.zeros(3, dtype=torch.float64), graphs=1, breaks=[])


# a tensor of another layout than strided (sparse): a graph input whose every op runs in Python
# (FL180), never an internal error; its layout is guarded
def _sparse_mm(a, b):
    return torch.sparse.mm(a, b) * 2 + b.sum()


@pytest.mark.parametrize("layout", ["csr", "csc", "coo"])
def test_non_strided_input_breaks_where_used(layout):
    dense = torch.tensor([[0., 1., 0., 2.], [3., 0., 0., 0.], [0., 0., 4., 5.]])
    a = getattr(dense, f"to_sparse_{layout}")() if layout != "coo" else dense.to_sparse()
    cf, ex = check(_sparse_mm, a, torch.randn(4, 2), breaks=["FL180"])
    torch.testing.assert_close(cf(dense, torch.ones(4, 2)), _sparse_mm(dense, torch.ones(4, 2)))


# a named tuple argument: its type is guarded by identity (a guard naming the bare class name
# failed on every call, so every call recompiled)
Scale = __import__("collections").namedtuple("Scale", "factor shift")


def _scaled(x, s):
    return x * s.factor + s.shift


def test_named_tuple_argument_hits_the_cache():
    check(_scaled, torch.randn(4), Scale(2.0, 1), graphs=1, breaks=[])


def _filters_shapes(x):
    return x.reshape(torch.broadcast_shapes((1, 3), (2, 1)))


def test_map_and_filter_of_a_local_function():
    check(_filters_shapes, torch.randn(6))  # an internal error (eager fallback) fails it


def _sort_into(x, out):
    torch.sort(x, out=out)
    return out[0] * 2


def test_out_into_a_structseq_argument():
    check(_sort_into, torch.randn(5), torch.return_types.sort([torch.empty(5), torch.empty(5, dtype=torch.long)]),
          graphs=1, breaks=[])


# A write autograd does not record (under no_grad, into a detached alias) changes a tensor's
# values and leaves its history as it was: its gradient reaches its inputs through every
# element, those written included; its views taken before see the values and keep the path.
def _no_grad_setitem_and_view(x, y):
    with torch.no_grad():
        y[0] = 2.0  # 1e8 there: a `y + (new - y).detach()` loses the 2 in float32
        x.unsqueeze(0).tanh_()
    return y * 3, x


def _no_grad_out(x, y):
    with torch.no_grad():
        torch.mul(x, 2, out=y)
    return y * y, x


def _no_grad_copy(x, y):
    with torch.no_grad():
        y.copy_(x.exp())
    return y.sin(), x


def _no_grad_index_put(x, y):
    with torch.no_grad():
        y.index_put_((torch.tensor([1, 0]),), x[0] * 10)
    return y * x, x


def _no_grad_masked_fill(x, y):
    with torch.no_grad():
        y.masked_fill_(y > 3, float("inf"))
    return y.tanh(), x


def _no_grad_slices(x, y):
    with torch.no_grad():
        y[:, 1:].mul_(x[:, :1])
        x[1:, ::2] += 5
    return y * x, x


def _no_grad_views_of_views(x, y):
    with torch.no_grad():
        y.t()[0].add_(1)
        x.view(4)[1:3].zero_()
        y.narrow(1, 1, 1).diagonal().fill_(-3)
    return y.cos(), x * 2


def _no_grad_view_taken_before(x, y):
    v, w = y[1], x.t()
    with torch.no_grad():
        y.mul_(4)
        x[0, 1] = 7.0
    return v * v, w.exp()


def _no_grad_view_written_inside(x, y):
    with torch.no_grad():
        v = y[0]
        v.fill_(1.5)
        w = x.detach()[1]
    w.mul_(3)  # a view of a detached alias: no path into x
    return y * 2, x * w.sum()


def _written_through_detach(x, y):
    y.detach()[0] = 9.0
    x.data.mul_(2)
    return y * y, x + 1


# a view taken under no_grad of a tensor that requires grad, written in place in grad mode
# (itself, a view of it, after its base changed) or read there after a write: eager refuses,
# and so does the compiled call
def _no_grad_view_written(y):
    with torch.no_grad():
        v = y[0]
    v.fill_(1.5)
    return y * 2


def _view_of_a_no_grad_view_written(y):
    with torch.no_grad():
        v = y.unsqueeze(0)
    v[0, 1:].fill_(1.5)
    return y * 2


def _no_grad_view_written_after_its_base(y):
    with torch.no_grad():
        v = y[0]
    y.mul_(2)
    v.add_(1)
    return y * 2


def _detached_no_grad_view_written(y):  # a detach: no view autograd tracks, eager allows it
    with torch.no_grad():
        v, w = y[0], y.detach()[1]
    v.detach().fill_(1.5)
    w.mul_(3)
    return y * 2


def _no_grad_view_read_after_a_write(y):
    with torch.no_grad():
        v = y[0]
        v.fill_(1.5)
    return y * v.sum()


def _no_grad_view_read_before_a_write(y):
    with torch.no_grad():
        v = y[0]
    s = v.sum()
    with torch.no_grad():
        y.mul_(2)
    return y * s


@pytest.mark.parametrize("fn", [_no_grad_view_written, _view_of_a_no_grad_view_written,
                                _no_grad_view_written_after_its_base, _detached_no_grad_view_written,
                                _no_grad_view_read_after_a_write, _no_grad_view_read_before_a_write],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_view_taken_under_no_grad_written_in_grad_mode_as_eager(fn):
    import fuselens
    y0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    outcomes = []
    for f in (fn, fuselens.compile(fn)):
        try:
            outcomes.append(f(y0 * 1).detach())
        except RuntimeError as e:
            outcomes.append(str(e))
    if isinstance(outcomes[0], str):
        assert outcomes[1] == outcomes[0]
    else:
        torch.testing.assert_close(outcomes[1], outcomes[0])


def _no_grad_view_used(y):
    with torch.no_grad():
        v = y[0]
    return v * 2, y * 3


def _no_grad_views_returned(y):
    with torch.no_grad():
        t, flat = y.t(), y.view(-1)
        row = t[1]
    return t, flat[1:], row, row * 2


def _no_grad_view_times_its_base(y):
    with torch.no_grad():
        v = y[1]
    return v * y, v.sum()


def _no_grad_result_not_a_view(y):
    with torch.no_grad():
        v = y * 2
    return v + 1, v[0]


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non_leaf"])
@pytest.mark.parametrize("fn", [_no_grad_view_used, _no_grad_views_returned, _no_grad_view_times_its_base,
                                _no_grad_result_not_a_view], ids=lambda f: f.__name__.strip("_"))
def test_a_view_taken_under_no_grad_requires_grad_as_eager(fn, leaf):
    # a view of a tensor that requires grad, taken under no_grad, still requires grad (a leaf
    # whose gradient reaches nothing): what it computes has a grad_fn and a backward that runs
    import fuselens

    def run(f):
        y0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        y = y0 if leaf else y0 * 1
        outs = f(y)
        loss = sum(o.sum() for o in outs if o.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        return [(o.detach(), o.requires_grad, o.is_leaf, o.grad_fn is None,
                 o.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()) for o in outs], y0.grad

    got, want = run(fuselens.compile(fn)), run(fn)
    for g, w in zip(got[0], want[0]):
        torch.testing.assert_close(g[0], w[0])
        assert g[1:] == w[1:]
    torch.testing.assert_close(got[1], want[1])


def _under_no_grad_of_a_value_needing_grad(x, y):
    with torch.no_grad():
        y[1] = x[1] * 3
    return y * y, x


@pytest.mark.parametrize("fn", [
    _no_grad_setitem_and_view, _no_grad_out, _no_grad_copy, _no_grad_index_put, _no_grad_masked_fill,
    _no_grad_slices, _no_grad_views_of_views, _no_grad_view_taken_before, _no_grad_view_written_inside,
    _written_through_detach, _under_no_grad_of_a_value_needing_grad,
], ids=lambda f: f.__name__.strip("_"))
def test_writes_autograd_does_not_record_keep_autograd_history(fn):
    def grads(fn):
        x0 = torch.tensor([[1.0, 2.0], [3.0, -1.0]], requires_grad=True)
        y0 = torch.tensor([[1.0, 1e8], [4.0, 5.0]], requires_grad=True)
        a, b = fn(x0 * 1, y0 * 1)
        (a.sum() + b.sum()).backward()
        return a.detach(), b.detach(), a.requires_grad, b.requires_grad, x0.grad, y0.grad
    import fuselens
    for got, want in zip(grads(fuselens.compile(fn)), grads(fn)):
        torch.testing.assert_close(got, want, equal_nan=True)


# a torch function given a function as an argument: a graph's code names tensors and constants
# only, so the call runs in Python (FL180) instead of an internal error generating that code
def _seeded_dropout(x):
    from torch.testing._utils import wrapper_set_seed
    return wrapper_set_seed(torch.nn.functional.dropout, x * 2, p=0.0) + 1


def test_function_argument_of_a_torch_function_breaks():
    check(_seeded_dropout, torch.randn(5), breaks=["FL180"])


# Tensor.to with bools among its positional arguments (non_blocking, copy)
def _to_positional(x):
    return x.to("cpu", torch.float64, False, True) + 1, x.to(torch.int32, True)


def test_tensor_to_with_positional_bools():
    check(_to_positional, torch.randn(4) * 10, graphs=1, breaks=[])
