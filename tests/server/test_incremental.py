"""Incremental analysis gives what a full analysis gives, after every kind of edit."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bench_latency import make_source  # noqa: E402

from fuselens_lsp.analysis import run_analysis  # noqa: E402
from fuselens_lsp.incremental import IncrementalAnalyzer  # noqa: E402


def summary(analysis):
    def brk(b):
        return (b.code, b.filename, b.line, b.col, b.end_line, b.end_col, b.function,
                tuple((f.function, f.line, f.col, f.end_line, f.end_col) for f in b.stack))
    return [(f.qualname, f.line, f.col, f.end_line, f.end_col, f.compiled, f.uses_torch, f.graph_count,
             tuple(brk(b) for b in f.breaks)) for f in analysis.functions]


def edits(src: str, rng: random.Random):
    """Edits of every kind an editor makes: inside a function, lines added and removed above
    others, a helper's break removed, compile calls added and removed, imports changed."""
    lines = src.split("\n")
    body = [i for i, t in enumerate(lines) if t.startswith("    ") and "=" in t]
    yield "type in a body", "\n".join(lines[:body[5]] + [lines[body[5]] + "  # x"] + lines[body[5] + 1:])
    yield "blank lines at the top", "\n\n\n" + src
    i = next(i for i, t in enumerate(lines) if t.startswith("def helper_"))
    yield "new line inside a helper", "\n".join(lines[:i + 1] + ["    q = x.cos()"] + lines[i + 1:])
    yield "helper loses its break", src.replace("    if b.max() > 0.9:\n        b = b * 0.5\n", "\n\n", 1)
    yield "print added to a helper", src.replace("    a = x.exp()\n", "    a = x.exp()\n    print(a)\n", 1)
    yield "a function compiled by a call", src + "\nh = torch.compile(helper_1)\n"
    yield "a function that compiles another", src + "\ndef main():\n    return torch.compile(helper_1)\n"
    yield "a module compiled through an instance", src + "\ndef build():\n    m = Block7(8)\n    return torch.compile(m)\n"
    yield "decorator removed", src.replace("@torch.compile\n", "", 1)
    yield "import removed", src.replace("import torch.nn.functional as F\n", "")
    yield "a method added to a module", src.replace(
        "    def forward(self, x):\n", "    def extra(self, x):\n        return x.item()\n\n    def forward(self, x):\n", 1)
    for k in range(6):
        ln = rng.choice(body)
        yield f"random line {ln} duplicated", "\n".join(lines[:ln] + [lines[ln]] + lines[ln:])


@pytest.mark.parametrize("seed", [0, 1])
def test_incremental_analysis_equals_full_analysis_after_each_edit(seed):
    src = make_source(600)
    inc = IncrementalAnalyzer()
    full, _, _ = run_analysis(src, "/tmp/big.py")
    got, _, _ = run_analysis(src, "/tmp/big.py", inc)
    assert summary(got) == summary(full)
    for what, text in edits(src, random.Random(seed)):
        full, err, _ = run_analysis(text, "/tmp/big.py")
        got, err2, _ = run_analysis(text, "/tmp/big.py", inc)
        assert (err, summary(got)) == (err2, summary(full)), what
        # and back to the original: everything from the cache, moved back
        hits = inc.hits
        got, _, _ = run_analysis(src, "/tmp/big.py", inc)
        assert summary(got) == summary(run_analysis(src, "/tmp/big.py")[0]), what + " (undone)"
        assert inc.hits > hits


def test_which_class_an_instance_is_made_of_is_followed():
    """`m = Block7(8)` then `torch.compile(m)` compiles Block7.forward: retargeting the
    assignment (the compile call unchanged) moves compiled-ness to the other class."""
    src = make_source(600)
    inc = IncrementalAnalyzer()
    for cls in ("Block7", "Block3", "Block7"):
        text = src + f"\ndef build():\n    m = {cls}(8)\n    return torch.compile(m)\n"
        got, _, _ = run_analysis(text, "/tmp/big.py", inc)
        full, _, _ = run_analysis(text, "/tmp/big.py")
        assert summary(got) == summary(full), cls
        assert {f.qualname for f in got.functions if f.compiled and f.qualname.endswith("forward")} >= {f"{cls}.forward"}


def test_a_global_instance_leads_to_its_class():
    """A function that calls a module-level instance inlines the class's forward: editing the
    class must re-analyse the function that uses the global."""
    quiet = "        return x.sin()\n"
    noisy = "        print(x)\n        return x.sin()\n"
    text = ("import torch\nimport torch.nn as nn\n\n\nclass M(nn.Module):\n    def forward(self, x):\n{body}\n\n"
            "model = M()\n\n\n@torch.compile\ndef use(x):\n    return model(x) * 2\n")
    inc = IncrementalAnalyzer()
    for body in (quiet, noisy, quiet):
        got, _, _ = run_analysis(text.format(body=body), "/tmp/g.py", inc)
        full, _, _ = run_analysis(text.format(body=body), "/tmp/g.py")
        assert summary(got) == summary(full), body
        use = next(f for f in got.functions if f.qualname == "use")
        assert [b.code for b in use.breaks] == (["FL100"] if body == noisy else []), use.breaks


def keystroke(rng, text, alphabet, typed, deleted, longest_deletion):
    """`text` after one random edit: with probability `typed` a piece of `alphabet` typed, with
    `deleted` up to `longest_deletion` characters deleted, else a line moved elsewhere."""
    i = rng.randrange(len(text) + 1)
    op = rng.random()
    if op < typed:
        return text[:i] + rng.choice(alphabet) + text[i:]
    if op < typed + deleted:
        return text[:i] + text[i + rng.randint(1, longest_deletion):]
    lines = text.split("\n")
    a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines.insert(b, lines.pop(a))
    return "\n".join(lines)


def test_random_edits_keep_incremental_equal_to_full():
    """Keystroke-like random edits (characters typed or deleted, lines split, joined, moved),
    each compared with a full analysis: the same results or the same syntax error."""
    rng = random.Random(7)
    text = make_source(400)
    inc = IncrementalAnalyzer()
    alphabet = ["x", " ", "(", ")", ":", "\n", "    ", "print(x)\n", "torch.compile(", "1", "#", "."]
    for step in range(40):
        text = keystroke(rng, text, alphabet, typed=0.5, deleted=0.3, longest_deletion=12)
        full, err, rep = run_analysis(text, "/tmp/r.py")
        got, err2, rep2 = run_analysis(text, "/tmp/r.py", inc)
        assert (err, rep, full is None) == (err2, rep2, got is None), step
        if full is not None:
            assert summary(got) == summary(full), (step, text)


def _spans(text):
    import ast
    return [(min([d.lineno for d in getattr(s, "decorator_list", ())] + [s.lineno]), s.end_lineno, type(s).__name__)
            for s in ast.parse(text).body]


def test_outline_parses_only_the_statement_an_edit_is_in(monkeypatch):
    """An edit inside one top-level statement re-parses that statement alone (the whole file
    takes 30-100 ms to parse on every keystroke); the statements' spans are those of a full parse,
    lines added or removed included, and a text that does not parse raises ast.parse's error."""
    import ast
    src = make_source(400)
    inc = IncrementalAnalyzer()
    inc.outline(src, "/tmp/o.py")
    parsed = []
    real = ast.parse
    monkeypatch.setattr(ast, "parse", lambda text, *a, **k: parsed.append(len(text)) or real(text, *a, **k))
    lines = src.split("\n")
    i = next(i for i, t in enumerate(lines) if t.startswith("def helper_"))
    for text in ("\n".join(lines[:i + 2] + ["    q = x.cos()", "    q = q + 1"] + lines[i + 2:]),  # lines added
                 "\n".join(lines[:i + 2] + lines[i + 3:])):  # one removed
        want = _spans(text)
        parsed.clear()
        got = [(st.start, st.end, type(st.node).__name__) for st in inc.outline(text, "/tmp/o.py")]
        assert got == want
        assert parsed and max(parsed) < len(text) // 10  # the helper alone
    broken = "\n".join(lines[:i + 2] + ["    q = (x"] + lines[i + 2:])
    with pytest.raises(SyntaxError) as e:
        inc.outline(broken, "/tmp/o.py")
    with pytest.raises(SyntaxError) as full:
        real(broken, "/tmp/o.py")
    assert (e.value.lineno, e.value.msg) == (full.value.lineno, full.value.msg)


def test_outline_after_random_keystrokes_is_a_full_parse():
    rng = random.Random(11)
    text = make_source(300)
    inc = IncrementalAnalyzer()
    alphabet = ["x", " ", "(", ")", ":", "\n", "    ", "def f():\n", "\"\"\"", "#", "@torch.compile\n", "\\\n"]
    for step in range(150):
        text = keystroke(rng, text, alphabet, typed=0.6, deleted=0.4, longest_deletion=8)
        try:
            want = _spans(text)
        except SyntaxError:
            with pytest.raises(SyntaxError):
                inc.outline(text, "/tmp/k.py")
            continue
        assert [(st.start, st.end, type(st.node).__name__) for st in inc.outline(text, "/tmp/k.py")] == want, step
