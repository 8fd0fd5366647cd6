"""Helpers for the backend tests: trace a function to the capture contract's FX graph, compile
it with the backend, and compare results and gradients with eager."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
import warnings

import pytest
import torch
import torch.fx as fx

from fuselens.backend.driver import compile_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from numerics import ulp_error  # noqa: E402,F401 - the numerics contract's measure, for the tests

DEVICE = "cuda" if os.environ.get("FUSELENS_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"
# a wrapper's attention call: torch's (an extern `sdpa`) or fuselens's decode kernel (codegen/attention.py)
SDPA = r"(?:prims\.sdpa|decode_attention)\("
# the CPU kernels are generated C++ (FUSELENS_CPU_BACKEND=cpp: `make test`'s second pass), not Triton's
CPP = DEVICE == "cpu" and os.environ.get("FUSELENS_CPU_BACKEND") == "cpp"
# a test of what the Triton kernels look like or how they are launched
triton_kernels = pytest.mark.skipif(CPP, reason="inspects Triton kernels: the CPU kernels are C++ here")

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class _LocTracer(fx.Tracer):
    """Records every node's Python stack (not only frames named `forward`)."""
    record_stack_traces = True

    def _filter_traceback_frames(self, summary):
        return summary


def trace(fn) -> fx.GraphModule:
    """symbolic_trace, plus what capture puts on nodes: meta["loc"] from the traced source line
    (meta["val"]/meta["device"] are filled by `compile` below)."""
    graph = _LocTracer().trace(fn)
    source_file = fn.__code__.co_filename
    for node in graph.nodes:
        frames = _FRAME.findall(node.stack_trace or "")
        mine = [(f, int(line)) for f, line in frames if f == source_file]
        if mine:
            f, line = mine[-1]
            node.meta["loc"] = (f, line, 0, line, 0)
    return fx.GraphModule(torch.nn.Module(), graph)


def compile(fn, *inputs, **kwargs):
    """`fn` (a function, traced, or a traced graph) compiled for `inputs`."""
    gm = fn if isinstance(fn, fx.GraphModule) else trace(fn)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, t in zip(placeholders, inputs):
        node.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        node.meta["device"] = t.device
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an eager fallback is a failure unless a test expects it
        return compile_graph(gm, list(inputs), **kwargs)


def run(fn, *inputs, **kwargs):
    """(compiled graph, its outputs); a failing kernel would have warned and fallen back: an error here."""
    cg = compile(fn, *inputs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cg(*inputs)
    return cg, out


def exact_fp32_convolutions():
    """fp32 convolutions without TF32 (cuDNN's default): eager's and the compiled convolutions may run
    different algorithms (NCHW and channels-last, conv1d and conv2d over one row), which TF32 makes
    differ by ~1e-3. (The flags() context: torch's testing module, imported by other tests, forbids
    setting them.)"""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                       allow_tf32=False)


def tolerance(dtype):
    # half types: an op's fp32 result may differ from ATen's in its last bits (tl.exp, the order of a
    # VJP's products), which can flip its rounding to the half type
    return {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}.get(
        dtype, dict(atol=1e-5, rtol=1e-4))


def check(fn, *inputs, grad=True, **tol):
    """Forward (and, for float inputs, gradients) of the compiled graph equal eager's."""
    inputs = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    expected = fn(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    cg, got = run(fn, *inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **(tol or tolerance(e.dtype)), equal_nan=True)
    wrt = [t for t in inputs if t.requires_grad]
    outs = [(g, e) for g, e in zip(got, expected) if e.requires_grad]
    if wrt and outs:
        cotangents = [torch.randn_like(e) for _, e in outs]
        got_grads = torch.autograd.grad([g for g, _ in outs], wrt, cotangents, allow_unused=True)
        exp_grads = torch.autograd.grad([e for _, e in outs], wrt, cotangents, allow_unused=True)
        for g, e, t in zip(got_grads, exp_grads, wrt):
            if e is None:
                assert g is None or not g.any()
                continue
            torch.testing.assert_close(g, e, **(tol or tolerance(t.dtype)), equal_nan=True)
    return cg


def vary_batch_norm(bn):
    """A BatchNorm's running statistics and affine parameters set to values other than 0 and 1,
    so that a result that ignored them would differ."""
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 2)
            bn.bias.uniform_(-1, 1)
    return bn

