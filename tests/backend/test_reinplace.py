"""Writes into a graph's inputs made in place (runtime/reinplace.py): a decode step's KV cache
written where eager writes it, with no copy of the cache and no copy back; equal to eager on
every call, and left functional where anything else reads the input or autograd records."""
import contextlib

import pytest
import torch

import fuselens
from fl_backend_testing import DEVICE
from fuselens import settings
from fuselens.runtime import compiled as runtime


def decode_step(k_cache, v_cache, pos, k, v, q):
    k_cache.index_copy_(2, pos, k)
    v_cache[:, :, pos] = v
    return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache)


def reads_the_old_cache(k_cache, v_cache, pos, k, v, q):
    before = k_cache * 1
    k_cache.index_copy_(2, pos, k)
    v_cache[:, :, pos] = v
    return before + k_cache


@pytest.fixture
def copies_back(monkeypatch):
    counted = []
    copy_into, foreach = runtime._copy_into, torch._foreach_copy_
    monkeypatch.setattr(runtime, "_copy_into", lambda t, v: counted.append(t) or copy_into(t, v))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda ts, vs: counted.extend(ts) or foreach(ts, vs))
    return counted


@pytest.mark.parametrize("fn, in_place", [(decode_step, True), (reads_the_old_cache, False)],
                         ids=["decode_step", "reads_the_old_cache"])
def test_cache_writes_in_place(fn, in_place, copies_back):
    compiled = fuselens.compile(fn)
    for step in range(3):
        caches = [torch.randn(1, 4, 16, 8, device=DEVICE) for _ in range(2)]
        eager_caches = [c.clone() for c in caches]
        pos = torch.tensor([step * 5], device=DEVICE)
        k, v, q = (torch.randn(1, 4, 1, 8, device=DEVICE) for _ in range(3))
        got, want = compiled(*caches, pos, k, v, q), fn(*eager_caches, pos, k, v, q)
        torch.testing.assert_close(got, want)
        assert all(torch.equal(c, e) for c, e in zip(caches, eager_caches))
    assert (copies_back == []) == in_place


def test_a_write_autograd_records_stays_functional(copies_back):
    x = torch.randn(4, 6, device=DEVICE)
    w = torch.randn(6, device=DEVICE, requires_grad=True)

    def f(x, w):
        x.index_copy_(0, torch.tensor([1], device=x.device), (w * 2)[None])
        return x.sum()
    xe = x.clone()
    compiled = fuselens.compile(f)
    got, want = compiled(x, w), f(xe, w)
    torch.testing.assert_close(got, want)
    assert torch.equal(x, xe) and copies_back


def wrapper_of(compiled):
    return fuselens.inspect(compiled)[0].graphs[0].wrapper


def test_decode_step_writes_are_one_kernel():
    """index_copy_ and `cache[:, :, pos] = v` into the caches: one kernel storing both at the
    positions `pos` holds (lower/rules.py `_scatter_`), no extern call writing them."""
    compiled = fuselens.compile(decode_step)
    caches = [torch.randn(1, 4, 16, 8, device=DEVICE) for _ in range(2)]
    compiled(*caches, torch.tensor([3], device=DEVICE), *(torch.randn(1, 4, 1, 8, device=DEVICE) for _ in range(3)))
    wrapper = wrapper_of(compiled)
    launches = [line for line in wrapper.splitlines() if ".launch(" in line]
    assert "consts[" not in wrapper and "setitem" not in wrapper and "index_copy" not in wrapper
    assert wrapper.count("# written in place") == 2
    assert len(launches) == 1 and "scatter" in launches[0]


def index_copy(x, pos, v):
    x.index_copy_(1, pos, v * 2 + 1)


def setitem(x, pos, v):
    x[:, pos] = v - 1


def setitem_int_then_tensor(x, pos, v):
    x[1, pos] = v[0] * 3


def setitem_ellipsis(x, pos, v):
    x[..., pos, :] = v.sin()


def setitem_number(x, pos, v):
    x[:, pos] = 7.0


def slices(x, pos, v):
    x[1:3, 2:8:2] = v[1:3, :1] * 5


def index_put(x, pos, v):
    x.index_put_((pos,), v.transpose(0, 1))


def index_fill(x, pos, v):
    x.index_fill_(1, pos, 5.0)


def index_put_0d_index(x, pos, v):
    x.index_put_((pos[0],), v[:, 0])


def index_copy_0d_index(x, pos, v):
    x.index_copy_(1, pos[-1], v[:, :1])


WRITES = {f.__name__: f for f in (index_copy, setitem, setitem_int_then_tensor, setitem_ellipsis, setitem_number,
                                  slices, index_put, index_fill, index_put_0d_index, index_copy_0d_index)}


def write_then_read(write):
    def fn(x, pos, v):
        write(x, pos, v)
        return x.sum(-1)
    return fn


@pytest.mark.parametrize("positions", [[5], [-2, 0], [3, 3]], ids=["one", "negative", "duplicate"])
@pytest.mark.parametrize("name", list(WRITES))
def test_writes_into_an_input_are_kernels_equal_to_eager(name, positions):
    """Each kind of write into an input, then a read of it: the write is a kernel (no extern call)
    and the input and result are eager's. A negative position counts from the end (index_copy_
    raises on it: not run); duplicates store one of their values (index_copy_ into x at [3, 3])."""
    write = WRITES[name]
    if name.startswith("index_copy") and positions[0] < 0:
        pytest.skip("index_copy_ refuses negative positions")
    if name == "slices" and positions != [5]:
        pytest.skip("writes at no positions")
    fn = write_then_read(write)
    compiled = fuselens.compile(fn)
    x = torch.randn(10, 10, 4, device=DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    v = torch.randn(10, len(positions), 4, device=DEVICE)
    if positions == [3, 3]:  # (the same value at both: eager's choice among them is not defined on a GPU)
        v = v[:, :1].expand_as(v).contiguous()
    xe = x.clone()
    got, want = compiled(x, pos, v), fn(xe, pos, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, xe, rtol=0, atol=1e-6)  # (C++ kernels' sin is SLEEF's: an ulp off eager's)
    wrapper = wrapper_of(compiled)
    assert "consts[" not in wrapper and wrapper.count("# written in place") == 1, wrapper


def test_an_index_out_of_range_writes_nothing():
    """A position out of the cache's range is not stored: nothing outside the cache is written (its
    neighbours in one allocation stay), nothing in it changes. Eager raises: so does the C++ kernel
    (the graph's eager run then raises eager's error), and the graph run as plain PyTorch; a Triton
    kernel raises nothing (eager's CUDA kernel device-asserts)."""
    def fn(x, pos, v):
        x.index_copy_(1, pos, v)
        return x * 1
    compiled = fuselens.compile(fn)
    memory = torch.zeros(3 * 10 * 4 + 80, device=DEVICE)
    x = memory[40:-40].view(3, 10, 4)
    x.copy_(torch.randn(3, 10, 4))
    before = memory.clone()
    compiled(x, torch.tensor([2], device=DEVICE), torch.randn(3, 1, 4, device=DEVICE))  # (compiled: in range)
    assert "consts[" not in wrapper_of(compiled)
    memory.copy_(before)
    triton_kernels_run = DEVICE == "cuda" or settings.CPU_BACKEND == "interpret"
    with contextlib.nullcontext() if triton_kernels_run else pytest.raises(IndexError, match="out of bounds"):
        out = compiled(x, torch.tensor([10], device=DEVICE), torch.randn(3, 1, 4, device=DEVICE))
        assert torch.equal(out, x)
    assert torch.equal(memory, before)


def test_an_int32_index():
    compiled = fuselens.compile(write_then_read(setitem))
    x = torch.randn(10, 10, 4, device=DEVICE)
    xe, pos, v = x.clone(), torch.tensor([4, 1], dtype=torch.int32, device=DEVICE), torch.randn(10, 2, 4, device=DEVICE)
    torch.testing.assert_close(compiled(x, pos, v), write_then_read(setitem)(xe, pos, v))
    assert torch.equal(x, xe) and "consts[" not in wrapper_of(compiled)


@pytest.mark.parametrize("make", [lambda: torch.full((1,), 7), lambda: torch.arange(7, 8)], ids=["full", "arange"])
def test_positions_made_in_the_graph(make):
    """Positions the graph computes (a constant: its range checks fold; an arange: index arithmetic)."""
    def fn(x, v):
        x.index_copy_(1, make().to(x.device), v * 2)
        return x.sum(-1)
    compiled = fuselens.compile(fn)
    x, v = torch.randn(3, 10, 4, device=DEVICE), torch.randn(3, 1, 4, device=DEVICE)
    xe = x.clone()
    torch.testing.assert_close(compiled(x, v), fn(xe, v))
    assert torch.equal(x, xe) and "consts[" not in wrapper_of(compiled)
