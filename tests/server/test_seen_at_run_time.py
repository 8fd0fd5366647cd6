"""What ran beats what was guessed: the breaks a Compile & benchmark run's capture met are
published on every workspace file they occur in, until that file changes."""
from __future__ import annotations

import pytest

from fl_lsp_testing import as_dict, text_of

pytestmark = pytest.mark.asyncio

HELPER = '''\
def noisy(x):
    y = x + 1
    print("in the helper")
    return y
'''

MAIN = '''\
import torch
from helper import noisy


# fuselens: example(x=float32[8])
@torch.compile
def f(x):
    return noisy(x.sin()) * 2
'''


async def test_run_breaks_are_published_in_the_callee_file_until_it_changes(session):
    await session.init()
    (session.root / "helper.py").write_text(HELPER)
    uri = await session.open("main.py", MAIN)
    helper_uri = session.uri("helper.py")
    r = as_dict(await session.command(uri, "f"))
    assert r["ok"], r
    assert [b["code"] for b in r["result"]["breaks"]] == ["FL100"]

    # in helper.py (not open): at the print, marked as seen at run time, with the call as related info
    (d,) = await session.diagnostics(helper_uri)
    assert d.code == "FL100" and d.data["seenAtRunTime"] and "seen at run time" in d.message
    assert text_of(HELPER, d.range) == 'print("in the helper")'
    assert [text_of(MAIN, ri.location.range) for ri in d.related_information] == ["noisy(x.sin())"]
    assert d.related_information[0].message == "`f` calls `noisy` here"

    # in main.py: at the call that leads there
    diags = await session.diagnostics(uri)
    seen = [x for x in diags if (x.data or {}).get("seenAtRunTime")]
    assert [(x.code, text_of(MAIN, x.range)) for x in seen] == [("FL100", "noisy(x.sin())")]
    assert len([x for x in diags if x.code == "FL100" and x.range == seen[0].range]) == 1  # not twice

    # the helper changes: what the run saw there is gone
    await session.open("helper.py", HELPER, save=False)
    await session.change(helper_uri, HELPER.replace("    print(\"in the helper\")\n", ""))
    assert not [x for x in await session.diagnostics(helper_uri) if (x.data or {}).get("seenAtRunTime")]


SCALED = '''\
import torch


# fuselens: example(x=float32[8], scale=2.0)
@torch.compile
def f(x, scale: torch.Tensor | float):
    if scale > 1:
        x = x * scale
    print("scaled")
    return x.sin()
'''


async def test_a_run_replaces_the_guesses_about_its_function_until_the_file_changes(session):
    from lsprotocol import types as lsp
    await session.init()
    uri = await session.open("scaled.py", SCALED)
    # the analysis cannot know which `scale` is: annotated as possibly a tensor, it guesses a
    # data-dependent if (un-annotated, it would claim nothing: test_claims.py)
    before = {d.code: d.severity for d in await session.diagnostics(uri)}
    assert before == {"FL120": lsp.DiagnosticSeverity.Warning, "FL100": lsp.DiagnosticSeverity.Warning}
    session.client.diagnostics.pop(uri)
    r = as_dict(await session.command(uri, "f"))
    assert r["ok"], r
    assert [b["code"] for b in r["result"]["breaks"]] == ["FL100"]
    after = {d.code: d for d in await session.diagnostics(uri)}
    # the guess the run did not meet: a hint (out of Problems), saying so; the run's break stays
    assert after["FL120"].severity == lsp.DiagnosticSeverity.Hint and "not seen when" in after["FL120"].message
    assert after["FL100"].severity == lsp.DiagnosticSeverity.Warning
    # lens and panel count the run's graphs and breaks; the client is asked for the lenses again
    assert session.client.lens_refreshes >= 1
    lenses = await session.client.text_document_code_lens_async(
        lsp.CodeLensParams(text_document=lsp.TextDocumentIdentifier(uri=uri)))
    assert "fuselens: 2 graphs, 1 graph break (as run)" in [l.command.title for l in lenses]
    (fn,) = as_dict(await session.request("fuselens/functions", {"uri": uri}))["documents"][0]["functions"]
    assert fn["asRun"] and fn["breakCount"] == 1 and fn["graphCount"] == 2 and fn["breaks"][0]["code"] == "FL100"
    # an edit: the analysis' guesses again
    session.client.diagnostics.pop(uri)
    await session.change(uri, SCALED.replace("x.sin()", "x.cos()"))
    assert {d.code: d.severity for d in await session.diagnostics(uri)} == before
