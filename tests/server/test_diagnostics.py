"""Graph-break diagnostics end to end: a real server process, real documents, real analysis."""
from __future__ import annotations

import textwrap

import pytest
from lsprotocol import types as lsp

from fl_lsp_testing import as_dict, text_of

pytestmark = pytest.mark.asyncio

# functions nothing compiled reaches get diagnostics only when asked (test_claims.py)
ALL_FUNCTIONS = {"uncompiledFunctions": "all"}

PRINT_SRC = '''\
import torch


@torch.compile
def f(x):
    y = x.sin()
    print("y is", y.shape)
    return y * 2
'''


async def test_print_break_is_a_warning_on_the_call_with_code_and_doc_link(session):
    await session.init()
    uri = await session.open("a.py", PRINT_SRC)
    diags = await session.diagnostics(uri)
    assert len(diags) == 1
    d = diags[0]
    assert d.code == "FL100"
    assert d.source == "fuselens"
    assert d.severity == lsp.DiagnosticSeverity.Warning
    # the breaking sub-expression, not the whole line
    assert text_of(PRINT_SRC, d.range) == 'print("y is", y.shape)'
    assert d.code_description.href.endswith("graph-breaks.md#fl100")
    assert "print()" in d.message and "Hint:" in d.message and "is_compiling" in d.message


async def test_function_that_uses_torch_but_is_not_compiled_gets_information(session):
    src = '''\
    import torch

    def g(x):
        n = x.sum().item()
        return torch.relu(x) * n
    '''
    await session.init(settings=ALL_FUNCTIONS)
    uri = await session.open("b.py", src)
    diags = await session.diagnostics(uri)
    assert [d.code for d in diags] == ["FL110"]
    assert diags[0].severity == lsp.DiagnosticSeverity.Information
    assert text_of(textwrap.dedent(src), diags[0].range).endswith(".item()")


async def test_information_severity_is_a_setting(session):
    src = '''\
    import torch

    def g(x):
        print(x)
        return torch.relu(x)
    '''
    await session.init(settings={"informationSeverity": "off"})
    uri = await session.open("c.py", src)
    assert await session.diagnostics(uri) == []


async def test_compiled_by_call_and_module_instance(session):
    src = '''\
    import torch
    import fuselens


    def step(x):
        print(x)
        return x * 2


    class Net(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                x = x + 1
            return x


    fast_step = fuselens.compile(step)
    net = torch.compile(Net())
    '''
    await session.init()
    uri = await session.open("d.py", src)
    diags = await session.diagnostics(uri)
    by_code = {d.code: d for d in diags}
    assert by_code["FL100"].severity == lsp.DiagnosticSeverity.Warning
    assert by_code["FL120"].severity == lsp.DiagnosticSeverity.Warning
    assert by_code["FL120"].range.start.line == 11


async def test_break_in_inlined_helper_has_related_information(session):
    src = '''\
    import torch


    def helper(x):
        print("inside")
        return x + 1


    @torch.compile
    def f(x):
        return helper(x) * 2
    '''
    await session.init()
    uri = await session.open("e.py", src)
    diags = await session.diagnostics(uri)
    assert len(diags) == 1, diags   # one diagnostic, not one per function it is inlined into
    d = diags[0]
    assert d.severity == lsp.DiagnosticSeverity.Warning  # strongest: it breaks a compiled function
    assert text_of(textwrap.dedent(src), d.range) == 'print("inside")'
    assert d.related_information, "the call chain is shown"
    rel = d.related_information[0]
    assert rel.location.uri == uri
    assert text_of(textwrap.dedent(src), rel.location.range).startswith("helper(x)")
    # names the call made (the helper), not the function it is made in
    assert rel.message == "`f` calls `helper` here", rel.message


async def test_every_edit_reanalyses_and_half_typed_code_gives_no_stale_diagnostics(session):
    await session.init()
    uri = await session.open("f.py", PRINT_SRC)
    assert [d.code for d in await session.diagnostics(uri)] == ["FL100"]

    # insert two lines above: the diagnostic moves with the code
    await session.change(uri, "# a comment\n# another\n" + PRINT_SRC)
    diags = await session.diagnostics(uri)
    assert [d.range.start.line for d in diags] == [8]

    # half-typed second function: the first keeps its (correctly placed) diagnostic
    half = PRINT_SRC + "\n\n@torch.compile\ndef g(x):\n    return x.item(\n"
    await session.change(uri, half)
    diags = await session.diagnostics(uri)
    assert [(d.code, d.range.start.line) for d in diags] == [("FL100", 6)]

    # broken everywhere, and shorter than the line of the last good diagnostic: nothing to keep
    await session.change(uri, "def (:\n")
    assert await session.diagnostics(uri) == []

    # fixed: diagnostics come back
    await session.change(uri, PRINT_SRC)
    assert [d.code for d in await session.diagnostics(uri)] == ["FL100"]


async def test_suppression_comment_hides_the_break(session):
    src = PRINT_SRC.replace('print("y is", y.shape)', 'print("y is", y.shape)  # fuselens: ignore[FL100]')
    await session.init()
    uri = await session.open("g.py", src)
    assert await session.diagnostics(uri) == []


async def test_no_diagnostics_for_code_without_torch_and_cleared_on_close(session):
    await session.init()
    uri = await session.open("h.py", "def plain(a):\n    print(a)\n    return a\n")
    assert await session.diagnostics(uri) == []
    uri2 = await session.open("i.py", PRINT_SRC)
    assert await session.diagnostics(uri2)
    session.client.diagnostics.pop(uri2)
    session.client.text_document_did_close(lsp.DidCloseTextDocumentParams(
        text_document=lsp.TextDocumentIdentifier(uri=uri2)))
    assert await session.diagnostics(uri2) == []


async def test_code_lens_shows_counts_and_compile_and_benchmark(session):
    src = '''\
    import torch


    @torch.compile
    def f(x):
        y = x.sin()
        print(y)
        return y * 2


    def g(x):
        return torch.cos(x)


    def plain(a):
        return a
    '''
    await session.init(settings=ALL_FUNCTIONS)
    uri = await session.open("j.py", src)
    lenses = await session.client.text_document_code_lens_async(
        lsp.CodeLensParams(text_document=lsp.TextDocumentIdentifier(uri=uri)))
    titles = [(l.range.start.line, l.command.title) for l in lenses]
    assert (4, "fuselens: 2 graphs, 1 graph break (compiled)") in titles
    assert (4, "Compile & benchmark") in titles
    assert (10, "fuselens: 1 graph, 0 graph breaks (not compiled)") in titles
    assert not any(line == 14 for line, _ in titles)  # no torch, no lens
    bench = next(l for l in lenses if l.command.title == "Compile & benchmark")
    assert bench.command.command == "fuselens.compileAndBenchmark"
    assert list(bench.command.arguments) == [uri, "f"]


async def test_side_panel_functions_request(session):
    await session.init()
    uri = await session.open("k.py", PRINT_SRC)
    r = as_dict(await session.request("fuselens/functions", {"uri": uri}))
    (doc,) = r["documents"]
    (fn,) = doc["functions"]
    assert fn["qualname"] == "f" and fn["compiled"] and fn["breakCount"] == 1
    assert fn["breaks"][0]["code"] == "FL100" and fn["run"] is None


async def test_changed_settings_reanalyse_open_files(session):
    src = '''\
    import torch

    def g(x):
        print(x)
        return torch.relu(x)
    '''
    await session.init(settings=ALL_FUNCTIONS)
    uri = await session.open("cfg.py", src)
    assert [d.severity for d in await session.diagnostics(uri)] == [lsp.DiagnosticSeverity.Information]
    session.client.diagnostics.pop(uri)
    session.client.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(
        settings={"fuselens": {**ALL_FUNCTIONS, "informationSeverity": "hint"}}))
    assert [d.severity for d in await session.diagnostics(uri)] == [lsp.DiagnosticSeverity.Hint]


async def test_side_panel_lists_compiled_functions_and_callees_with_breaks_first(session):
    src = '''\
    import torch


    def unrelated(x):
        return torch.cos(x)


    def helper(x):
        print("inside")
        return x + 1


    @torch.compile
    def f(x):
        return helper(x) * 2
    '''
    await session.init(settings=ALL_FUNCTIONS)
    uri = await session.open("panel.py", src)
    r = as_dict(await session.request("fuselens/functions", {"uri": uri}))
    fns = r["documents"][0]["functions"]
    assert [(f["qualname"], f["relevant"]) for f in fns] == [("f", True), ("helper", True), ("unrelated", False)]
