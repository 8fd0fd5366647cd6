"""Writes into a graph's inputs made in place (runtime/reinplace.py): a decode step's KV cache
written where eager writes it, with no copy of the cache and no copy back; equal to eager on
every call, and left functional where anything else reads the input or autograd records."""
import pytest
import torch

import fuselens
from fl_backend_testing import DEVICE
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
