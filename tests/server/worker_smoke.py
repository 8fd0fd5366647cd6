"""Runs the Compile & benchmark worker directly (no server) on functions of a file and prints
what the side panel would show. Used to check the GPU path on a machine with a GPU:

    PYTHONPATH=server:compiler python3 tests/server/worker_smoke.py FILE QUALNAME [QUALNAME ...]
"""
from __future__ import annotations

import asyncio
import ast
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "server"))
from fuselens_lsp.jobs import run_worker  # noqa: E402


def def_line(source, qualname):
    tree = ast.parse(source)
    parts = qualname.split(".")
    body = tree.body
    node = None
    for p in parts:
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == p)
        body = node.body
    return node.lineno


async def main(path, names):
    source = open(path).read()
    results = {}
    for q in names:
        job = {"path": os.path.abspath(path), "source": source, "qualname": q, "def_line": def_line(source, q),
               "discovery": ["comment", "main"], "roots": [os.path.dirname(os.path.abspath(path))], "tests": []}
        out = await run_worker(job, time_limit=300, on_progress=lambda m, p: print(f"  .. {m}", flush=True))
        print(f"== {q}: {out.status}: {out.message if out.status != 'ok' else ''}")
        r = out.result or {}
        if r:
            print(f"   inputs: {r.get('inputs')}  device: {r.get('device')} {r.get('gpu') or ''}")
            print(f"   check: {r.get('check')}")
            print(f"   timings: {r.get('timings')}  speedup: {r.get('speedup')}")
            for g in r.get("graphs", []):
                for k in g["kernels"]:
                    print(f"   graph {g['index']}: {k['name']}: time {k['timeMs']} share {k['share']} "
                          f"bw {k['bandwidthGBs']} bytes {k['bytes']} provenance lines {len(k['provenance'])}")
        if out.status != "ok":
            print(out.stderr_tail[-3000:])
        results[q] = {"status": out.status, "message": out.message, "result": r}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "worker_smoke.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
