"""A diagnostic is a claim that the compiler breaks there: none on what the editor cannot
resolve, none in functions the compiler never reaches (unless asked), and no internal names in
what the user reads. Pure analysis (no server process): cheap."""
from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path

from fuselens_lsp.analysis import Settings, analyze

REPO = Path(__file__).resolve().parents[2]

TRAIN = '''\
import logging
import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self._init_weights()

    def _init_weights(self):
        nn.init.normal_(self.fc.weight, std=0.02)
        print(self.fc.weight.sum().item())

    def forward(self, x):
        return gelu(self.fc(x))


def resize_rows(w, n):
    if torch.sum(w) > n:
        print(w.sum().item())
    return w[:n]


@torch.compile
def train_step(model, net, batch):
    logits = model(batch["x"])
    hidden = model.encoder.layers[0](logits)
    out = net(hidden) + model.head(logits)
    loss = F.cross_entropy(out, batch["y"])
    print(loss.item())
    loss.backward()
    return loss
'''


def run(src, **settings):
    src = textwrap.dedent(src)
    return analyze(src, "file:///t.py", "/tmp/t.py", 1, Settings.from_dict(settings))


def line_of(src, needle):
    return next(i for i, t in enumerate(src.splitlines()) if needle in t)


def test_calls_of_values_the_editor_cannot_resolve_are_not_breaks():
    # un-annotated parameters and attributes of them may be modules or functions, which capture
    # inlines: the editor claims no break on calling them
    r = run(TRAIN)
    by_line = {(d.range.start.line, d.code) for d in r.diagnostics}
    for needle in ('model(batch["x"])', "model.encoder.layers[0]", "net(hidden)"):
        assert not [c for ln, c in by_line if ln == line_of(TRAIN, needle)], (needle, by_line)
    # the real breaks after them are still reported (the calls' results are tensors)
    assert (line_of(TRAIN, "print(loss.item())"), "FL110") in by_line
    assert (line_of(TRAIN, "loss.backward()"), "FL152") in by_line
    backward = next(d for d in r.diagnostics if d.code == "FL152")
    assert "call 'loss.backward()'" in backward.message and "outside the compiled function" in backward.message
    # the editor shows messages as plain text: no markdown backticks
    assert not [d.message for d in r.diagnostics if "`" in d.message]


SCALARS = '''\
import math
import torch


@torch.compile
def step(x, n, lr, t: torch.Tensor, model):
    y = torch.relu(t)
    if x > 0:
        y = y + 1
    z = n * 2 - 1
    if z == 3:
        y = y * 2
    steps = int(lr * 100) + len(range(n)) + math.floor(math.sqrt(lr))
    label = f"{lr}"
    h = model(y)
    if h > 0:
        y = y - 1
    if y.sum() > 0:
        y = y * 3
    if x.sum() > 0:
        y = y / 2
    if (t + x).max() > 1:
        y = y + 3
    return float(y.mean()) + steps
'''


def test_values_only_assumed_to_be_tensors_get_no_claims():
    # an un-annotated parameter, an unknown call's result and arithmetic on them may be numbers:
    # comparing or converting them is no break; values known to be tensors (annotated, from torch
    # calls, tensor methods, an operation with a tensor) still break
    r = run(SCALARS)
    by_line = {(d.range.start.line, d.code) for d in r.diagnostics}
    for needle in ("if x > 0:", "if z == 3:", "steps = int(", 'label = f"', "if h > 0:"):
        assert not [c for ln, c in by_line if ln == line_of(SCALARS, needle)], (needle, by_line)
    for needle in ("if y.sum() > 0:", "if x.sum() > 0:", "if (t + x).max() > 1:"):
        assert (line_of(SCALARS, needle), "FL120") in by_line, (needle, by_line)
    assert (line_of(SCALARS, "float(y.mean())"), "FL113") in by_line


def test_functions_the_compiler_never_reaches_get_nothing_unless_asked():
    r = run(TRAIN)
    names = {f.qualname for f in r.functions if not f.quiet}
    # reached: compiled, and what a forward calls
    assert {"train_step", "gelu"} <= names
    # an `__init__` helper and a script function: listed (for Compile & benchmark), quiet
    assert not names & {"Block._init_weights", "resize_rows"}
    assert {"Block._init_weights", "resize_rows"} <= {f.qualname for f in r.functions if f.quiet}
    lines = {d.range.start.line for d in r.diagnostics}
    assert line_of(TRAIN, "if torch.sum(w) > n") not in lines
    assert line_of(TRAIN, "print(self.fc.weight") not in lines
    every = run(TRAIN, uncompiledFunctions="all")
    assert {"Block._init_weights", "resize_rows"} <= {f.qualname for f in every.functions if not f.quiet}
    assert line_of(TRAIN, "if torch.sum(w) > n") in {d.range.start.line for d in every.diagnostics}


def _internal_class_names() -> set[str]:
    """Classes fuselens defines whose names a user would not know: CamelCase with two capitals
    or more (TensorVar, ForeignData, StandIn, ...), not exported by `fuselens` itself."""
    import fuselens
    import fuselens.capture as cap
    import pkgutil
    import importlib
    names = set()
    for m in pkgutil.iter_modules(cap.__path__):
        mod = importlib.import_module(f"fuselens.capture.{m.name}")
        for n, v in vars(mod).items():
            if inspect.isclass(v) and v.__module__.startswith("fuselens") and len(re.findall(r"[A-Z]", n)) >= 2 \
                    and not hasattr(fuselens, n):
                names.add(n)
    return names


def test_no_internal_class_names_in_any_message():
    from fuselens.capture import breaks as B
    internal = _internal_class_names()
    assert {"TensorVar", "StandIn"} <= internal  # the scan sees what it must
    word = re.compile(r"\b(" + "|".join(map(re.escape, sorted(internal))) + r")\b")
    # every documented template...
    texts = [f"{k.title} {k.explanation} {k.hint}" for k in B.kinds()]
    texts.append((REPO / "docs" / "graph-breaks.md").read_text())
    # ...and every message the editor shows on files of the kinds users write
    for src in [TRAIN, *(p.read_text() for p in sorted((REPO / "tests" / "extension" / "workspace").glob("*.py"))),
                *(p.read_text() for p in sorted((REPO / "examples").glob("*.py")))]:
        r = run(src, uncompiledFunctions="all")
        texts += [d.message for d in r.diagnostics]
        texts += [ri.message for d in r.diagnostics for ri in (d.related_information or [])]
    hits = sorted({m.group(1) for t in texts for m in word.finditer(t)})
    assert not hits, hits


def test_a_print_whose_argument_breaks_is_offered_the_guard():
    from fuselens_lsp.analysis import break_json
    from fuselens_lsp.fixes import fixes_for_break
    r = run(TRAIN)
    fn = next(f for f in r.functions if f.qualname == "train_step")
    brk = next(b for b in fn.breaks if b.code == "FL110")
    fixes = fixes_for_break(TRAIN, "/tmp/t.py", break_json(brk), "train_step")
    guard = [f for f in fixes if "is_compiling" in f.title]
    assert guard, [f.title for f in fixes]
    assert "    if not torch.compiler.is_compiling():\n        print(loss.item())" in guard[0].new_source
    # a call that does more than report is not guarded (its work would be skipped when compiled)
    src = TRAIN.replace("print(loss.item())", "history.append(loss.item())").replace(
        "log = logging", "history = []\nlog = logging")
    brk = next(b for f in run(src).functions if f.qualname == "train_step" for b in f.breaks if b.code == "FL110")
    assert not [f for f in fixes_for_break(src, "/tmp/t.py", break_json(brk), "train_step") if "is_compiling" in f.title]
