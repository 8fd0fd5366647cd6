"""docs/graph-breaks.md: each section's example breaks with the section's code, and its
recommended rewrite does not (and computes the same values where the rewrite is exact)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import fuselens
from fuselens.capture import breaks as B
from fl_capture_testing import assert_same

DOC = Path(__file__).resolve().parents[2] / "docs" / "graph-breaks.md"
NOT_EQUIVALENT = {"FL121", "FL160"}  # rewrites that change the iteration count / rounding


def _sections():
    text = DOC.read_text()
    parts = re.split(r'<a id="(fl\d+)"></a>\n', text)
    out = {}
    for anchor, body in zip(parts[1::2], parts[2::2]):
        blocks = re.findall(r"```python\n# (example|rewrite)\n(.*?)```", body, re.S)
        out[anchor.upper()] = dict(blocks)
    return out


SECTIONS = _sections()


def _load(tmp_path, name, code):
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(f"_fl_doc_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.f


def test_one_section_per_code():
    assert sorted(SECTIONS) == sorted(k.code for k in B.kinds())
    text = DOC.read_text()
    for k in B.kinds():
        assert f"## {k.code} — {k.title}" in text, k.code
        if k.torch_code:
            assert f"`{k.torch_code}`" in text, k.code
    assert '<a id="loops-that-cannot-be-unrolled"></a>' in text


@pytest.mark.parametrize("code", sorted(SECTIONS))
def test_example_breaks_and_rewrite_does_not(code, tmp_path, capsys):
    blocks = SECTIONS[code]
    assert set(blocks) == {"example", "rewrite"}, code
    example = _load(tmp_path, f"{code}_example", blocks["example"])
    rewrite = _load(tmp_path, f"{code}_rewrite", blocks["rewrite"])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    ex = fuselens.explain(example, x.clone())
    assert code in [b.code for b in ex.graph_breaks], str(ex)
    ex2 = fuselens.explain(rewrite, x.clone())
    assert code not in [b.code for b in ex2.graph_breaks], str(ex2)
    if code not in NOT_EQUIVALENT:
        a, b = x.clone(), x.clone()
        assert_same(fuselens.compile(rewrite)(b), example(a))
        assert_same(b, a)
