"""Compile & benchmark end to end: the server starts a worker process that finds example
inputs, compiles with fuselens, checks against eager and (on CPU) reports kernels checked in
the Triton interpreter; hangs, crashes, cancels and untrusted workspaces are survived."""
from __future__ import annotations

import asyncio

import pytest
from lsprotocol import types as lsp

from fl_lsp_testing import as_dict

pytestmark = pytest.mark.asyncio

SINCOS = '''\
import torch


# fuselens: example(x=float32[64, 32])
@torch.compile
def sincos(x):
    return torch.sin(x) + torch.cos(x) * 2
'''


async def still_alive(session, uri):
    fns = as_dict(await session.request("fuselens/functions", {"uri": uri}))
    assert fns["documents"][0]["functions"]


async def test_compile_and_benchmark_with_example_comment(session):
    await session.init()
    uri = await session.open("sc.py", SINCOS)
    r = as_dict(await session.command(uri, "sincos"))
    assert r["ok"], r
    res = r["result"]
    assert res["check"]["ok"], res["check"]
    assert res["inputs"].startswith("comment on line 4")
    assert res["device"] == "cpu"
    assert "No GPU: times on the CPU" in res["timingNote"] and res["timings"]["cpu"]
    assert res["timings"]["eager"] and res["timings"]["fuselens"]
    from fuselens.codegen import cpp_build
    # no GPU: the kernels shown are those that ran and were checked, the CPU's C++ ones where there
    # is a C++ compiler (Triton's, in its interpreter, where there is none)
    language, marker = ("cpp", 'extern "C"') if cpp_build.compiler() else ("triton", "@triton.jit")
    kernels = [k for g in res["graphs"] for k in g["kernels"]]
    assert kernels and all(marker in k["source"] and k["language"] == language for k in kernels)
    # progress was reported and ended
    reports = [v for vs in session.client.progress_reports.values() for v in vs]
    assert any(isinstance(v, lsp.WorkDoneProgressBegin) for v in reports)
    assert any(isinstance(v, lsp.WorkDoneProgressEnd) for v in reports)
    kernels = "C++ kernels" if cpp_build.compiler() else "graphs as plain PyTorch"
    assert any("CPU times: eager" in m.message and kernels in m.message for m in session.client.messages)

    # the side panel's requests
    fns = as_dict(await session.request("fuselens/functions", {"uri": uri}))
    fn = fns["documents"][0]["functions"][0]
    assert fn["run"]["status"] == "ok"
    g0 = fn["run"]["graphs"][0]
    k = as_dict(await session.request("fuselens/kernel", {"uri": uri, "qualname": "sincos", "graph": g0["index"],
                                                         "kernel": g0["kernels"][0]["name"]}))
    assert marker in k["source"] and g0["kernels"][0]["language"] == language
    t = as_dict(await session.request("fuselens/transformedSource", {"uri": uri, "qualname": "sincos"}))
    assert "def " in t["source"]


async def test_cursor_position_picks_the_function(session):
    await session.init()
    uri = await session.open("sc2.py", SINCOS)
    r = as_dict(await session.command(uri, {"line": 6, "character": 8}))
    assert r["ok"] and r["qualname"] == "sincos"


async def test_inputs_recorded_from_main_block(session):
    src = '''\
    import torch


    @torch.compile
    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


    if __name__ == "__main__":
        open(__file__ + ".ran", "w").close()
        t = torch.randn(8, 16)
        print(gelu(t).shape)
        raise SystemExit("the rest of the block never runs")
    '''
    await session.init()
    uri = await session.open("gl.py", src)
    # unasked, the user's script is not run: the client is told it could be
    r = as_dict(await session.command(uri, "gelu"))
    assert not r["ok"] and r["canRunMain"] and "was not run" in r["message"], r
    assert not (session.root / "gl.py.ran").exists()
    r = as_dict(await session.command(uri, "gelu", {"runMain": True}))
    assert r["ok"], r
    assert (session.root / "gl.py.ran").exists()
    assert r["result"]["inputs"] == "recorded from the __main__ block"
    assert r["result"]["check"]["ok"]


async def test_inputs_recorded_from_a_pytest_test(session):
    lib = '''\
    import torch


    def softmax(x):
        e = torch.exp(x - x.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    '''
    test = '''\
    import torch
    from mylib import softmax


    def test_rows_sum_to_one():
        y = softmax(torch.randn(4, 10))
        assert torch.allclose(y.sum(-1), torch.ones(4))
    '''
    await session.init()
    (session.root / "tests").mkdir()
    (session.root / "tests" / "test_mylib.py").write_text(__import__("textwrap").dedent(test))
    uri = await session.open("mylib.py", lib)
    r = as_dict(await session.command(uri, "softmax"))
    assert r["ok"], r
    assert r["result"]["inputs"] == "recorded from test_mylib.py::test_rows_sum_to_one"


async def test_no_example_inputs_says_how_to_give_them(session):
    src = '''\
    import torch


    @torch.compile
    def f(x):
        return x * 2
    '''
    await session.init()
    uri = await session.open("noin.py", src)
    r = as_dict(await session.command(uri, "f"))
    assert not r["ok"] and r["status"] == "error"
    assert "# fuselens: example(" in r["message"]
    assert "__main__" in r["message"] and "pytest" in r["message"]


async def test_bad_example_comment_is_reported_with_its_line(session):
    src = SINCOS.replace("float32[64, 32]", "floaty[64]")
    await session.init()
    uri = await session.open("bad.py", src)
    r = as_dict(await session.command(uri, "sincos"))
    assert not r["ok"]
    assert "line 4" in r["message"] and "unknown dtype `floaty`" in r["message"]


async def test_untrusted_workspace_never_runs_code(session):
    marker = session.root / "ran.txt"
    src = SINCOS + f"\nopen({str(marker)!r}, 'w').write('ran')\n"
    await session.init(trusted=False)
    uri = await session.open("ut.py", src)
    r = as_dict(await session.command(uri, "sincos"))
    assert not r["ok"] and r["status"] == "untrusted"
    assert "trusted workspace" in r["error"]
    assert not marker.exists()
    # trust granted later (the client forwards it)
    session.client.protocol.notify("fuselens/setTrusted", {"trusted": True})
    r = as_dict(await session.command(uri, "sincos"))
    assert r["ok"], r
    assert marker.exists()


async def test_worker_that_hangs_is_stopped_at_the_time_limit(session):
    src = '''\
    import torch


    # fuselens: example(x=float32[4])
    @torch.compile
    def spin(x):
        while True:
            x = x + 1
    '''
    await session.init(settings={"worker": {"timeLimitSeconds": 8}})
    uri = await session.open("hang.py", src)
    r = as_dict(await session.command(uri, "spin"))
    assert r["status"] == "timeout"
    assert "time limit of 8 s" in r["message"]
    await still_alive(session, uri)


async def test_worker_that_crashes_is_reported(session):
    src = '''\
    import os
    import torch


    # fuselens: example(x=float32[4])
    @torch.compile
    def boom(x):
        y = x + 1
        print("about to crash")
        os.abort()
        return y
    '''
    await session.init()
    uri = await session.open("crash.py", src)
    r = as_dict(await session.command(uri, "boom"))
    assert r["status"] == "crashed"
    assert "SIGABRT" in r["message"] and "about to crash" in r["message"]
    await still_alive(session, uri)


@pytest.mark.parametrize("client_token", [False, True])
async def test_cancel_stops_the_worker(session, client_token):
    """The server's own progress token, or the client's (its notification shows Cancel from the start)."""
    src = '''\
    import time
    import torch


    # fuselens: example(x=float32[4])
    def slow(x):
        time.sleep(600)
        return torch.relu(x)
    '''
    await session.init()
    uri = await session.open("slow.py", src)
    if client_token:
        session.client.progress_reports["mine"] = []  # the client made it: pytest-lsp knows it
        task = asyncio.ensure_future(session.command(uri, "slow", {"progressToken": "mine"}))
    else:
        task = asyncio.ensure_future(session.command(uri, "slow"))
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while not any(session.client.progress_reports.values()) and loop.time() < end:
        await asyncio.sleep(0.05)
    (token,) = session.client.progress_reports
    assert token == "mine" or not client_token
    assert isinstance(session.client.progress_reports[token][0], lsp.WorkDoneProgressBegin)
    await asyncio.sleep(1.0)
    session.client.window_work_done_progress_cancel(lsp.WorkDoneProgressCancelParams(token=token))
    r = as_dict(await asyncio.wait_for(task, 30))
    assert r["status"] == "cancelled"
    await still_alive(session, uri)


async def test_module_forward_with_main_block_and_with_comment(session):
    src = '''\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Net(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = nn.Linear(d, d)

        def forward(self, x):
            return F.gelu(self.lin(x)) + x


    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        # fuselens: example(x=float32[4, 8])
        def forward(self, x):
            return torch.relu(x * self.w)


    model = torch.compile(Net(16))
    scale = torch.compile(Scale())

    if __name__ == "__main__":
        print(model(torch.randn(4, 16)).shape)
    '''
    await session.init()
    uri = await session.open("net.py", src)
    r = as_dict(await session.command(uri, "Net.forward", {"runMain": True}))
    assert r["ok"], r
    assert r["result"]["inputs"] == "recorded from the __main__ block" and r["result"]["check"]["ok"]
    r = as_dict(await session.command(uri, "Scale.forward"))
    assert r["ok"], r
    assert r["result"]["inputs"].startswith("comment on line 20") and r["result"]["check"]["ok"]


async def test_runs_of_the_last_window_are_shown_again(session):
    """The client keeps the last runs (workspaceState) and gives them back after a window reload."""
    uri = session.uri("sc.py")
    kernel = {"name": "k0", "source": "@triton.jit\ndef k0(x):\n    pass", "timeMs": None, "share": None,
              "bandwidthGBs": None}
    saved = {"ok": True, "status": "ok", "qualname": "sincos", "uri": uri, "message": "1 graph",
             "result": {"graphs": [{"index": 0, "ir": "graph()", "kernels": [kernel]}],
                        "transformedSource": "def sincos(x):\n    return __fl_graph_0(x)[0]"}}
    await session.init(runs=[saved, {"qualname": "no uri"}])
    await session.open("sc.py", SINCOS)
    (fn,) = as_dict(await session.request("fuselens/functions", {"uri": uri}))["documents"][0]["functions"]
    assert fn["run"]["status"] == "ok" and fn["run"]["restored"]
    assert fn["run"]["graphs"][0]["kernels"][0]["name"] == "k0"
    k = as_dict(await session.request("fuselens/kernel", {"uri": uri, "qualname": "sincos", "graph": 0,
                                                         "kernel": "k0"}))
    assert k["source"].startswith("@triton.jit")
    t = as_dict(await session.request("fuselens/transformedSource", {"uri": uri, "qualname": "sincos"}))
    header, code = t["source"].split("\n\n", 1)
    assert "__fl_graph_0  runs a compiled graph" in header  # the compiler's names explained
    assert code == saved["result"]["transformedSource"]


async def test_a_restored_run_brings_back_its_breaks_while_its_file_is_unchanged(session):
    """A run restored after a reload: its breaks and counts are the "as run" ones again, until an
    edit; a run on a file changed since is shown marked stale, without them."""
    path = session.root / "sc.py"
    path.write_text(SINCOS)
    uri = path.as_uri()
    line = SINCOS.splitlines().index("    return torch.sin(x) + torch.cos(x) * 2")
    brk = {"code": "FL100", "title": "print() in a compiled function", "explanation": "it prints.", "hint": "",
           "docUrl": None, "torchCode": None, "function": "sincos", "filename": str(path), "stack": [],
           "line": line, "col": 11, "endLine": line, "endCol": 24}
    saved = {"ok": True, "status": "ok", "qualname": "sincos", "uri": uri, "message": "2 graphs",
             "result": {"graphs": [], "graphCount": 2, "breaks": [brk]}}
    stale = {**saved, "qualname": "other", "stale": True}
    await session.init(runs=[saved, stale])
    # published for the file before it opens (Problems lists closed files), and again after
    for opened in (False, True):
        if opened:
            await session.open("sc.py", SINCOS, save=False)
        seen = [d for d in await session.diagnostics(uri) if (d.data or {}).get("seenAtRunTime")]
        assert [(d.code, d.range.start.line) for d in seen] == [("FL100", line)], opened
    lenses = await session.client.text_document_code_lens_async(
        lsp.CodeLensParams(text_document=lsp.TextDocumentIdentifier(uri=uri)))
    assert "fuselens: 2 graphs, 1 graph break (as run)" in [l.command.title for l in lenses]
    (fn,) = as_dict(await session.request("fuselens/functions", {"uri": uri}))["documents"][0]["functions"]
    assert fn["asRun"] and fn["run"]["restored"] and not fn["run"]["stale"]
    # an edit: the analysis' own results again
    await session.change(uri, SINCOS + "\n")
    assert not [d for d in session.client.diagnostics[uri] if (d.data or {}).get("seenAtRunTime")]
