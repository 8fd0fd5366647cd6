"""Index expressions stay small when writes through views compose reshapes of symbolic sizes.

A write through `t.view(-1)` reads `t` at `(k // s, k % s)` and writes back at `i * s + j`: each
write nests the previous index in a floor division and a modulus, so without simplification a
loop of writes grew an index exponential in its length and the compile after a size change (a
dim turned dynamic) never finished (issue 15, hang_dynamic_loop_view_write_grad.py). Each
compiled call here must finish within a deadline a hang cannot meet, without falling back to
eager, and equal eager (values and gradients)."""
from __future__ import annotations

import signal
import time
import warnings
from contextlib import contextmanager

import pytest
import torch

import fuselens
from fuselens.errors import FuselensWarning

# a call compiles in about a second here; the hang took minutes
DEADLINE_S = 20


class Timeout(BaseException):
    """A BaseException: fuselens's fallback (which catches Exception) must not turn it into an eager run."""


@contextmanager
def deadline(seconds):
    def expire(signum, frame):
        raise Timeout(f"compiled call still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_compiled(fn, shapes, requires_grad, dynamic=None):
    cf = fuselens.compile(fn, dynamic=dynamic)
    for shape in shapes:
        x = torch.randn(shape)
        xe, xc = x.clone().requires_grad_(requires_grad), x.clone().requires_grad_(requires_grad)
        want = fn(xe)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FuselensWarning)  # an eager fallback is not a compiled result
            start = time.monotonic()
            with deadline(DEADLINE_S):
                got = cf(xc)
            elapsed = time.monotonic() - start
        assert elapsed < DEADLINE_S
        assert torch.equal(got, want), shape
        if requires_grad:
            g = torch.randn_like(want)
            assert torch.equal(torch.autograd.grad(got, xc, g)[0], torch.autograd.grad(want, xe, g)[0]), shape


def nested_loop_writes(x):
    t1 = x * 1
    for i in range(3):
        t1 = t1 * 2
        for j in range(len(x)):
            x = x + j
            t1.view(-1)[0] = 9
    return t1


@pytest.mark.parametrize("dynamic", [None, False])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_nested_loop_writes_through_flat_view(requires_grad, dynamic):
    check_compiled(nested_loop_writes, [(3, 3), (5, 3)], requires_grad, dynamic)


# reshapes there and back again (captured as chains of reshapes of a lazy value, as writes
# through views are): each pair must leave the index as small as it found it, or be stored
ROUND_TRIPS = {
    "flat": (lambda t: t.view(-1), lambda t, n: t.view(n, 6)),
    "unflattened": (lambda t: t.view(t.shape[0], 3, 2), lambda t, n: t.view(n, 6)),
    "regrouped": (lambda t: t.view(-1, 3), lambda t, n: t.view(n, 6)),
    "flat_of_3d": (lambda t: t.view(t.shape[0], 2, 3).view(-1), lambda t, n: t.view(n, 2, 3).view(n, 6)),
    "flat_of_transposed": (lambda t: t.t().reshape(-1), lambda t, n: t.view(6, n).t()),
    # no way back: each regroup across the transpose nests the index (stored past a size)
    "regrouped_transposed": (lambda t: t.t().reshape(-1, 6), lambda t, n: t),
}


@pytest.mark.parametrize("round_trip", ROUND_TRIPS)
@pytest.mark.parametrize("requires_grad", [True, False])
def test_reshape_round_trips(round_trip, requires_grad):
    there, back = ROUND_TRIPS[round_trip]

    def f(x):
        t = x * 2
        for _ in range(24):
            t = back(there(t), len(x))
        return t + 1
    check_compiled(f, [(4, 6), (7, 6), (5, 6)], requires_grad)


def random_chain(rng, numel, steps):
    """Random views of a tensor of `numel` elements: reshapes to random factorizations (with
    size-1 dims) and permutations, as (kind, argument) pairs."""
    def factorization():
        dims, left = [], numel
        while left > 1 and len(dims) < 3:
            divisors = [d for d in range(2, left + 1) if left % d == 0]
            d = rng.choice(divisors)
            dims.append(d)
            left //= d
        dims += [left] if left > 1 else []
        if rng.random() < 0.3:
            dims.insert(rng.randrange(len(dims) + 1), 1)
        return tuple(dims) or (1,)
    chain = []
    for _ in range(steps):
        if rng.random() < 0.7:
            chain.append(("reshape", factorization()))
        else:
            chain.append(("permute", None))
    return chain


@pytest.mark.parametrize("seed", range(8))
def test_random_view_chains(seed):
    """Index expressions simplified with loop ranges compute the same elements as eager's views:
    random chains of reshapes (any factorization of the size) and transposes of a lazy value."""
    import random
    rng = random.Random(seed)
    numel = rng.choice([12, 24, 30, 36, 60])
    chain = random_chain(rng, numel, 12)
    perms = [rng.sample(range(8), 8) for _ in chain]

    def f(x):
        t = x * 2
        for (kind, arg), perm in zip(chain, perms):
            if kind == "reshape":
                t = t.reshape(arg)
            else:
                t = t.permute([d for d in perm if d < t.dim()])
        return t + 1
    check_compiled(f, [(numel,)], requires_grad=False)
