"""What a Compile & benchmark run reports where a plain comparison or timing would mislead:
random ops (dropout) and a machine without a GPU. The worker's job, run in this process."""
from __future__ import annotations

import textwrap

import pytest

NET = '''\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    # fuselens: example(x=float32[8, 16])
    def forward(self, x):
        return self.drop(torch.relu(self.lin(x)))
'''


@pytest.fixture
def run_job(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSELENS_INTERPRET", "1")
    import torch
    from fuselens_lsp import worker
    monkeypatch.setattr(worker, "progress", lambda *a, **k: None)
    # torch.compile's CPU compile takes tens of seconds: its failure path is what is checked here
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))

    def run(src, qualname):
        path = tmp_path / "net.py"
        path.write_text(textwrap.dedent(src))
        line = next(i for i, t in enumerate(src.splitlines(), 1) if f"def {qualname.split('.')[-1]}(" in t)
        return worker.run_job({"path": str(path), "source": path.read_text(), "qualname": qualname,
                               "def_line": line, "discovery": ["comment"], "roots": [], "tests": []})
    return run


def test_dropout_difference_is_explained_and_checked_in_eval_mode(run_job):
    r = run_job(NET, "Net.forward")
    c = r["check"]
    assert c["randomOps"] and "dropout" in c["randomOps"][0], c
    assert c["evalMode"] and c["ok"], c
    assert "random ops" in c["message"] and "in eval mode (no random ops) it matches eager" in c["message"]
    # the graphs shown are the run's, not the eval-mode check's too, nor is its eval mode a recompile
    assert len(r["graphs"]) == r["graphCount"] == 1
    assert r["recompiles"] == [], r["recompiles"]


def test_without_a_gpu_eager_and_fuselens_graphs_are_timed_on_the_cpu(run_job):
    r = run_job(NET.replace("nn.Dropout(0.5)", "nn.Identity()"), "Net.forward")
    assert r["check"]["ok"] and "randomOps" not in r["check"]
    t = r["timings"]
    assert t["cpu"] and t["eager"] > 0 and t["fuselens"] > 0, t
    assert t["torchCompileError"] == "RuntimeError: no C++ compiler"
    from fuselens.codegen import cpp_build
    kernels = "C++ kernels" if cpp_build.compiler() else "plain PyTorch"
    assert kernels in r["timingNote"] and "speedup" not in r


COUNTER = '''\
import torch

CALLS = [0]


# fuselens: example(x=float32[8])
def scaled(x):
    CALLS[0] += 1
    return x * CALLS[0]
'''


def test_recompiles_during_the_run_are_reported(run_job, monkeypatch):
    """A value read as a constant that changes on every call (a global counter) recompiles the
    function as the timing loop calls it: the run says so, with the guard that failed."""
    from fuselens.runtime import compiled
    # the timing loop's calls past its first five depend on the machine's load (each call here
    # builds a kernel): a lower limit is reached within those five
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 3)
    r = run_job(COUNTER, "scaled")
    assert r["recompiles"], r
    # the guard as the code spells it, not as capture names the function's globals
    assert all(rc["function"] == "scaled" and rc["because"].startswith("CALLS[0] == ") for rc in r["recompiles"]), \
        r["recompiles"]
    assert "recompile limit" in r["recompileLimit"], r["recompileLimit"]
    assert r["recompiles"][0]["text"] == f"recompiled scaled because {r['recompiles'][0]['because']} failed"
    clean = run_job(COUNTER.replace("    CALLS[0] += 1\n", "").replace("x * CALLS[0]", "x * 2"), "scaled")
    assert clean["recompiles"] == [] and clean["recompileLimit"] is None
