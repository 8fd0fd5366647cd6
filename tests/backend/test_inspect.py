"""`fuselens.inspect`: plain data about what a compiled function became (what the editor reads)."""
from __future__ import annotations

import dataclasses

import torch

import fuselens
from fuselens.inspect import Entry, Graph, Kernel


def _two_graphs(x, w):
    y = x * w
    z = y.sin() + 1
    print("a break")
    return z.sum(-1), x.cos()


def test_inspect_returns_plain_dataclasses_with_bytes_moved_and_source_lines():
    cf = fuselens.compile(_two_graphs)
    x, w = torch.randn(8, 16), torch.randn(16)
    cf(x, w)
    entries = fuselens.inspect(cf)
    assert all(isinstance(e, Entry) for e in entries) and len(entries) == 2
    assert entries[0].graph_break.code == "FL100" and entries[1].graph_break is None
    kernels = [k for e in entries for k in e.kernels]
    assert kernels and all(isinstance(k, Kernel) for k in kernels)
    first = entries[0].graphs[0]
    assert isinstance(first, Graph) and first.op_count == 3 and "sin" in first.ir
    # the first kernel reads x (8x16) and w (16) and writes z (8x16), all float32
    (k,) = first.kernels
    assert k.bytes_moved == (8 * 16 + 16 + 8 * 16) * 4
    lines = {line for _, line in k.source_lines}
    first_line = _two_graphs.__code__.co_firstlineno
    assert lines == {first_line + 1, first_line + 2}
    assert {p.line for p in k.provenance} <= lines and k.provenance
    # each provenance entry is a kernel line the codegen marked with that source line
    kernel_lines = k.source.split("\n")
    assert all(f"test_inspect.py:{p.line}" in kernel_lines[p.kernel_line] for p in k.provenance)
    # plain data: every field converts to builtins (no runtime objects inside)
    for e in entries:
        d = dataclasses.asdict(e)
        assert isinstance(d["graphs"][0]["kernels"][0]["bytes_moved"], int)
