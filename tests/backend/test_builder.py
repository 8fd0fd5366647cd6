"""ops/builder.py: a pointwise primitive's meta result, remembered by its operands' layouts."""
import torch

from fuselens.ops import builder as b


class _Forgetful(dict):
    def __setitem__(self, key, value):
        pass


def _layouts(monkeypatch, memo):
    """Layouts of pointwise results from a builder remembering into `memo`, each call made twice."""
    monkeypatch.setattr(b, "_POINTWISE_VALS", memo)

    def meta(shape, dtype=torch.float32, stride=None):
        return torch.empty_strided(shape, stride or torch.empty(shape).stride(), dtype=dtype, device="meta")
    g = b.GraphBuilder("cpu")
    out = []
    with g.building():
        x = g.placeholder("x", meta((2, 3, 4, 5)))
        xcl = g.placeholder("xcl", meta((2, 3, 4, 5), stride=(60, 1, 15, 3)))  # channels-last
        row, col = g.placeholder("row", meta((1, 5))), g.placeholder("col", meta((4, 1)))
        i = g.placeholder("i", meta((4, 5), torch.int64))
        h = g.placeholder("h", meta((2, 3, 4, 5), torch.bfloat16))
        calls = [(b.add, x, x), (b.add, xcl, xcl), (b.add, x, xcl), (b.add, xcl, x), (b.add, row, col),
                 (b.add, col, row), (b.mul, i, 2), (b.mul, i, 2.5), (b.mul, i, True), (b.div, i, 2),
                 (b.lt, x, xcl), (b.lt, xcl, 0.5), (b.where, b.lt(xcl, 0), x, xcl), (b.exp, h), (b.exp, x),
                 (b.cast, xcl, torch.float16), (b.add, h, x), (b.add, h, xcl)]
        for _ in range(2):
            out += [(tuple(v.shape), v.val.stride(), v.dtype) for fn, *args in calls for v in [fn(*args)]]
    return out


def test_remembered_pointwise_metas_are_torchs(monkeypatch):
    """Calls whose key was seen get the layout torch's meta kernel gives them: calls differing only
    in a stride, a dtype, a broadcast or a scalar's type keep their own."""
    memo = {}
    assert _layouts(monkeypatch, memo) == _layouts(monkeypatch, _Forgetful())
    assert 10 < len(memo) < 40  # each distinct call once (casts included), the second round all recalled


def test_a_result_that_is_an_operand_is_not_remembered_as_a_new_tensor(monkeypatch):
    """A convert to the operand's own dtype returns the operand itself: its storage offset and
    identity are kept, and the next such call is run again, not answered with a fresh tensor."""
    from fuselens.ops import primitives as prim
    monkeypatch.setattr(b, "_POINTWISE_VALS", {})
    g = b.GraphBuilder("cpu")
    with g.building():
        y = g.placeholder("y", torch.empty(10, device="meta")[5:])
        for _ in range(2):
            same = b.emit(prim.convert, y, dtype=torch.float32)
            assert same.val is y.val and same.val.storage_offset() == 5


def test_needs_grad_follows_the_inputs_that_require_it():
    """A value needs a gradient where it depends on an input that requires grad, not through a
    stop_gradient (a decomposition chooses its form by it: attention's math path)."""
    from fuselens.ops import primitives as prim
    g = b.GraphBuilder("cpu")
    with g.building():
        w = g.placeholder("w", torch.empty(4, device="meta"), requires_grad=True)
        x = g.placeholder("x", torch.empty(4, device="meta"))
        y, z = b.mul(x, 2.0), b.add(b.mul(x, 2.0), w)
        stopped = b.add(b.emit(prim.stop_gradient, z), x)
        assert not g.needs_grad(x, y) and g.needs_grad(z) and g.needs_grad(y, z)
        assert not g.needs_grad(stopped) and not g.needs_grad(3.0)
