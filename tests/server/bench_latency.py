"""Benchmark (not a test): how long after an edit a 3,000-line file gets its diagnostics.

Starts the real server (`python -m fuselens_lsp`), opens a generated file of torch code
(compiled functions with graph breaks, helpers, nn.Modules, loops), then edits it and
measures, on the client side, the time from sending `didChange` to receiving the
`publishDiagnostics` for that version (debounce included). Also measures the analysis alone,
in-process, of the whole file and of an edit with the per-function cache (incremental.py).
Target: p90 edit → diagnostics <= 150 ms, on a loaded machine.

    .venv/bin/python tests/server/bench_latency.py [--edits 40] [--lines 3000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types as lsp
from pygls.lsp.client import BaseLanguageClient

BLOCKS = [
    '''
@torch.compile
def fn_{i}(x, w):
    y = torch.tanh(x @ w) * 0.5
    z = y.sum(dim=-1, keepdim=True)
    print("fn_{i}", z.shape)
    s = z.mean().item()
    out = y * s + x
    return out.relu()

''',
    '''
def helper_{i}(x):
    a = x.exp()
    b = a / a.sum(dim=-1, keepdim=True)
    if b.max() > 0.9:
        b = b * 0.5
    return b

''',
    '''
@fuselens.compile
def loop_{i}(x, n: int = 4):
    acc = torch.zeros_like(x)
    for k in range(4):
        acc = acc + torch.sin(x * k)
    if acc.sum() > 0:
        acc = acc - 1
    return helper_{j}(acc)

''',
    '''
class Block{i}(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(self.lin(x))
        if h.mean() > 0:
            h = F.gelu(h)
        return x + h

''',
]


def make_source(lines_target: int = 500) -> str:
    head = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nimport fuselens\n\n"
    parts, i = [head], 0
    while sum(p.count("\n") for p in parts) < lines_target - 12:
        parts.append(BLOCKS[i % len(BLOCKS)].format(i=i, j=max(i - 1, 1) // 4 * 4 + 1))
        i += 1
    parts.append("\nmodel = torch.compile(Block3(64))\n")
    src = "".join(parts)
    n = src.count("\n")
    return src + "\n" * max(0, lines_target - n)


async def main(n_edits: int, n_lines: int) -> int:
    src = make_source(n_lines)
    nlines = src.count("\n")
    tmp = Path(tempfile.mkdtemp())
    path = tmp / "big.py"
    path.write_text(src)
    uri = path.as_uri()

    # analysis alone, in-process (the server runs the same function in a thread)
    from fuselens_lsp.analysis import Settings, analyze
    analyze(src, uri, str(path), 0, Settings())  # warm imports
    alone = []
    for _ in range(5):
        t = time.perf_counter()
        res = analyze(src, uri, str(path), 0, Settings())
        alone.append((time.perf_counter() - t) * 1000)
    from fuselens_lsp.incremental import IncrementalAnalyzer
    cache = IncrementalAnalyzer()
    analyze(src, uri, str(path), 0, Settings(), cache)
    one_fn = []
    src_lines = src.split("\n")
    stmt = [i for i, t in enumerate(src_lines) if t.startswith("    ") and "=" in t]
    for k in range(10):
        ln = stmt[(k * 13) % len(stmt)]
        edited = "\n".join(src_lines[:ln] + [src_lines[ln] + " + 1"] + src_lines[ln + 1:])
        t = time.perf_counter()
        analyze(edited, uri, str(path), 0, Settings(), cache)
        one_fn.append((time.perf_counter() - t) * 1000)

    client = BaseLanguageClient("fuselens-bench", "0")
    got: dict[int, float] = {}
    waiters: dict[int, asyncio.Future] = {}

    @client.feature(lsp.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diags(ls, params: lsp.PublishDiagnosticsParams):
        got[params.version] = time.perf_counter()
        fut = waiters.pop(params.version, None)
        if fut is not None and not fut.done():
            fut.set_result(len(params.diagnostics))

    @client.feature("fuselens/didChange")
    def on_change(ls, params):
        pass

    here = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here / "server"), str(here / "compiler")])}
    await client.start_io(sys.executable, "-m", "fuselens_lsp", env=env)
    await client.initialize_async(lsp.InitializeParams(
        capabilities=lsp.ClientCapabilities(), root_uri=tmp.as_uri(),
        initialization_options={"trusted": False}))
    client.initialized(lsp.InitializedParams())
    loop = asyncio.get_running_loop()

    def expect(version):
        fut = loop.create_future()
        waiters[version] = fut
        return fut

    fut = expect(1)
    t0 = time.perf_counter()
    client.text_document_did_open(lsp.DidOpenTextDocumentParams(
        text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=src)))
    n_diags = await asyncio.wait_for(fut, 120)
    first = (time.perf_counter() - t0) * 1000

    lines = src.split("\n")
    body_lines = [i for i, t in enumerate(lines) if t.startswith("    ") and "=" in t]
    latencies = []
    version = 1
    for k in range(n_edits):
        version += 1
        ln = body_lines[(k * 7) % len(body_lines)]
        # type a character at the end of a statement line, then (next round) remove it
        new_text = "1" if k % 2 == 0 else ""
        col = len(lines[ln])
        rng = lsp.Range(start=lsp.Position(line=ln, character=col),
                        end=lsp.Position(line=ln, character=col if k % 2 == 0 else col))
        if k % 2 == 1:
            prev_ln = body_lines[((k - 1) * 7) % len(body_lines)]
            rng = lsp.Range(start=lsp.Position(line=prev_ln, character=len(lines[prev_ln])),
                            end=lsp.Position(line=prev_ln, character=len(lines[prev_ln]) + 1))
        fut = expect(version)
        t = time.perf_counter()
        client.text_document_did_change(lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[lsp.TextDocumentContentChangePartial(range=rng, text=new_text)]))
        await asyncio.wait_for(fut, 60)
        latencies.append((got[version] - t) * 1000)
        await asyncio.sleep(0.05)

    # a typing burst: 8 keystrokes 30 ms apart; time from the last one to its diagnostics
    bursts = []
    for b in range(5):
        ln = body_lines[(b * 11) % len(body_lines)]
        base = len(lines[ln])
        for c in range(8):
            version += 1
            client.text_document_did_change(lsp.DidChangeTextDocumentParams(
                text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=version),
                content_changes=[lsp.TextDocumentContentChangePartial(
                    range=lsp.Range(start=lsp.Position(line=ln, character=base + c),
                                    end=lsp.Position(line=ln, character=base + c)), text="#" if c == 0 else "x")]))
            if c < 7:
                await asyncio.sleep(0.03)
        fut = expect(version)
        t = time.perf_counter()
        await asyncio.wait_for(fut, 60)
        bursts.append((got[version] - t) * 1000)
        version += 1
        client.text_document_did_change(lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[lsp.TextDocumentContentChangePartial(
                range=lsp.Range(start=lsp.Position(line=ln, character=base),
                                end=lsp.Position(line=ln, character=base + 8)), text="")]))
        fut = expect(version)
        await asyncio.wait_for(fut, 60)

    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()

    def summary(xs):
        xs = sorted(xs)
        return (f"median {statistics.median(xs):6.1f} ms   p90 {xs[int(len(xs) * 0.9) - 1]:6.1f} ms   "
                f"max {xs[-1]:6.1f} ms   (n={len(xs)})")
    print(f"file: {nlines} lines, {len(res.functions)} analysed functions, {n_diags} diagnostics")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"analysis alone (in-process):          {summary(alone)}")
    print(f"one function edited, cached (in-proc): {summary(one_fn)}")
    print(f"open → diagnostics (server cold):     {first:6.1f} ms")
    print(f"edit → diagnostics (50 ms debounce):  {summary(latencies)}")
    print(f"last keystroke of a burst → diags:    {summary(bursts)}")
    p90 = sorted(latencies)[int(len(latencies) * 0.9) - 1]
    ok = p90 <= 150
    print("target (p90 <= 150 ms):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--edits", type=int, default=40)
    ap.add_argument("--lines", type=int, default=3000)
    a = ap.parse_args()
    sys.exit(asyncio.run(main(a.edits, a.lines)))
