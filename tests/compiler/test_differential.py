"""Differential test: random small programs over the supported constructs (graph breaks
included), compiled output == eager output on random inputs.

Each program is Python source written to a file and imported (so `inspect.getsource` works).
It is called eagerly and compiled on the same inputs, then on new values of the same shape
(other branches of data-dependent ifs), then on other row counts (a recompile, then dynamic
dims); a third of the programs get NaN in their inputs after the first call. Results, input
mutations and everything the program printed must match; if eager
raises, the compiled call must raise the same exception type.

    FUSELENS_DIFF_N=1000 pytest tests/compiler/test_differential.py     # more programs
    FUSELENS_DIFF_SEED=1234 pytest tests/compiler/test_differential.py  # one program
"""
from __future__ import annotations

import importlib.util
import os
import random
import textwrap

import pytest
import torch

import fuselens
from fl_capture_testing import assert_same, clone_tree

N_PROGRAMS = int(os.environ.get("FUSELENS_DIFF_N", "300"))
PER_TEST = 10  # programs per test item (so xdist spreads the work in fair chunks)
BASE_SEED = int(os.environ.get("FUSELENS_DIFF_BASE", "0"))


# ------------------------------------------------------------------------------ generator
class ProgramGen:
    """A random program: helpers h0.. and `f(x, y, k)` where x, y are float tensors of the
    same shape (R, C) and k a small int. Every tensor variable has shape (R, C)."""

    UNARY = ["torch.sin({})", "torch.cos({})", "torch.tanh({})", "torch.sigmoid({})",
             "{}.relu()", "{}.abs()", "F.gelu({})", "F.silu({})", "-{}", "{}.neg().exp().tanh()",
             "({0} - {0}.mean(dim=-1, keepdim=True))", "{}.softmax(-1)", "{}.clamp(-3, 3)",
             "{}.flip(-1)", "{}.T.contiguous().T", "{0}.view(-1).reshape({0}.shape)",
             "torch.cumsum({}, dim=1) * 0.1", "{}.float()", "{}[:, :]", "{}.T.T",
             # dtype casts: bf16 round trips (the rounded value), int<->float, bool
             "{}.bfloat16().float()", "{}.to(torch.bfloat16).relu().to(torch.float32)",
             "({} * 3).long().float()", "(({} * 2).int().to(torch.float32) / 2)", "({} > 0).float()",
             "torch.where({0}.bool(), {0}, 1.0)", "({0}.bfloat16() * 3 + 1).float()",
             "({0} * 4).to(torch.int64).bfloat16().float()",
             # max/min/argmax (NaN propagates: inputs may hold NaN)
             "({0} - {0}.amax(dim=1, keepdim=True))", "({0} * 0 + {0}.max(dim=1, keepdim=True).values)",
             "({0} + {0}.min(dim=0, keepdim=True)[0])", "({0}.argmax(dim=1, keepdim=True) + {0})",
             "torch.maximum({0}, {0}.flip(0))", "torch.minimum({0}, {0}.amin())",
             "({0} + {0}.max())", "({0}.clamp(min=0) + {0}.argmin())"]
    # Views (and `.float()`, which returns its input) end up in variables that in-place ops
    # then write through: capture tracks views and derives them again from their base.
    BINOPS = ["+", "-", "*"]

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.n = 0
        self.cols = self.r.choice([3, 4, 8])
        self.helpers: list[str] = []
        self.uses_module = self.r.random() < 0.3

    # -- names
    def fresh(self, p="v"):
        self.n += 1
        return f"{p}{self.n}"

    # -- expressions
    def num(self, nums):
        c = self.r.random()
        if nums and c < 0.35:
            return self.r.choice(nums)
        if c < 0.5:
            return "k"
        return repr(self.r.choice([0.5, 2, 1.5, -1, 3, 0.25]))

    def texpr(self, tv, nums, depth=0):
        r = self.r.random()
        if depth > 2 or r < 0.2:
            return self.r.choice(tv)
        if r < 0.45:
            return self.r.choice(self.UNARY).format(self.texpr(tv, nums, depth + 1))
        if r < 0.7:
            a, b = self.texpr(tv, nums, depth + 1), self.texpr(tv, nums, depth + 1)
            return f"({a} {self.r.choice(self.BINOPS)} {b})"
        if r < 0.8:
            a = self.texpr(tv, nums, depth + 1)
            n = self.num(nums)
            return f"({a} {self.r.choice(self.BINOPS)} {n})" if self.r.random() < 0.5 \
                else f"({n} {self.r.choice(self.BINOPS)} {a})"
        if r < 0.85:
            a, b, c = (self.r.choice(tv) for _ in range(3))
            return f"torch.where({a} > {b}, {c}, {a} * 0.5)"
        if r < 0.9:
            a, b, c = (self.r.choice(tv) for _ in range(3))
            return f"(({a} @ {b}.T @ {c}) * 0.05)"
        if r < 0.93:
            a = self.r.choice(tv)
            return f"({a} * {a}.shape[0] / (len({a}) + 1))"
        if r < 0.96:
            a, b = self.r.choice(tv), self.r.choice(tv)
            return f"torch.cat([{a}, {b}], dim=1)[:, :{self.cols}]"
        if self.uses_module:
            return f"torch.tanh(LIN({self.r.choice(tv)}))"
        return f"{self.r.choice(tv)}.sum(0, keepdim=True) + {self.r.choice(tv)}"

    # -- statements
    def block(self, tv, nums, depth, n_stmts, in_loop=False):
        """Statements for a block; variables they define are local to it (copies of the lists)."""
        tv, nums = list(tv), list(nums)
        out = []
        for _ in range(n_stmts):
            out += self.stmt(tv, nums, depth, in_loop)
        return out or ["pass"]

    def stmt(self, tv, nums, depth, in_loop):
        r = self.r.random()
        a = lambda: self.r.choice(tv)  # noqa: E731
        e = lambda: self.texpr(tv, nums)  # noqa: E731
        if r < 0.22:
            v, rhs = self.fresh(), e()
            tv.append(v)
            ann = ": torch.Tensor" if self.r.random() < 0.1 else ""
            return [f"{v}{ann} = {rhs}"]
        if r < 0.27:
            v, w, rhs = self.fresh(), self.fresh(), f"{e()}, {e()}"
            tv += [v, w]
            return [f"{v}, {w} = {rhs}"]
        if r < 0.33:  # augmented assignment, also on inputs (x += ... mutates x)
            return [f"{a()} {self.r.choice(['+=', '-=', '*='])} {e()}"]
        if r < 0.40:  # in-place ops on intermediates and inputs
            v = a()
            op = self.r.choice([f"{v}.add_({e()})", f"{v}.mul_({self.num(nums)})",
                                f"{v}[0] = {self.num(nums)}", f"{v}.clamp_(-2, 2)",
                                f"{v}[:, 1] += 1.0", f"{v}.copy_({e()})",
                                # every spelling of a write, through functions and views
                                f"torch.relu_({v})", f"F.silu({v}, inplace=True)",
                                f"torch.Tensor.mul_({v}, {self.num(nums)})",
                                f"torch.add({v}, 1.0, out={v})", f"{v}[1:].mul_(2).add_(1)",
                                f"{v}.view(-1)[0] = {self.num(nums)}", f"{v}.t().sub_({e()}.t())",
                                f"{v}.unsqueeze(0).tanh_()",
                                # writes eager refuses (overlapping memory): the same error
                                f"{v}[1:].add_({v}[:-1])"])
            return [op]
        if r < 0.45:  # print (FL100)
            return [f"print('p{self.fresh('')}', {a()}.shape, {a()}.sum() > 0, file=SINK)"]
        if r < 0.50:  # .item() (FL110) and friends
            s = self.fresh("s")
            nums.append(s)
            return [self.r.choice([f"{s} = {a()}.mean().item()",
                                   f"{s} = {a()}[0].tolist()[-1]",
                                   f"{s} = int({a()}.argmax())",
                                   f"{s} = float({a()}.abs().max())"])]
        if r < 0.54:  # data-dependent shapes (FL130)
            v, b = self.fresh(), a()
            line = self.r.choice([f"{v} = {a()} + {b}[{b} > 0].sum()",
                                  f"{v} = {a()} * torch.nonzero({b} > 0).shape[0] * 0.1"])
            tv.append(v)
            return [line]
        if r < 0.58:  # Python numbers
            s = self.fresh("n")
            nums.append(s)
            return [self.r.choice([f"{s} = k * 2 + 1", f"{s} = {a()}.shape[1] - 1",
                                   f"{s} = max(k, 2) / 4", f"{s} = len({a()}) % 3"])]
        if r < 0.61:
            v = self.fresh()
            line = f"{v} = torch.stack([{a()} * i for i in range({self.r.randint(1, 3)})]).sum(0)"
            tv.append(v)
            return [line]
        if r < 0.63:
            d, v = self.fresh("d"), self.fresh()
            line = f"{d} = {{'a': {a()}, 'b': [{a()}, {e()}]}}"
            tv.append(v)
            return [line, f"{v} = {d}['a'] + {d}['b'][1]"]
        if r < 0.65:
            return [f"assert {a()}.shape == {a()}.shape and {a()}.dim() == 2"]
        if r < 0.70 and self.helpers:  # inlined helper (may break inside)
            v = self.fresh()
            h = self.r.randrange(len(self.helpers))
            line = f"{v} = h{h}({a()}, {a()}, k={self.num(nums)})"
            tv.append(v)
            return [line]
        if depth >= 2:
            v, rhs = self.fresh(), e()
            tv.append(v)
            return [f"{v} = {rhs}"]
        ind = lambda lines: ["    " + l for l in lines]  # noqa: E731
        if r < 0.77:  # data-dependent if (FL120); branches reassign existing variables
            cond = self.r.choice([f"{a()}.sum() > 0", f"({a()} > 0.5).any()",
                                  f"{a()}.mean() < {a()}.mean()"])
            out = [f"if {cond}:"] + ind(self.block(tv, nums, depth + 1, self.r.randint(1, 3)))
            if self.r.random() < 0.7:
                out += ["else:"] + ind(self.block(tv, nums, depth + 1, self.r.randint(1, 2)))
            return out
        if r < 0.81:  # static if
            cond = self.r.choice(["k > 2", f"{a()}.shape[0] > 3", "k % 2 == 0"])
            return [f"if {cond}:"] + ind(self.block(tv, nums, depth + 1, 2)) + \
                ["else:"] + ind(self.block(tv, nums, depth + 1, 1))
        if r < 0.87:  # unrolled loop, possibly with breaks inside
            i = self.fresh("i")
            it = self.r.choice([f"range({self.r.randint(1, 3)})", "[1, 2]", "enumerate([0.5, 2.0])"])
            if it.startswith("enumerate"):
                j = self.fresh("j")
                head, loop_nums = f"for {i}, {j} in {it}:", nums + [i, j]
            else:
                head, loop_nums = f"for {i} in {it}:", nums + [i]
            return [head] + ind(self.block(tv, loop_nums, depth + 1, self.r.randint(1, 3), True))
        if r < 0.90:  # loop over tensors
            t = self.fresh("t")
            return [f"for {t} in [{a()}, {a()}]:"] + ind(self.block(tv + [t], nums, depth + 1, 2, True))
        if r < 0.93:  # loop with a data-dependent break (runs in Python: FL160)
            i = self.fresh("i")
            body = self.block(tv, nums + [i], depth + 1, 1, True)
            return [f"for {i} in range(3):"] + ind(body) + \
                ind([f"if {a()}.sum() > {a()}.sum():", "    break"])
        if r < 0.95:
            return ["with torch.no_grad():"] + ind(self.block(tv, nums, depth + 1, 2))
        if r < 0.96:
            return ["with torch.autocast('cpu', dtype=torch.bfloat16):"] + \
                ind(self.block(tv, nums, depth + 1, 2))
        if r < 0.965:
            v = a()
            return ["for m in MODS:", f"    {v} = torch.tanh(m({v})) + {v}"]
        if r < 0.97:
            return [f"assert ({a()}.abs() >= 0).all(), 'nan'"]  # data-dependent (FL122)
        if r < 0.975:
            return [f"LOG.debug('value %s', {a()}.shape)"]  # FL101
        if r < 0.98:
            v = self.fresh()
            line = f"{v} = hv({a()}, {a()}, scale={self.num(nums)}) * 1"
            tv.append(v)
            return [line]
        if r < 0.984:  # try with its handlers, else and finally around breaks (resumed inside)
            out = ["try:"] + ind(self.block(tv, nums, depth + 1, 2))
            if self.r.random() < 0.5:  # the program's own error, raised by data
                out += ind([f"if {a()}.sum() > {a()}.sum():", "    raise ValueError('data')"])
            out += ["except ValueError:"] + ind(self.block(tv, nums, depth + 1, 1))
            if self.r.random() < 0.5:
                out += ["else:"] + ind(self.block(tv, nums, depth + 1, 1))
            return out + ["finally:", self.r.choice([f"    print('finally', {a()}.shape, file=SINK)",
                                                     "    k = k + 0"])]
        if r < 0.988:  # context managers written in Python (effects in __enter__/__exit__)
            cm = self.r.choice(["Track('t')", "contextlib.nullcontext()", "tracked('g')"])
            return [f"with {cm}:"] + ind(self.block(tv, nums, depth + 1, 2))
        if r < 0.993 and in_loop:  # continue, on data or on a plain value
            cond = self.r.choice([f"{a()}.sum() > 0", "k > 2"])
            return [f"if {cond}:", "    continue"]
        c = self.fresh("c")  # data-dependent while with a bound
        v = a()
        return [f"{c} = 0", f"while {v}.abs().sum() < 20 and {c} < 3:",
                f"    {v} = {v} * 2 + 0.1", f"    {c} += 1"]

    def helper(self, j):
        tv, nums = ["a", "b"], ["k"]
        body = self.block(tv, nums, 1, self.r.randint(1, 3))
        # names defined by the body are local to `block`: return from the parameters
        ret = self.texpr(tv, nums, 1)
        return "\n".join([f"def h{j}(a, b, k=1.0):"] + ["    " + l for l in body] +
                         [f"    return {ret}"])

    def program(self) -> str:
        for j in range(self.r.randint(0, 2)):
            self.helpers.append(self.helper(j))
        tv, nums = ["x", "y"], []
        body = []
        for _ in range(self.r.randint(3, 9)):
            body += self.stmt(tv, nums, 0, False)
        outs = self.r.sample(tv, min(len(tv), self.r.randint(1, 3)))
        ret = self.r.choice([
            f"return {outs[0]}",
            f"return ({', '.join(outs)},)",
            f"return {{'out': {outs[0]}, 'rest': [{', '.join(outs[1:])}], 'k': k}}",
            f"return {outs[0]}, ({outs[-1]}, {nums[-1] if nums else 'k'})",
        ])
        head = textwrap.dedent("""\
            import contextlib
            import io
            import logging
            import torch
            import torch.nn.functional as F

            SINK = io.StringIO()
            torch.manual_seed(0)
            LIN = torch.nn.Linear({c}, {c})
            MODS = torch.nn.ModuleList([torch.nn.Linear({c}, {c}), torch.nn.Linear({c}, {c})])
            LOG = logging.getLogger("fuselens.tests.differential")


            def hv(*ts, scale=1.0):  # *args and keyword-only defaults
                return sum(ts) * scale


            class Track:  # a context manager with effects on entry and exit
                def __init__(self, tag):
                    self.tag = tag

                def __enter__(self):
                    print('enter', self.tag, file=SINK)
                    return self

                def __exit__(self, kind, value, tb):
                    print('exit', self.tag, kind, file=SINK)
                    return False


            @contextlib.contextmanager
            def tracked(tag):
                print('in', tag, file=SINK)
                try:
                    yield tag
                finally:
                    print('out', tag, file=SINK)
            """).format(c=self.cols)
        return head + "\n\n" + "\n\n\n".join(self.helpers) + "\n\n\ndef f(x, y, k):\n" + \
            "\n".join("    " + l for l in body + [ret]) + "\n"


# ------------------------------------------------------------------------------ running
def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(fn, mod, args):
    """(result or exception type, the args after the call, printed text)."""
    mod.SINK.seek(0)
    mod.SINK.truncate()
    args = clone_tree(args)
    torch.manual_seed(1)
    try:
        out = fn(*args)
    except fuselens.FuselensWarning:  # an eager fallback: a compiler bug, reported as is
        raise
    except Exception as e:  # noqa: BLE001 (the program's own error: compared by type)
        out = type(e)
    return out, args, mod.SINK.getvalue()


def run_program(seed: int, tmp_dir) -> None:
    src = ProgramGen(seed).program()
    path = tmp_dir / f"prog_{seed}.py"
    path.write_text(src)
    mod = _import(path, f"_fl_diff_{seed}")
    rng = torch.Generator().manual_seed(seed)
    cols = mod.LIN.in_features
    k = seed % 4 + 1
    calls = []
    for rows in (4, 4, 6, 7):
        calls.append((torch.randn(rows, cols, generator=rng), torch.randn(rows, cols, generator=rng), k))
    if seed % 3 == 0:  # NaN in the inputs (max/min/argmax and data-dependent ifs see them)
        for x, _, _ in calls[1:]:
            x[seed % x.shape[0], seed % cols] = float("nan")
    cf = fuselens.compile(mod.f)
    for i, args in enumerate(calls):
        expected, eager_args, eager_text = _run(mod.f, mod, args)
        got, comp_args, comp_text = _run(cf, mod, args)
        where = f"program seed={seed}, call {i} (FUSELENS_DIFF_SEED={seed} to rerun)\n{src}"
        if isinstance(expected, type):
            assert got is expected, f"eager raised {expected.__name__}, compiled gave {got}\n{where}"
            continue
        try:
            assert_same(got, expected)
            assert_same(comp_args, eager_args)
            assert comp_text == eager_text, "printed output differs"
        except AssertionError as e:
            raise AssertionError(f"{e}\n{where}") from None


def _seeds():
    one = os.environ.get("FUSELENS_DIFF_SEED")
    if one is not None:
        return [[int(one)]]
    seeds = list(range(BASE_SEED, BASE_SEED + N_PROGRAMS))
    return [seeds[i:i + PER_TEST] for i in range(0, len(seeds), PER_TEST)]


@pytest.mark.parametrize("seeds", _seeds(), ids=lambda s: f"seeds{s[0]}-{s[-1]}")
def test_random_programs(seeds, tmp_path):
    for seed in seeds:
        run_program(seed, tmp_path)


def test_generator_covers_the_constructs():
    """The generator's programs exercise breaks of each kind it targets."""
    text = "\n".join(ProgramGen(s).program() for s in range(200))
    for needle in ("print(", ".item()", "if ", "for ", "def h0", ".add_(", "[0] =", "+=",
                   "torch.relu_(", "inplace=True", "out=", "[1:].mul_(2).add_(1)",
                   "torch.no_grad()", "while ", "break", "nonzero", "torch.stack([", ".tolist()",
                   ".bfloat16().float()", ".long().float()", "> 0).float()", ".argmax(dim=1",
                   ".amax(dim=1", "torch.maximum(", "try:", "finally:", "with Track(",
                   "contextlib.nullcontext()", "with tracked(", "continue"):
        assert needle in text, needle
