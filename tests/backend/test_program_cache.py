"""The program cache (backend/program_cache.py): a second process that captures the same graphs
loads their programs instead of compiling them, with the results of the first; a graph that
differs in anything that decides its compile (an op's argument, a dtype, requires_grad, the grad
mode) compiles; an entry that cannot be read is ignored and written again.

The processes (this file run as a script) compile a model, run it (and its backward when
training) and write outputs, gradients and the backend's counters (stats.py)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fl_backend_testing import DEVICE

ROOT = Path(__file__).resolve().parents[2]


def convnet():
    """A small ResNet-like net: conv, BatchNorm, residual blocks, pooling, a linear head."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))
    # (max pooling: `F.max_pool2d` is a function torch makes and renames, named by its module's attribute)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          Block(8), Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    return model, dict(input=torch.randn(2, 3, 16, 16))


def make(name):
    torch.manual_seed(0)
    if name == "convnet":
        return convnet()
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import hf_zoo
    import transformers
    transformers.logging.set_verbosity_error()
    return hf_zoo.make(name, dropout=False)


def run(model, inputs, train, owner=None):
    """(outputs, gradients of `owner`'s parameters (the model's)): the first output's mean square as the loss."""
    model.train(train)
    with torch.set_grad_enabled(train):
        out = model(**inputs)
        first = out if isinstance(out, torch.Tensor) else out[0]
        if train:
            first.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in (owner or model).named_parameters() if p.grad is not None}
    return first.detach(), grads


def child(name, mode, out_path):
    import fuselens
    from fuselens import stats
    model, inputs = make(name)
    reference = run(model, inputs, mode == "train")
    model.zero_grad()
    for buffer, value in zip(model.buffers(), make(name)[0].buffers()):  # BatchNorm's statistics as before
        buffer.copy_(value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fuselens.FuselensWarning)
        result = run(fuselens.compile(model), inputs, mode == "train", model)
    torch.save(dict(result=result, reference=reference, stats=dict(stats.backend),
                    warnings=[str(w.message) for w in caught if issubclass(w.category, fuselens.FuselensWarning)]),
               out_path)


def processes(tmp_path, name, mode, count, tag):
    """`count` processes at once on the cache in tmp_path: what each wrote."""
    env = dict(os.environ, FUSELENS_INTERPRET="1", TRITON_INTERPRET="1", FUSELENS_PROGRAM_CACHE="1",
               FUSELENS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT / "compiler"))
    outs = [tmp_path / f"{tag}{i}.pt" for i in range(count)]
    procs = [subprocess.Popen([sys.executable, __file__, name, mode, str(out)], env=env, stderr=subprocess.PIPE,
                              text=True) for out in outs]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    return [torch.load(out) for out in outs]


def assert_equal_to_eager(res):
    assert res["warnings"] == []  # nothing ran eagerly in place of its program
    (out, grads), (ref_out, ref_grads) = res["result"], res["reference"]
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("name,mode,concurrent", [("convnet", "train", 2), ("convnet", "eval", 1),
                                                  ("gpt2-labels", "train", 1), ("vit", "eval", 1)])
def test_second_process_loads_programs(tmp_path, name, mode, concurrent):
    # cold processes (two at once: each compiles what the other has not stored yet, both may store
    # the same entries), then a warm one
    cold = processes(tmp_path, name, mode, concurrent, "cold")
    warm, = processes(tmp_path, name, mode, 1, "warm")
    programs = cold[0]["stats"]["compiles"] + cold[0]["stats"]["cache_hits"]
    assert programs > 0
    for res in cold:
        assert res["stats"]["compiles"] + res["stats"]["cache_hits"] == programs
    assert sum(res["stats"]["compiles"] for res in cold) >= programs
    assert warm["stats"]["compiles"] == 0 and warm["stats"]["cache_hits"] == programs
    # nor a backward program (gpt2-labels: its logits get no gradient beside the loss, a backward
    # without their terms, compiled in the cold process on the first backward)
    assert warm["stats"]["backward_layouts"] == 0
    for res in cold + [warm]:
        assert_equal_to_eager(res)
    # a loaded program computes what the compiled one did, bit for bit
    (out, grads), (cold_out, cold_grads) = warm["result"], cold[0]["result"]
    assert torch.equal(out, cold_out)
    assert all(torch.equal(grads[n], cold_grads[n]) for n in grads)


# -- in one process: what hits and what misses --------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    from fuselens import stats
    monkeypatch.setenv("FUSELENS_PROGRAM_CACHE", "1")
    monkeypatch.setenv("FUSELENS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(stats, "backend", dict.fromkeys(stats.backend, 0))
    return tmp_path / "programs"


def scale(x, w):
    return torch.tanh(x @ w) * 2.0


def scale3(x, w):
    return torch.tanh(x @ w) * 3.0


def compiled_call(fn, *args, grad=True):
    """`fn` compiled afresh (a new capture, a new backend compile or load), called, its backward run."""
    import fuselens
    args = [a.detach().requires_grad_(a.requires_grad) for a in args]
    with torch.set_grad_enabled(grad):
        out = fuselens.compile(fn)(*args)
    if out.requires_grad:
        out.sum().backward()
    eager_args = [a.detach().requires_grad_(a.requires_grad) for a in args]
    with torch.set_grad_enabled(grad):
        expected = fn(*eager_args)
    torch.testing.assert_close(out, expected)
    if expected.requires_grad:
        expected.sum().backward()
        for a, e in zip(args, eager_args):
            torch.testing.assert_close(a.grad, e.grad)


def counts():
    from fuselens import stats
    return stats.backend["compiles"], stats.backend["cache_hits"]


# on the device the backend runs kernels on: CPU tensors run eagerly where Triton does not interpret
X, W = torch.randn(4, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE, requires_grad=True)


@pytest.mark.parametrize("fn,args,grad", [
    (scale3, (X, W), True),  # another constant in the graph
    (scale, (X.double(), W.detach().double().requires_grad_()), True),  # another dtype
    (scale, (X, W.detach()), True),  # no input requires grad: inference programs
    (scale, (X, W), False),  # grad mode off
    (scale, (X.t().contiguous().t(), W), True),  # another stride
    (scale, (torch.randn(5, 8, device=DEVICE), W), True),  # another shape
], ids=["constant", "dtype", "requires_grad", "grad_mode", "stride", "shape"])
def test_what_differs_compiles(cache, fn, args, grad):
    compiled_call(scale, X, W)
    compiled_call(scale, X, W)
    assert counts() == (1, 1)  # the same graph, compiled afresh: loaded
    compiled_call(fn, *args, grad=grad)
    assert counts() == (2, 1)
    compiled_call(fn, *args, grad=grad)
    assert counts() == (2, 2)


def test_a_loaded_training_program_runs_no_check_step(cache, monkeypatch):
    # a new training program runs both halves once before its first step (a kernel that fails
    # then still has the graph to fall back to); one loaded from the cache ran that check, and a
    # step, in the process that stored it: its first call is the step alone
    from fuselens.backend import driver
    checks = []
    real = driver.compile_training

    def counting(*args, **kwargs):
        run, first_run, programs, made = real(*args, **kwargs)
        return run, (lambda *xs: checks.append(1) or first_run(*xs)), programs, made
    monkeypatch.setattr(driver, "compile_training", counting)
    compiled_call(scale, X, W)
    compiled_call(scale, X, W)
    assert counts() == (1, 1) and len(checks) == 1


def test_a_fuselens_variable_set_after_a_compile_compiles_again(cache, monkeypatch):
    # the variables are part of the key as they are at each compile, not as at the process's first
    compiled_call(scale, X, W)
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    compiled_call(scale, X, W)
    assert counts() == (2, 0)
    compiled_call(scale, X, W)
    assert counts() == (2, 1)


@pytest.mark.parametrize("corrupt", [
    lambda b: b[:len(b) // 2],  # a write cut short
    lambda b: b[:-20] + bytes(20),  # contents changed under their checksum
    lambda b: b"not an entry",
    lambda b: b.replace(b"fuselens-program-", b"fuselens-program-0"),  # another format
], ids=["truncated", "checksum", "garbage", "format"])
def test_unreadable_entry_compiles_and_is_written_again(cache, caplog, corrupt):
    compiled_call(scale, X, W)
    entry, = cache.iterdir()
    entry.write_bytes(corrupt(entry.read_bytes()))
    with caplog.at_level(logging.DEBUG, logger="fuselens.runtime"):
        compiled_call(scale, X, W)
    assert counts() == (2, 0)
    assert any("ignored" in r.getMessage() for r in caplog.records)
    compiled_call(scale, X, W)
    assert counts() == (2, 1)


def test_entry_of_another_kind_compiles(cache):
    """An entry that loads but is not what this compile needs (an inference program where a
    training one is expected) is ignored."""
    compiled_call(scale, X, W.detach())  # inference
    inference, = cache.iterdir()
    compiled_call(scale, X, W)  # training: another key
    training, = set(cache.iterdir()) - {inference}
    training.write_bytes(inference.read_bytes())
    compiled_call(scale, X, W)
    assert counts() == (3, 0)


def test_cache_off(cache, monkeypatch):
    monkeypatch.setenv("FUSELENS_PROGRAM_CACHE", "0")
    compiled_call(scale, X, W)
    compiled_call(scale, X, W)
    assert counts() == (2, 0) and not cache.exists()


def test_cache_directory_unusable(cache, recwarn):
    """Where entries cannot be written (the directory is a file), graphs compile, and nothing warns."""
    import fuselens
    cache.write_text("")
    compiled_call(scale, X, W)
    compiled_call(scale, X, W)
    assert counts() == (2, 0)
    assert not [w for w in recwarn if issubclass(w.category, fuselens.FuselensWarning)]


def test_graph_without_stable_name_is_not_stored(cache):
    """A target no other process can name (a lambda): compiled every time, never stored."""
    import torch.fx as fx
    from fuselens.backend import program_cache
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(lambda t: t * 2, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert program_cache.key(gm, [torch.randn(3)], "default", None) is None



def test_torch_functions_have_stable_names():
    """Every Python function of torch.nn.functional names itself in a key, those torch makes inside
    a helper and renames (`boolean_dispatch`'s max pooling) included: a graph calling one was
    never stored, so every process compiled it again."""
    import types

    import torch.nn.functional as F
    from fuselens.backend import program_cache
    functions = [f for f in vars(F).values() if isinstance(f, types.FunctionType) and f.__module__ == F.__name__]
    assert F.max_pool2d in functions and len(functions) > 100
    for f in functions:
        program_cache._canonical(f)  # raises Unstable where it has no stable name


if __name__ == "__main__":
    child(*sys.argv[1:])


def test_a_loaded_program_launches_as_the_built_one():
    """A program loaded from the cache binds its kernels' launch functions as the built one does:
    each kernel knows the sizes of its call in the wrapper. Without them, every launch of a warm
    process took the slow path, finding its launch function again (a GPT-2 training step: 777
    launches through `run`)."""
    from fuselens.ops.trace import to_primitive_graph
    from fuselens.backend.driver import build_program, load_program
    gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x * 2, -1).sum(0) + 1)
    built = build_program(to_primitive_graph(gm, [torch.randn(8, 32)], "cpu"), "cpu")
    loaded = load_program(built.made_from)

    def call_sizes(program):
        return {name: k.call_sizes for name, k in program.call.__globals__.items() if name.startswith("fl_")}
    assert len(call_sizes(built)) >= 2 and all(call_sizes(built).values())
    assert call_sizes(loaded) == call_sizes(built)


def test_a_traceback_through_a_wrapper_shows_its_line():
    """A wrapper's code is compiled under a name of its own that linecache knows, in the process
    that built it and in one that loads it from the cache: an error raised in it (a kernel's fault
    on a GPU) shows the launch or extern call that raised, not `<fuselens wrapper>` line N."""
    import linecache
    import traceback
    from fuselens.ops.trace import to_primitive_graph
    from fuselens.backend.driver import build_program, load_program
    gm = torch.fx.symbolic_trace(lambda x: torch.softmax(x * 2, -1).sum(0) + 1)
    built = build_program(to_primitive_graph(gm, [torch.randn(8, 32)], "cpu"), "cpu")
    name = built.call.__code__.co_filename
    linecache.cache.pop(name)  # (as in a process that did not build it)
    loaded = load_program(built.made_from)
    assert loaded.call.__code__.co_filename == name
    assert [linecache.getline(name, i + 1) for i in range(3)] == built.wrapper_source.splitlines(True)[:3]
    with pytest.raises(Exception) as raised:
        loaded(None)  # (any error raised through the wrapper)
    text = "".join(traceback.format_exception(raised.value))
    assert name in text and any(line.strip() and line.strip() in text
                                for line in built.wrapper_source.splitlines() if line.startswith("    "))
    # and the fall-back's warning (or the note on eager's error after a fault) names that line
    from fuselens.errors import fallback_message
    message = fallback_message("the backend", "g", raised.value)
    assert f"at {name} line " in message and any(line.strip()[:200] in message
                                                  for line in built.wrapper_source.splitlines() if line.startswith("    "))
