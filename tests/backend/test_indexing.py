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


def test_a_strided_row_over_split_dims_folds_to_the_flat_index():
    """A reduction row over (c, h, w) of an NCHW tensor (GroupNorm's group): the loop variable r is
    split into digits (r // HW, (r % HW) // W, r % W) and multiplied back by the strides, with a
    size times a sum (HW * (r // HW + x * Cg)) that sympy keeps unexpanded. It folds to
    x * Cg * HW + r: no division an element (GPU kernels divide by a kernel argument in ~20 integer
    instructions; a GroupNorm backward spent most of its time there)."""
    env = Env([64, 4 * 4096])
    x, r = env.vars
    hw, w, cg = env.sizevars(4096), env.sizevars(64), env.sizevars(4)
    rows = hw * (floor_div(r, hw, env) + x * cg)
    assert fold(mod_index(r, hw, env) + rows, env) == x * cg * hw + r
    digits = mod_index(r, w, env) + w * floor_div(mod_index(r, hw, env), w, env)
    assert fold(digits + rows, env) == x * cg * hw + r


@pytest.mark.parametrize("seed", range(20))
def test_a_digit_of_a_remainder_equals_floor_semantics(seed):
    """(x % (m*d)) // d, rewritten as (x // d) % m, at every point."""
    rng = random.Random(seed)
    env = Env([rng.choice([3, 4, 6, 12]) for _ in range(2)])
    a = random_index(rng, env, 1)
    d = rng.choice([2, 3, 4])
    m = env.sizevars(d * rng.choice([1, 2, 3]))
    got, want = floor_div(mod_index(a, m, env), env.sizevars(d), env), FloorDiv(ModIndex(a, m), env.sizevars(d))
    for point in itertools.product(*(range(env.ranges[v]) for v in env.vars)):
        point = dict(zip(env.vars, point))
        assert evaluate(got, point, env) == evaluate(want, point, env), (got, want, point)
