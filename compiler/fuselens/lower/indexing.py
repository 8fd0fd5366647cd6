"""Index expressions: sympy over loop variables (`x0`, `r1`, ...) and size symbols (`SizeVars`).

Views of lazy values compose reshapes: a write through `t.view(-1)` reads `t` at
`(k // s, k % s)` with `k = i * s + j`, and writing back reads the flat value at `i * s + j`
again. Built naively, each round trip nests the previous index twice, so a loop of in-place
writes grows an expression exponential in its length (compile time with it). The constructors
here simplify as they build, as Inductor's FloorDiv/ModularIndexing do with variable ranges:

  (a*s + b) // s = a,  (a*s + b) % s = b          when 0 <= b < s
  (x // s) * s + x % s = x                         and its mixed-radix generalisation

Ranges come from the ops handler evaluating the loop body (`env`): `env.ranges` maps each loop
variable to its extent, `env.sizevars` gives each size symbol's value. A lowering specialises on
its sizes (a new size builds a new program), so these facts hold for every kernel built from it;
size symbols stay in the results where they cancel symbolically, so kernels stay shared across
sizes where they can. Rules that depend on a sign apply only to expressions proven nonnegative:
Triton divides and takes remainders of signed ints truncating toward zero, Python flooring.
"""
from __future__ import annotations

import functools
import math
import weakref

import sympy


class FloorDiv(sympy.Function):
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        return None


class ModIndex(sympy.Function):
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1 or a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        return None


def value(e, env):
    """The value of an expression of sizes only (no loop variable), or None."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e)
    values = env.sizevars.values
    if e.is_Symbol:
        return values.get(e)
    if e.is_Pow and e.exp.is_Integer and e.exp >= 0:
        base = value(e.base, env)
        return None if base is None else base ** int(e.exp)
    if e.is_Mul or e.is_Add:
        parts = [value(a, env) for a in e.args]
        if any(p is None for p in parts):
            return None
        out = 1 if e.is_Mul else 0
        for p in parts:
            out = out * p if e.is_Mul else out + p
        return out
    return None


def bounds(e, env):
    """(lowest, highest) value of an index expression over the loop ranges, or None if unknown."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        v = env.sizevars.values.get(e)
        if v is not None:
            return v, v
        extent = env.ranges.get(e)
        return (0, extent - 1) if extent is not None else None
    if e.is_Pow and e.exp.is_Integer and e.exp >= 0:
        base = bounds(e.base, env)
        return None if base is None or base[0] < 0 else (base[0] ** int(e.exp), base[1] ** int(e.exp))
    if not (e.is_Add or e.is_Mul or isinstance(e, (FloorDiv, ModIndex))):
        return None
    parts = [bounds(a, env) for a in e.args]
    if any(p is None for p in parts):
        return None
    if e.is_Add:
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if e.is_Mul:
        lo, hi = parts[0]
        for plo, phi in parts[1:]:
            corners = (lo * plo, lo * phi, hi * plo, hi * phi)
            lo, hi = min(corners), max(corners)
        return lo, hi
    (alo, ahi), (blo, bhi) = parts
    if alo < 0 or blo <= 0:
        return None
    if isinstance(e, FloorDiv):
        return alo // bhi, ahi // blo
    return (alo, ahi) if ahi < blo else (0, min(ahi, bhi - 1))


def _nonnegative(e, env):
    b = bounds(e, env)
    return b is not None and b[0] >= 0


def _split_multiples(a, b, bv, env):
    """a = q * b + rest, with q the sum of a's terms whose size coefficient is a multiple of b
    (divided by b: symbolically where it cancels, else the quotient's size symbol)."""
    q, rest = sympy.Integer(0), sympy.Integer(0)
    for term in sympy.Add.make_args(a):
        sizes = [f for f in sympy.Mul.make_args(term) if value(f, env) is not None]
        rest_factors = [f for f in sympy.Mul.make_args(term) if value(f, env) is None]
        coef = sympy.Mul(*sizes)
        cv = value(coef, env)
        if cv % bv == 0:
            quotient = coef / b
            if quotient.as_numer_denom()[1] != 1:
                quotient = env.sizevars(cv // bv)
            q += quotient * sympy.Mul(*rest_factors)
        else:
            rest += term
    return q, rest


def floor_div(a, b, env):
    """a // b for an index expression a and a positive size b."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    bv = value(b, env)
    if b == 1 or bv is None or bv <= 0:
        return FloorDiv(a, b)
    ab = bounds(a, env)
    if ab is not None and ab[0] >= 0 and ab[0] // bv == ab[1] // bv:
        return sympy.Integer(ab[0] // bv)
    if isinstance(a, FloorDiv) and (inner := value(a.args[1], env)) and inner > 0:
        return floor_div(a.args[0], env.sizevars(inner * bv), env)  # (x // c) // b = x // (c*b)
    if isinstance(a, ModIndex) and (outer := value(a.args[1], env)) and outer % bv == 0 and \
            _nonnegative(a.args[0], env):  # (x % (m*b)) // b = (x // b) % m: the digit form fold merges
        return mod_index(floor_div(a.args[0], b, env), env.sizevars(outer // bv), env)
    if ab is not None and ab[0] >= 0:
        q, rest = _split_multiples(a, b, bv, env)
        if q != 0 and _nonnegative(rest, env):
            return q + floor_div(rest, b, env)
    return FloorDiv(a, b)


def mod_index(a, b, env):
    """a % b for an index expression a and a positive size b."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    bv = value(b, env)
    if b == 1 or bv is None or bv <= 0:
        return ModIndex(a, b)
    ab = bounds(a, env)
    if ab is not None and ab[0] >= 0 and ab[1] < bv:
        return a
    if isinstance(a, ModIndex) and (outer := value(a.args[1], env)) and outer % bv == 0:
        return mod_index(a.args[0], b, env)  # (x % (k*b)) % b = x % b
    if ab is not None and ab[0] >= 0:
        q, rest = _split_multiples(a, b, bv, env)
        if q != 0 and _nonnegative(rest, env):
            return mod_index(rest, b, env)
    return ModIndex(a, b)


def _digit(term, env):
    """term as (coefficient, x, d, m): coefficient * ((x // d) % m), m None for no modulus;
    None if it is not of that form, with a coefficient of sizes only."""
    factors = sympy.Mul.make_args(term)
    coef = sympy.Mul(*[f for f in factors if value(f, env) is not None])
    rest = [f for f in factors if value(f, env) is None]
    if len(rest) != 1:
        return None
    f, m = rest[0], None
    if isinstance(f, ModIndex):
        f, m = f.args
    d = sympy.Integer(1)
    if isinstance(f, FloorDiv):
        f, d = f.args
    if (m is None and d == 1) or value(d, env) is None or (m is not None and value(m, env) is None) \
            or not _nonnegative(f, env):
        return None
    return coef, f, d, m


def fold(e, env):
    """Sums of the digits of one value recombined: c*((x//d) % m) + c*m*((x//(d*m)) % M) is
    c*((x//d) % (m*M)), and c*(x//1) is c*x; the inverse of reshape_index's split."""
    e = sympy.sympify(e)
    if e.is_Add and any(f.is_Add for term in e.args for f in sympy.Mul.make_args(term)):
        # a stride times a sum of digits (a dim's index is `x1 * s1 + r2 // s0` where a
        # reduction's row spans it): sympy keeps a symbol times a sum unexpanded
        e = sympy.Add(*(sympy.expand_mul(term, deep=False) for term in e.args))
    if not e.is_Add or not any(isinstance(f, ModIndex) for term in e.args for f in sympy.Mul.make_args(term)):
        return e  # (only a digit with a modulus merges with another)
    digits, others = [], []
    for term in e.args:
        dg = _digit(term, env)
        (digits if dg is not None else others).append(dg if dg is not None else term)
    merged = True
    while merged:
        merged = False
        for i, (c, x, d, m) in enumerate(digits):
            if m is None:
                continue
            cv, dv, mv = value(c, env), value(d, env), value(m, env)
            for j, (c2, x2, d2, m2) in enumerate(digits):
                if j != i and x2 == x and value(d2, env) == dv * mv and value(c2, env) == cv * mv:
                    m_new = None if m2 is None else env.sizevars(mv * value(m2, env))
                    digits[i] = (c, x, d, m_new)
                    del digits[j]
                    merged = True
                    break
            if merged:
                break
    out = sympy.Add(*others)
    for c, x, d, m in digits:
        v = floor_div(x, d, env) if d != 1 else x
        out += c * (mod_index(v, m, env) if m is not None else v)
    return out


@functools.lru_cache(maxsize=1 << 16)
def expanded(e):
    """Index `e` as a sum of products (the canonical form its comparisons need), memoized: the read
    analysis and each kernel's sites expand the same indices again and again (Swin-T training:
    ~15000 loads of 1417 indices), beyond sympy's own cache of 1000 entries. Only products and
    powers of sums are expanded: sympy.expand's other passes (logs, powers' exponents and bases)
    never change an index and took two thirds of its time."""
    return sympy.expand(e, power_exp=False, power_base=False, log=False, basic=False)


# SizeVars -> {(what, its arguments, loop ranges): index}: a graph's bodies are evaluated again and
# again (the scheduler's read analysis, each kernel's code) with the same few reshapes and views
# (GPT-2 training's compile: 5103 reshapes, 52 distinct; Swin-T training's: 15291 view loads, whose
# sympy took its backend from 4.6 to 5.25 s on the dev CPU)
_memos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _memoized(env, key, make):
    """make() once per key, sizes (env.sizevars) and loop ranges: the simplifications read nothing else."""
    memo = _memos.setdefault(env.sizevars, {})
    key = (key, frozenset(env.ranges.items()))
    out = memo.get(key)
    if out is None:
        out = memo[key] = make()
    return out


def view_index(offset, stride, idx, env):
    """The buffer element at `idx` of a view of it (`offset`, `stride`), folded."""
    def make():
        sv = env.sizevars
        return fold(sv(offset) + sum((i * sv(s) for i, s in zip(idx, stride) if s), sympy.Integer(0)), env)
    return _memoized(env, ("view", offset, tuple(stride), tuple(idx)), make)


def reshape_index(idx, new_shape, old_shape, env):
    """Index into `old_shape` of the element at `idx` of its row-major reshape to `new_shape`.
    Dims are matched in groups with equal products, so flatten/unflatten need no div/mod beyond
    the group they touch. `env`: the ops handler (sizes and loop ranges, for simplifying)."""
    key = ("reshape", tuple(idx), tuple(new_shape), tuple(old_shape))
    return list(_memoized(env, key, lambda: _reshape_index(idx, new_shape, old_shape, env)))


def _reshape_index(idx, new_shape, old_shape, env):
    sv = env.sizevars
    out = [sympy.Integer(0)] * len(old_shape)
    if math.prod(old_shape) == 0:
        return out
    new = [(k, s) for k, s in enumerate(new_shape) if s != 1]
    old = [(k, s) for k, s in enumerate(old_shape) if s != 1]
    i = j = 0
    while i < len(new) or j < len(old):
        gn, go, pn, po = [], [], 1, 1
        while True:
            if pn <= po and i < len(new):
                gn.append(new[i]); pn *= new[i][1]; i += 1
            elif j < len(old):
                go.append(old[j]); po *= old[j][1]; j += 1
            if pn == po and gn and go:
                break
        flat, inner = sympy.Integer(0), 1
        for k, s in reversed(gn):
            flat += idx[k] * sv(inner)
            inner *= s
        flat = fold(flat, env)
        inner = 1
        for pos, (k, s) in enumerate(reversed(go)):
            v = floor_div(flat, sv(inner), env)
            out[k] = v if pos == len(go) - 1 else mod_index(v, sv(s), env)
            inner *= s
    return out
