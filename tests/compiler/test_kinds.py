"""Each kind of value (capture/kinds.py) says once what calling it, reading it, its truth and
iterating it mean, for both domains: code capture takes whole, the editor flags nothing in, and
a break capture makes, the editor reports at the same place."""
import importlib.util
import sys
import textwrap

import pytest
import torch

import fuselens
from fuselens.capture import analyze_source
from fl_capture_testing import check

SRC = textwrap.dedent('''
    import functools
    import operator

    import torch


    class Scale:
        """A callable object of a plain class (a loss, a schedule): its `__call__` is code."""

        def __init__(self, k):
            self.k = k

        def __call__(self, x):
            return x * self.k


    class Unhashable(Scale):
        """Equal to anything: a lookup of it in a table by hash or `==` would be wrong."""
        __hash__ = None

        def __eq__(self, other):
            return True


    @functools.lru_cache
    def width(n):
        return n * 2


    SCALE = Scale(3.0)


    def idioms(x):
        if not torch.compiler.is_compiling():
            print("eager only")
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            print("scripting")
        y = SCALE(x) + Unhashable(2.0)(x)
        y = functools.reduce(operator.add, [y, x, x])
        return y * width(2) + len(x)


    def breaks_in_a_call(x):
        y = torch.relu(x)
        return SCALE(y) + 1


    class Logged(Scale):
        def __call__(self, x):
            print("scaled")
            return x * self.k


    LOGGED = Logged(2.0)


    def breaks_in_a_callable_object(x):
        y = torch.relu(x)
        return LOGGED(y) + 1
''')


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    path = tmp_path_factory.mktemp("kinds") / "fl_kinds_example.py"
    path.write_text(SRC)
    spec = importlib.util.spec_from_file_location("fl_kinds_example", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod, str(path)
    del sys.modules[spec.name]


def test_library_idioms_are_captured_whole_and_the_editor_flags_none(module):
    mod, path = module
    check(mod.idioms, torch.randn(4, 8), graphs=1, breaks=[])
    fa = next(f for f in analyze_source(SRC, path).functions if f.name == "idioms")
    assert fa.breaks == []


def test_a_callable_objects_call_is_inlined_in_both_domains(module):
    mod, path = module
    check(mod.breaks_in_a_call, torch.randn(4, 8), graphs=1, breaks=[])
    _, ex = check(mod.breaks_in_a_callable_object, torch.randn(4, 8), graphs=2)
    concrete = [(b.code, b.line, b.col) for b in ex.graph_breaks]
    analysis = {f.name: f for f in analyze_source(SRC, path).functions}
    assert analysis["breaks_in_a_call"].breaks == []
    editor = [(b.code, b.line, b.col) for b in analysis["breaks_in_a_callable_object"].breaks]
    assert editor == concrete and [c for c, _, _ in concrete] == ["FL100"]


FIRST = __import__("operator").itemgetter(0)
SHAPE = __import__("operator").attrgetter("shape")


def test_callable_objects_of_c_code_from_pure_modules_fold():
    # `operator.itemgetter(0)` is an object whose type is callable: the value decides its kind
    def f(x):
        return FIRST((x + 1, x * 2)) * SHAPE(x)[0]
    check(f, torch.randn(3), graphs=1, breaks=[])


def test_a_torch_callable_object_is_torchs():
    # a grad-mode object used as a decorator: torch's (the break, where there is one, in the
    # user's code, not inside torch's own `_contextlib`)
    def f(x):
        return torch.no_grad()(torch.sin)(x) * 2
    check(f, torch.randn(3))
    ex = fuselens.explain(f, torch.randn(3))
    assert all("_contextlib" not in b.filename for b in ex.graph_breaks), ex


def test_a_callable_object_whose_call_is_c_code_is_a_break():
    import numpy as np
    ufunc, table = np.negative, np.ones(3)  # (on numbers it is computed: test_numpy_scalars.py)

    def f(x):
        n = ufunc(table)[x.shape[0] - 1]
        return x * n
    check(f, torch.randn(3), graphs=1, breaks=["FL140"])
