"""The abstract domain (what the editor runs on every edit) agrees with the concrete domain
(what the runtime captures) on every graph break, and executes no user code."""
import pathlib
import textwrap

import pytest
import torch

import fuselens
from fuselens.capture import analyze_source

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _breaks(fa):
    return sorted((b.code, b.line, b.col, b.end_line, b.end_col) for b in fa.breaks)


def test_showcase_agrees_with_concrete_capture():
    path = EXAMPLES / "graph_breaks.py"
    analysis = analyze_source(path.read_text(), str(path))
    fa = next(f for f in analysis.functions if f.name == "showcase")
    assert fa.compiled
    import importlib.util
    spec = importlib.util.spec_from_file_location("fl_showcase", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ex = fuselens.explain(mod.showcase, torch.randn(4, 4))
    concrete = sorted((b.code, b.line, b.col, b.end_line, b.end_col) for b in ex.graph_breaks)
    assert _breaks(fa) == concrete


def test_examples_without_breaks_have_none():
    for path in EXAMPLES.glob("*.py"):
        if path.name == "graph_breaks.py":
            continue
        for fa in analyze_source(path.read_text(), str(path)).functions:
            assert fa.breaks == [], (path.name, fa.qualname, fa.breaks)


SRC = textwrap.dedent('''
    import logging
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import fuselens
    log = logging.getLogger(__name__)

    def helper(x):
        print(x)
        return x * 2

    @torch.compile
    def f(x, n: int, scale=2.0):
        y = helper(x) * scale
        log.info("y")
        if n > 3:
            y = y + y.sum().item()
        k = x.nonzero()
        return y[x > 0]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x):
            h = F.relu(self.fc(x))
            if h.mean() > 0:
                h = h * 2
            return h.tolist()

    model = fuselens.compile(Net())

    def plain(x):
        return torch.sin(x).numpy()

    def no_torch(a, b):
        return a + b
''')


def test_breaks_codes_ranges_and_stack():
    a = analyze_source(SRC, "m.py")
    by = {f.qualname: f for f in a.functions}
    f = by["f"]
    assert f.compiled and f.uses_torch
    codes = [(b.code, b.line) for b in f.breaks]
    assert codes == [("FL100", 10), ("FL101", 16), ("FL110", 18), ("FL130", 19), ("FL130", 20)]
    printed = f.breaks[0]
    assert printed.stack and printed.stack[0].line == 15  # the call of helper(), in f
    assert (printed.col, printed.end_col) == (4, 12)      # exactly `print(x)`
    item = f.breaks[2]
    assert SRC.splitlines()[item.line - 1][item.col:item.end_col] == "y.sum().item()"
    net = by["Net.forward"]
    assert net.compiled and [b.code for b in net.breaks] == ["FL120", "FL111"]
    assert not by["plain"].compiled and [b.code for b in by["plain"].breaks] == ["FL112"]
    assert by["no_torch"].breaks == [] and not by["no_torch"].uses_torch


def test_reduction_without_dim_in_a_condition_and_tensor_methods_mean_torch():
    a = analyze_source(textwrap.dedent('''
        import torch
        @torch.compile
        def f(p):
            if p.max() > 0.5:
                p = p * 2
            return p
        def g(x):
            return x.cos().exp()
    '''), "m.py")
    f, g = a.functions
    assert [b.code for b in f.breaks] == ["FL120"]
    assert g.uses_torch and not g.compiled


def test_syntax_error_and_half_typed_code():
    a = analyze_source("def f(x):\n    return x.\n", "m.py")
    assert a.functions == [] and a.syntax_error[0] == 2
    # valid syntax but nonsense: no crash, no breaks invented
    a = analyze_source("import torch\ndef f(x):\n    return undefined_name(x) + torch.sin(x)\n", "m.py")
    assert [f.breaks for f in a.functions] == [[]]


def test_executes_no_user_code(tmp_path):
    marker = tmp_path / "ran"
    src = textwrap.dedent(f'''
        import torch
        open({str(marker)!r}, "w").write("x")
        def side():
            open({str(marker)!r}, "w").write("x")
        @torch.compile
        def f(x):
            side()
            return x
    ''')
    analyze_source(src, "m.py")
    assert not marker.exists()


def test_500_line_file_is_fast_enough_to_run_on_every_edit():
    # not a timing test: checks the analysis scales (no exponential branch explosion)
    body = "\n".join(f"    if n > {i}:\n        x = x * {i} + torch.sin(x)" for i in range(40))
    src = "import torch\n\n@torch.compile\ndef f(x, n: int):\n" + body + "\n    return x\n"
    a = analyze_source(src, "m.py")
    assert a.functions[0].breaks == []
