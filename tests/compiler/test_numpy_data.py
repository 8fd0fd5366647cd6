"""NumPy's arrays and random state are data of the process, not constants of a capture: an
array from outside is guarded by its type alone, so what is read of it (an item, its length,
its truth, its items) is read in Python on every call; and a compiled method bound to an
object (`np.random.permutation` on NumPy's global RandomState, a Cython method) is a call into
C code on that object's state, a break that runs each call, never a value folded once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fuselens

READS = {
    "item": lambda a, x: x + float(a[1]),
    "item in a loop": lambda a, x: x + sum(float(a[i]) for i in range(3) if a[i] != 0),
    "len": lambda a, x: x + len(a),
    "truth": lambda a, x: x + (1.0 if a[:1] else 2.0),
    "items": lambda a, x: x + sum(float(v) for v in a),
    "comparison": lambda a, x: x + (a[0] > a[2]),
}


@pytest.mark.parametrize("read", list(READS))
def test_what_is_read_of_an_array_is_read_on_every_call(read):
    f = READS[read]
    cf = fuselens.compile(f)
    x = torch.zeros(2)
    for a in (np.array([3, 1, 2]), np.array([0, 5, 7]), np.array([4, 0, 1, 9])):
        torch.testing.assert_close(cf(a, x), f(a, x), rtol=0, atol=0)


def _pick(block, n):
    """BigBird's `_get_single_block_row_attention`, reduced: a random row, then Python on it."""
    perm = np.random.permutation(n)
    chosen = []
    for i in range(n):
        if perm[i] != block:
            chosen.append(perm[i])
        if len(chosen) == 2:
            break
    return np.array(chosen, dtype=np.int64)


def _blocks(x, heads=3, rows=6):
    np.random.seed(0)
    out = [np.zeros((rows, 2), dtype=np.int64) for _ in range(heads)]
    for row in range(rows):
        for h in range(heads):
            out[h][row] = _pick(row, 12)
    return x + torch.tensor(np.stack(out))


@pytest.mark.parametrize("f", [_pick, _blocks], ids=["one row per call", "rows drawn in a loop"])
def test_random_draws_are_eagers_on_every_call(f):
    cf = fuselens.compile(f)
    args = [(1, 12), (1, 12), (2, 12)] if f is _pick else [(torch.zeros(1),)] * 2
    np.random.seed(3)
    want = [f(*a) for a in args]
    np.random.seed(3)
    got = [cf(*a) for a in args]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_compiled_method_on_a_random_state_runs_each_call():
    rng = np.random.RandomState(0)
    same = np.random.RandomState(0)

    def f(x):
        return x + torch.from_numpy(rng.permutation(5)) + int(rng.randint(0, 100))
    cf = fuselens.compile(f)
    for _ in range(3):
        x = torch.zeros(5, dtype=torch.int64)
        want = x + torch.from_numpy(same.permutation(5)) + int(same.randint(0, 100))
        torch.testing.assert_close(cf(x), want, rtol=0, atol=0)


def test_a_tensor_sharing_an_arrays_memory_is_made_in_python():
    """`torch.from_numpy(a)` shares a's memory (a write to either is seen by the other): Python
    makes it, a clear break (it had been an FL180 of the meta run's keyword arguments)."""
    def f(x, a):
        return x * torch.from_numpy(a)
    cf = fuselens.compile(f)
    a = np.ones(3, dtype=np.float32)
    for v in (1.0, 2.0):
        a[:] = v
        torch.testing.assert_close(cf(torch.ones(3), a), f(torch.ones(3), a))
    assert [e.graph_break.code for e in fuselens.inspect(cf) if e.graph_break] == ["FL140"]
