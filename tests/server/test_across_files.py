"""Across files (issue 17): `torch.compile(Net())` in train.py makes `Net.forward` in model.py
compiled code, so model.py's diagnostics follow what the workspace compiles: they appear when
train.py compiles the class (open, or only on disk), and go when the compile call goes."""
from __future__ import annotations

import pytest
from lsprotocol import types as lsp

pytestmark = pytest.mark.asyncio

MODEL = '''\
import torch.nn as nn


def helper(x):
    print("scaling")
    return x * 2


class Net(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            x = x + 1
        return helper(x)
'''

TRAIN = '''\
import torch
from model import Net

net = Net()
fast = torch.compile(net)
'''

TRAIN_WITHOUT_COMPILE = '''\
import torch
from model import Net

net = Net()
'''


async def _wait(session, uri, want, timeout=60.0):
    """The diagnostics of `uri` once their codes are `want` (a re-analysis triggered by another
    file's edit publishes on its own)."""
    import asyncio
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        diags = session.client.diagnostics.get(uri)
        if diags is not None and sorted(d.code for d in diags) == want:
            return diags
        if loop.time() > end:
            raise TimeoutError(f"{uri}: {[d.code for d in diags or []]}, want {want}")
        await asyncio.sleep(0.05)


async def test_class_compiled_in_another_file_gets_diagnostics(session):
    # only compiled code gets diagnostics here, so what appears is what the other file compiles
    await session.init(settings={"informationSeverity": "off"})
    model = await session.open("model.py", MODEL, save=True)
    assert await session.diagnostics(model) == []  # nothing compiles Net yet

    await session.open("train.py", TRAIN)
    diags = await _wait(session, model, ["FL100", "FL120"])
    assert all(d.severity == lsp.DiagnosticSeverity.Warning for d in diags)
    by_code = {d.code: d for d in diags}
    assert by_code["FL120"].range.start.line == 10  # `if x.sum() > 0` in Net.forward
    # the break inside `helper`, which forward calls: related information names the call
    related = by_code["FL100"].related_information or []
    assert any(r.location.range.start.line == 12 for r in related)

    # the compile call removed (an unsaved edit of the open train.py): the diagnostics go
    await session.change(session.uri("train.py"), TRAIN_WITHOUT_COMPILE)
    await _wait(session, model, [])

    # train.py closed without saving: its text on disk compiles Net again
    session.client.text_document_did_close(lsp.DidCloseTextDocumentParams(
        text_document=lsp.TextDocumentIdentifier(uri=session.uri("train.py"))))
    await _wait(session, model, ["FL100", "FL120"])


async def test_compile_site_in_a_file_that_is_not_open(session, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    await session.init(settings={"informationSeverity": "off"})
    model = await session.open("model.py", MODEL, save=True)
    await _wait(session, model, ["FL100", "FL120"])


HELPERS = '''\
def scale(x):
    print("scaling")
    return x + 1
'''

STEP = '''\
import torch
import helpers


@torch.compile
def step(x):
    y = helpers.scale(x)
    return y * 2
'''


async def test_break_in_a_callee_of_another_file_is_shown_at_the_call(session, tmp_path):
    (tmp_path / "helpers.py").write_text(HELPERS)  # not open: read from disk
    await session.init()
    uri = await session.open("step.py", STEP)
    diags = await _wait(session, uri, ["FL100"])
    d = diags[0]
    assert d.severity == lsp.DiagnosticSeverity.Warning
    assert d.range.start.line == 6  # `helpers.scale(x)`
    where = {(r.location.uri, r.location.range.start.line) for r in d.related_information or []}
    assert (session.uri("helpers.py"), 1) in where  # the print itself


async def test_script_compiling_an_installed_transformers_model(session, tmp_path):
    """The issue's scenario: a workspace script compiles transformers' GPT-2 classifier; the
    installed modeling file, opened, shows the break of the compiled forward (its logger's
    `warning_once` on `inputs_embeds` without a pad token: GB0291) as a warning."""
    transformers = pytest.importorskip("transformers")
    import os
    path = os.path.join(os.path.dirname(transformers.__file__), "models", "gpt2", "modeling_gpt2.py")
    (tmp_path / "train.py").write_text(
        "import torch\n"
        "from transformers.models.gpt2.modeling_gpt2 import GPT2ForSequenceClassification\n"
        "model = torch.compile(GPT2ForSequenceClassification(config))\n")
    await session.init(settings={"informationSeverity": "off"})
    from pathlib import Path
    uri = Path(path).as_uri()
    session.client.text_document_did_open(lsp.DidOpenTextDocumentParams(text_document=lsp.TextDocumentItem(
        uri=uri, language_id="python", version=1, text=open(path, encoding="utf-8").read())))
    diags = await session.diagnostics(uri)
    warned = [d for d in diags if d.code == "FL101" and (d.data or {}).get("qualname") == "GPT2ForSequenceClassification.forward"]
    assert warned and all(d.severity == lsp.DiagnosticSeverity.Warning for d in warned)
