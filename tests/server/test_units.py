"""The server's pure parts: example-input comments, suppressions, positions, the rewrites'
text (analysis-independent), error recovery for half-typed files."""
from __future__ import annotations

import textwrap

import pytest

from fuselens_lsp import examples
from fuselens_lsp.analysis import PositionCodec, Settings, _blank_broken_block, suppressed_codes
from fuselens_lsp.fixes import (NoFix, _Tree, minimal_edit, rewrite_guard_side_effect, rewrite_item,
                                rewrite_where, suppression_edit)


def test_example_comment_parses_tensors_and_literals():
    spec = examples.parse_example("(float32[1024, 512], w=bf16[512], eps=1e-5, dims=(1, 2), flag=True)")
    assert spec["args"] == [{"kind": "tensor", "dtype": "float32", "shape": [1024, 512]}]
    assert spec["kwargs"]["w"] == {"kind": "tensor", "dtype": "bfloat16", "shape": [512]}
    assert spec["kwargs"]["eps"] == {"kind": "value", "value": 1e-5}
    assert spec["kwargs"]["dims"] == {"kind": "tuple", "items": [{"kind": "value", "value": 1},
                                                                  {"kind": "value", "value": 2}]}
    assert examples.describe(spec) == "float32[1024, 512], w=bfloat16[512], eps=1e-05, dims=(1, 2), flag=True"


def test_example_comment_builds_seeded_tensors():
    import torch
    spec = examples.parse_example("(x=float16[3, 4], i=int64[5], m=bool[2], s=float32[()])")
    args, kwargs = examples.build(spec, "cpu")
    assert kwargs["x"].dtype == torch.float16 and kwargs["x"].shape == (3, 4)
    assert kwargs["i"].dtype == torch.int64 and 0 <= int(kwargs["i"].min()) and int(kwargs["i"].max()) < 16
    assert kwargs["m"].dtype == torch.bool
    assert kwargs["s"].shape == ()
    again = examples.build(spec, "cpu")[1]
    assert torch.equal(kwargs["x"], again["x"])  # seeded


@pytest.mark.parametrize("text,msg", [
    ("(x=floaty[3])", "unknown dtype `floaty`"),
    ("(x=float32[n])", "tensor sizes must be non-negative ints"),
    ("(x=open('f'))", "neither a tensor spec"),
    ("(x=float32[3]", "cannot parse"),
    ("(**kw)", "`**` is not allowed"),
])
def test_example_comment_errors_are_clear(text, msg):
    with pytest.raises(examples.ExampleSyntaxError, match=msg.replace("(", r"\(").replace("*", r"\*")):
        examples.parse_example(text)


def test_example_comment_is_found_above_decorators():
    src = textwrap.dedent('''\
    import torch

    # fuselens: example(x=float32[8])
    # another comment
    @torch.compile(
        dynamic=False)
    def f(x):
        return x
    ''')
    assert examples.find_example_comment(src, 7) == (3, "(x=float32[8])")
    assert examples.find_example_comment("x = 1\ndef g(y):\n    pass\n", 2) is None


def test_suppression_comments():
    assert suppressed_codes("x = 1  # fuselens: ignore[FL100, fl120]") == {"FL100", "FL120"}
    assert suppressed_codes("x = 1  # fuselens: ignore") == {"*"}
    assert suppressed_codes("x = 1  # noqa") is None
    lines = ["print(x)  # keep", "print(x)  # fuselens: ignore[FL101]", "print(x)  # fuselens: ignore[FL100]"]
    assert suppression_edit(lines, 1, "FL100") == (0, 16, 0, 16, "  # fuselens: ignore[FL100]")
    assert suppression_edit(lines, 2, "FL100")[4] == "# fuselens: ignore[FL101, FL100]"
    with pytest.raises(NoFix):
        suppression_edit(lines, 3, "FL100")


def test_positions_are_utf16_and_ast_columns_are_bytes():
    src = 'def f(x):\n    s = "é😀"; print(s)\n'
    codec = PositionCodec(src)
    byte_col = len('    s = "é😀"; '.encode())
    pos = codec.to_lsp(2, byte_col)
    assert pos.line == 1 and pos.character == len('    s = "é') + 2 + len('"; ')
    assert src[codec.offset(pos):].startswith("print")


def test_broken_statement_is_blanked_keeping_line_numbers():
    src = "import torch\n\n@torch.compile\ndef f(x):\n    return x.item(\n\ndef g(x):\n    return x\n"
    fixed = _blank_broken_block(src, 5)
    assert fixed.split("\n")[:7] == ["import torch", "", "", "", "", "", "def g(x):"]
    assert len(fixed.split("\n")) == len(src.split("\n"))


def test_settings_from_client():
    s = Settings.from_dict({"informationSeverity": "hint", "worker": {"timeLimitSeconds": 30},
                            "exampleInputs": {"discovery": ["main", "bogus"]}})
    assert (s.information_severity, s.time_limit_s, s.discovery) == ("hint", 30.0, ("main",))
    assert Settings.from_dict({"informationSeverity": "loud"}).information_severity == "information"


def test_minimal_edit_covers_only_changed_lines():
    a = "a\nb\nc\nd\n"
    b = "a\nB\nB2\nc\nd\n"
    assert minimal_edit(a, b) == (1, 2, "B\nB2\n")


SRC = textwrap.dedent('''\
import torch


@torch.compile
def f(x, y):
    s = y.sum().item()  # read
    print("hi", x.shape)  # debug
    z = x * s
    if x.sum() > 0:
        # positive
        a = x * 2
        b = z + 1
    else:
        a = x - 2
        b = z
    return a + b + x * y.mean().item()
''')


def test_rewrite_guard_keeps_comments():
    out = rewrite_guard_side_effect(_Tree(SRC), (7, 4), (7, 24))
    assert '    if not torch.compiler.is_compiling():\n        print("hi", x.shape)  # debug\n' in out


def test_rewrite_item_assignment_and_inline():
    assert "    s = y.sum()  # read\n" in rewrite_item(_Tree(SRC), (6, 8), (6, 22))
    assert "return a + b + x * y.mean()\n" in rewrite_item(_Tree(SRC), (16, 23), (16, 39))


def test_rewrite_where_hoists_a_shared_condition():
    out = rewrite_where(_Tree(SRC), (9, 7), (9, 18))
    assert ("    cond = x.sum() > 0\n    # positive\n    a = torch.where(cond, x * 2, x - 2)\n"
            "    b = torch.where(cond, z + 1, z)\n") in out


def test_rewrite_where_one_armed_needs_a_prior_value():
    src = "import torch\ndef f(x):\n    if x.max() > 1:\n        x = x / x.max()\n    return x\n"
    assert "    x = torch.where(x.max() > 1, x / x.max(), x)\n" in rewrite_where(_Tree(src), (3, 7), (3, 18))
    src2 = "import torch\ndef f(x):\n    if x.max() > 1:\n        y = x\n    return y\n"
    with pytest.raises(NoFix, match="no value"):
        rewrite_where(_Tree(src2), (3, 7), (3, 18))


def test_rewrite_where_refuses_dependent_assignments_and_other_statements():
    src = "import torch\ndef f(x):\n    if x.sum() > 0:\n        a = x\n        b = a * 2\n    else:\n        a = -x\n        b = x\n    return a, b\n"
    with pytest.raises(NoFix, match="earlier in the same branch"):
        rewrite_where(_Tree(src), (3, 7), (3, 18))
    src = "import torch\ndef f(x):\n    if x.sum() > 0:\n        print(x)\n    return x\n"
    with pytest.raises(NoFix):
        rewrite_where(_Tree(src), (3, 7), (3, 18))


def test_non_bool_condition_is_converted():
    src = "import torch\ndef f(x, m):\n    if m:\n        y = x\n    else:\n        y = -x\n    return y\n"
    assert "    y = torch.where(m.bool(), x, -x)\n" in rewrite_where(_Tree(src), (3, 7), (3, 8))


def test_worker_reports_bytes_moved_for_every_kernel_of_a_multi_kernel_graph(monkeypatch):
    """Bandwidth needs each kernel's bytes; the worker used to read attributes no kernel has."""
    import os
    import torch
    monkeypatch.setenv("FUSELENS_INTERPRET", "1")
    import fuselens
    from fuselens_lsp.worker import describe_compiled

    def f(x):
        m = x.softmax(-1)           # a row reduction ...
        return m.sum(0) + x.amax()  # ... and reductions of other shapes: several kernels
    cf = fuselens.compile(f)
    x = torch.randn(16, 32)
    torch.testing.assert_close(cf(x), f(x))
    d = describe_compiled(cf, os.path.abspath(__file__), open(__file__).read())
    kernels = [k for g in d["graphs"] for k in g["kernels"]]
    assert len(d["graphs"]) == 1 and len(kernels) > 1, d
    assert all(isinstance(k["bytes"], int) and k["bytes"] > 0 for k in kernels), [k["bytes"] for k in kernels]
    assert all(k["sourceLines"] and k["provenance"] for k in kernels)


def test_related_information_names_the_call_made_at_each_level():
    from fuselens.capture.breaks import Frame, GraphBreak
    from fuselens_lsp.analysis import call_message
    b = GraphBreak("FL100", "print()", "", "", "m.py", 3, 4, 3, 12,
                   (Frame("showcase", "m.py", 10, 4, 10, 15), Frame("outer_helper", "m.py", 6, 4, 6, 20)),
                   function="inner_helper")
    assert call_message(b, 0, "showcase") == "`showcase` calls `outer_helper` here; the break is in `inner_helper`"
    assert call_message(b, 1, "showcase") == "`outer_helper` calls `inner_helper` here (inlined into `showcase`)"


def test_server_modules_do_not_import_torch_or_libcst():
    import subprocess
    import sys
    code = ("import sys, fuselens_lsp.server, fuselens_lsp.analysis; "
            "print(sorted(m for m in ('torch', 'libcst', 'fuselens') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_transformed_code_view_explains_the_compilers_names():
    from fuselens_lsp.transformed_view import explained
    src = textwrap.dedent('''\
    def forward(self, x):
        __fl_r0, __fl_r1 = self.config, self.layers[0]
        __fl_o = __fl_graph_0(x)
        __fl_r0.compiling = True
        __fl_t0 = __fl_o[1]
        if __fl_t0:
            return __fl_resume_0(__fl_o[0])
        return __fl_cont_1(__fl_o[0])
    ''')
    view = explained(src, "M.forward")
    header, body = view.split("\n\n", 1)
    assert body == src  # what runs, unchanged
    assert "`M.forward`" in header
    assert "__fl_r0        `self.config`, bound on entry" in header
    assert "__fl_r1        `self.layers[0]`" in header
    assert "Writes to a __fl_rN below are the function's own" in header
    for name in ("__fl_o ", "__fl_t0 ", "__fl_graph_0 ", "__fl_resume_0 ", "Other __fl_ names"):
        assert name in header
    assert max(len(line) for line in header.splitlines()) <= 64  # fits a column beside the source
    assert explained("def f(x):\n    return x\n", "f") == "def f(x):\n    return x\n"
