"""lower/indexing.py's simplifying constructors equal floor division and modulus at every point
of the loop ranges (random affine and div/mod expressions over loop variables and sizes)."""
import itertools
import random

import pytest
import sympy

from fuselens.lower.indexing import FloorDiv, ModIndex, floor_div, fold, mod_index
from fuselens.lower.ir import SizeVars


class Env:
    def __init__(self, extents):
        self.sizevars = SizeVars()
        self.vars = [sympy.Symbol(f"x{d}", integer=True, nonnegative=True) for d in range(len(extents))]
        self.ranges = dict(zip(self.vars, extents))


def evaluate(e, point, env):
    """Floor semantics, as every index the kernels compute is nonnegative."""
    e = sympy.sympify(e)
    if isinstance(e, FloorDiv):
        return evaluate(e.args[0], point, env) // evaluate(e.args[1], point, env)
    if isinstance(e, ModIndex):
        return evaluate(e.args[0], point, env) % evaluate(e.args[1], point, env)
    if e.is_Add:
        return sum(evaluate(a, point, env) for a in e.args)
    if e.is_Mul:
        out = 1
        for a in e.args:
            out *= evaluate(a, point, env)
        return out
    if e.is_Pow:
        return evaluate(e.base, point, env) ** int(e.exp)
    if e.is_Integer:
        return int(e)
    return point[e] if e in point else env.sizevars.values[e]


def random_index(rng, env, depth):
    """A nonnegative index: sums of loop variables and div/mod terms times sizes."""
    terms = []
    for _ in range(rng.randint(1, 3)):
        if depth and rng.random() < 0.5:
            inner = random_index(rng, env, depth - 1)
            size = env.sizevars(rng.choice([2, 3, 4, 6, 12]))
            term = FloorDiv(inner, size) if rng.random() < 0.5 else ModIndex(inner, size)
        else:
            term = rng.choice(env.vars)
        terms.append(term * env.sizevars(rng.choice([1, 2, 3, 4, 6, 12])))
    return sympy.Add(*terms)


@pytest.mark.parametrize("seed", range(40))
def test_simplified_index_values(seed):
    rng = random.Random(seed)
    env = Env([rng.choice([1, 2, 3, 4, 6]) for _ in range(3)])
    a = random_index(rng, env, 2)
    b = env.sizevars(rng.choice([2, 3, 4, 6, 12, 24]))
    simplified = [(floor_div(a, b, env), FloorDiv(a, b)), (mod_index(a, b, env), ModIndex(a, b)), (fold(a, env), a)]
    for point in itertools.product(*(range(env.ranges[v]) for v in env.vars)):
        point = dict(zip(env.vars, point))
        for got, want in simplified:
            assert evaluate(got, point, env) == evaluate(want, point, env), (got, want, point)


def test_round_trip_simplifies_to_the_loop_variable():
    """The pattern of a write through a flat view: (i*s + j) // s, (i*s + j) % s, and the flat
    index of those digits again."""
    env = Env([5, 3])
    i, j = env.vars
    s = env.sizevars(3)
    k = i * s + j
    assert floor_div(k, s, env) == i and mod_index(k, s, env) == j
    x = sympy.Symbol("x0", integer=True, nonnegative=True)
    env.ranges = {x: 15}
    assert fold(FloorDiv(x, s) * s + ModIndex(x, s), env) == x
