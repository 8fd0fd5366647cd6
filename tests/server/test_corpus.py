"""Accuracy of the editor's diagnostics on real code (issue 17): transformers' modeling files
from the pinned package, analysed by `analyze_source` (the abstract domain), against
`torch._dynamo.explain` on tiny configs of the same models, computed here, with fuselens's
concrete capture (`fuselens.explain`) as a second witness. The runs include the paths where
these files do break under torch.compile (a loss through `self.loss_function`, `inputs_embeds`
into GPT-2's classifier, layer drop in Whisper's training, DistilBERT's sinusoidal tables).

Precision: diagnostics whose location Dynamo or the concrete capture reports as a break / all
diagnostics in the analysed files. Recall: Dynamo's breaks located in these files that fuselens
reports. A location is the innermost line of a break's stack that lies in the analysed file."""
from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zoo  # noqa: E402

import fuselens  # noqa: E402
from fuselens.capture.analyze import analyze_source  # noqa: E402
from fl_fx_backend import use_fx_backend  # noqa: E402

MODELS = ["bert", "gpt2", "llama", "t5", "vit", "whisper", "distilbert", "roberta", "clip", "mistral"]
# issue 17 asks for precision >= 0.95 (held) and recall >= 0.90 (reached: 9/10). Missed: the break
# in `self.loss_function` (GPT-2 with labels: a logging call on a branch of PreTrainedModel's
# property in modeling_utils.py that depends on the model's state, `loss_type` and
# `_loss_function`, which the editor does not claim: a break on an undecidable branch of another
# file is not claimed, as those of the attention interface's config checks would all be wrong)
PRECISION_FLOOR = 0.95
RECALL_FLOOR = 0.9


def _path(name):
    return os.path.join(os.path.dirname(transformers.__file__), "models", name, f"modeling_{name}.py")


def _module(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _runs():
    """(callable, kwargs) pairs: the zoo's models in eval mode, and the paths that break."""
    T = transformers
    out = []
    for name in ["bert", "roberta", "gpt2", "gpt2-labels", "llama", "mistral", "t5", "distilbert",
                 "vit", "clip", "whisper"]:
        model, inputs = hf_zoo.make(name)
        out.append((model.eval(), inputs))
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=hf_zoo.VOCAB, n_embd=32, n_layer=2, n_head=4, pad_token_id=0, num_labels=2)
    out.append((T.GPT2ForSequenceClassification(cfg).eval(), dict(inputs_embeds=torch.randn(2, 7, 32))))
    model, inputs = hf_zoo.make("whisper")
    model.config.encoder_layerdrop = model.config.decoder_layerdrop = 0.1
    for m in (model.encoder, model.decoder):
        m.layerdrop = 0.1
    out.append((model.train(), inputs))
    distil = _module("distilbert")
    out.append((distil._create_sinusoidal_embeddings, dict(n_pos=8, dim=4, out=torch.empty(8, 4))))
    out.append((distil.create_sinusoidal_embeddings, dict(n_pos=8, dim=4, out=torch.empty(8, 4))))
    # (its logging runs, then it raises AttributeError in eager too: no `position_embeddings`)
    model = T.DistilBertModel(T.DistilBertConfig(vocab_size=hf_zoo.VOCAB, dim=32, n_layers=2, n_heads=4,
                                                 hidden_dim=37))
    out.append((model.resize_position_embeddings, dict(new_num_position_embeddings=16)))
    model = T.DistilBertModel(T.DistilBertConfig(vocab_size=hf_zoo.VOCAB, dim=32, n_layers=2, n_heads=4,
                                                 hidden_dim=37, max_position_embeddings=8))
    out.append((model.resize_position_embeddings, dict(new_num_position_embeddings=12)))  # (it grows)
    return out


def _located(stack, files):
    """The innermost (file, line) of `stack` (outermost first) in one of `files`."""
    for filename, line in reversed(stack):
        if os.path.realpath(filename) in files:
            return os.path.realpath(filename), line
    return None


class _GraphBreakLog(logging.Handler):
    """Dynamo's graph-break log (TORCH_LOGS=graph_breaks): every break, with its user stack the
    first time a location breaks (`explain`'s break_reasons leave some out: a data-dependent
    `if` in a frame Dynamo then skips)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.stacks = []

    def emit(self, record):
        text = record.getMessage()
        at = re.search(r"in user code at (.+):(\d+)\s*$", text.splitlines()[0])
        frames = [(f, int(n)) for f, n in re.findall(r'^\s*File "(.+?)", line (\d+)', text, re.M)]
        if at is not None:
            self.stacks.append(frames + [(at.group(1), int(at.group(2)))])


def _dynamo_breaks(runs, files):
    log = _GraphBreakLog()
    logger = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(log)
    logger.propagate = False  # (to this handler only, not the terminal)
    torch._dynamo.config.suppress_errors = True  # (a Dynamo failure in a resumed frame: eager there)
    stacks = []
    try:
        for fn, kwargs in runs:
            torch._dynamo.reset()
            try:
                ex = torch._dynamo.explain(fn)(**kwargs)
            except Exception:  # noqa: BLE001 (eager's own error: the breaks before it are logged)
                continue
            stacks += [[(f.filename, f.lineno) for f in r.user_stack] for r in ex.break_reasons]
    finally:
        torch._dynamo.reset()
        torch._dynamo.config.suppress_errors = False
        logger.removeHandler(log)
        logger.propagate = True
        torch._logging.set_logs()
    # a repeated break's record names only its innermost line: located as its first record was
    seen = {}
    for stack in log.stacks + stacks:
        loc = _located(stack, files)
        if loc is not None:
            seen[stack[-1]] = loc
    return {seen[st[-1]] for st in log.stacks + stacks if st[-1] in seen}


def _concrete_breaks(runs, files, monkeypatch):
    use_fx_backend(monkeypatch)  # only capture's breaks matter here
    found = set()
    for fn, kwargs in runs:
        try:
            ex = fuselens.explain(fn, **kwargs)
        except Exception as e:  # noqa: BLE001 (a witness only: Dynamo's answer stands)
            print(f"  concrete capture failed on {getattr(fn, '__qualname__', type(fn).__name__)}: "
                  f"{type(e).__name__}: {e}")
            continue
        for b in ex.graph_breaks:
            loc = _located([(f.filename, f.line) for f in b.stack] + [(b.filename, b.line)], files)
            if loc is not None:
                found.add(loc)
    return found


def _diagnostics(files):
    """(function, code, location, the calls on its way in the file): the calls are where the
    editor shows the break as related information, and where Dynamo, which breaks in the frame
    that makes the call too, reports it again."""
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            analysis = analyze_source(f.read(), path)
        for fa in analysis.functions:
            for b in fa.breaks:
                stack = [(os.path.realpath(f.filename), f.line) for f in b.stack]
                loc = _located(stack + [(b.filename, b.line)], {path})
                out.append((fa.qualname, b.code, loc or (path, b.line), {s for s in stack if s[0] == path}))
    return out


def test_corpus_precision_recall(monkeypatch):
    transformers.logging.set_verbosity_error()
    files = {os.path.realpath(_path(n)) for n in MODELS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # each witness on objects of its own: the runs change them (a resize runs once)
        dynamo = _dynamo_breaks(_runs(), files)
        concrete = _concrete_breaks(_runs(), files, monkeypatch)
    diags = _diagnostics(sorted(files))
    confirmed = [d for d in diags if d[2] in dynamo or d[2] in concrete]
    reported = {d[2] for d in diags} | {s for d in diags for s in d[3]}
    found = dynamo & reported
    precision = len(confirmed) / len(diags) if diags else 1.0
    recall = len(found) / len(dynamo) if dynamo else 1.0
    short = lambda loc: f"{os.path.basename(loc[0])}:{loc[1]}"  # noqa: E731
    print(f"\ncorpus: {len(diags)} diagnostics in {len(files)} files; precision {precision:.3f} "
          f"({len(confirmed)}/{len(diags)}), recall {recall:.3f} ({len(found)}/{len(dynamo)})")
    print("  unconfirmed:", sorted({f"{d[0]} {d[1]} {short(d[2])}" for d in diags if d not in confirmed}))
    print("  missed:", sorted(short(loc) for loc in dynamo - reported))
    assert precision >= PRECISION_FLOOR
    assert recall >= RECALL_FLOOR
