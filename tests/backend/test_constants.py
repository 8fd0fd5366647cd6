"""Values that depend on no input of a graph (a causal mask from `arange`, a table made of ones):
a program makes them on its first call and keeps them, kernels and extern calls alike, except
what the caller gets, what draws random numbers, and what is too large to hold."""
import collections
import operator
import re
import warnings

import pytest
import torch
import torch.fx as fx

from fl_backend_testing import DEVICE, SDPA, compile, triton_kernels
from fuselens.codegen import launcher, wrapper


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def count_externs(monkeypatch, *names):
    """Calls of these torch functions from now on (by wrappers, where they look them up)."""
    calls = collections.Counter()
    for name in names:
        real = getattr(torch, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        counting.__name__ = name
        monkeypatch.setattr(torch, name, counting)
    return calls


def _project_by_constant(x):
    return torch.tanh(x @ (torch.ones(16, 4, device=x.device) * 0.5))


@triton_kernels
def test_constant_kernels_run_once_and_stay_correct(monkeypatch):
    # the matrix made from ones is a constant: made on the first call, kept by the program (in
    # training it would be saved for the backward, a forward output, so it is made each call)
    inputs = [randn(8, 16)]
    cg = compile(_project_by_constant, *inputs)
    assert "def make_constants" in cg.wrapper_source
    launches = collections.Counter()
    real = launcher.TritonKernel.run

    def counting(self, *args, **kwargs):
        launches[self.name] += 1
        return real(self, *args, **kwargs)
    monkeypatch.setattr(launcher.TritonKernel, "run", counting)
    for _ in range(3):
        x = randn(*inputs[0].shape)
        torch.testing.assert_close(cg(x)[0], _project_by_constant(x), atol=1e-5, rtol=1e-5)
    constant_kernels = [k for k in launches if launches[k] == 1]
    assert constant_kernels and all(launches[k] >= 3 for k in launches if k not in constant_kernels)


def _packed_sequence_mask(q, k):
    """What HF's masking_utils computes before attention when no mask is given: positions from
    arange, packed-sequence starts (diff, cumsum), a mask read through advanced indexing."""
    batch, length = q.shape[0], q.shape[2]
    positions = torch.arange(length, device=q.device).expand(batch, length)
    first = positions[:, :1] - 1
    starts = torch.diff(positions, prepend=first, dim=-1) != 1
    seq = torch.cumsum(starts, -1)
    b = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    qi = torch.arange(length, device=q.device).view(1, 1, length, 1)
    ki = torch.arange(length, device=q.device).view(1, 1, 1, length)
    mask = (ki <= qi) & (seq[b, qi] == seq[b, ki])
    return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)


def test_extern_calls_on_constants_run_once(monkeypatch):
    # diff, cumsum and the indexing (a gather: the mask kernel's loads in Triton, ATen's call
    # beside the C++ kernels) read only constants: they, and the mask kernel after them, run on the
    # first call only; attention runs every call
    q, k = randn(2, 4, 16, 8), randn(2, 4, 16, 8)
    cg = compile(_packed_sequence_mask, q, k)
    made, call = cg.wrapper_source.split("def call(")
    assert "torch.diff(" in made and "cumsum(" in made
    assert "diff" not in call and "embedding" not in call and re.search(SDPA, call)
    inputs = [(randn(2, 4, 16, 8), randn(2, 4, 16, 8)) for _ in range(3)]
    wants = [_packed_sequence_mask(q, k) for q, k in inputs]
    calls = count_externs(monkeypatch, "diff")
    for (q, k), want in zip(inputs, wants):
        torch.testing.assert_close(cg(q, k)[0], want, atol=1e-5, rtol=1e-5)
    assert calls["diff"] == 1


def _dropped_by_constant_probability(x):
    keep = torch.bernoulli(torch.full((64,), 0.5, device=x.device))
    return x * keep, torch.randperm(64, device=x.device)


def test_random_extern_calls_on_constants_run_each_call():
    # bernoulli reads only a constant, randperm reads nothing: both draw from torch's generator
    # (ATen tags them nondeterministic_seeded), so each call draws new numbers, as eager does
    x = randn(64)
    cg = compile(_dropped_by_constant_probability, x)
    assert "make_constants" not in cg.wrapper_source or "bernoulli" not in cg.wrapper_source.split("def call(")[0]
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = _dropped_by_constant_probability(x)
        torch.manual_seed(seed)
        got = cg(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    torch.manual_seed(0)
    first = cg(x)
    assert any(not torch.equal(a, b) for a, b in zip(first, cg(x)))


def test_a_constant_an_extern_may_return_a_view_of_is_made_each_call():
    def f(x):
        c = torch.ones(8, 8, device=x.device) * 2
        return x + 1, torch.diagonal(c)  # a view of the constant reaches the caller
    x = randn(8)
    cg = compile(f, x)
    cg(x)[1].mul_(100)
    torch.testing.assert_close(cg(x)[1], torch.full((8,), 2.0, device=DEVICE))


def test_a_constant_returned_to_the_caller_is_a_new_tensor_each_call():
    def f(x):
        return x + 1, torch.cumsum(torch.ones(8, device=x.device), 0)
    x = randn(8)
    cg = compile(f, x)
    first = cg(x)[1]
    first.zero_()
    torch.testing.assert_close(cg(x)[1], torch.arange(1.0, 9.0, device=DEVICE))


def test_constants_larger_than_the_limit_are_made_each_call(monkeypatch):
    monkeypatch.setattr(wrapper, "CONSTANT_MAX_BYTES", 0)
    q, k = randn(2, 4, 16, 8), randn(2, 4, 16, 8)
    cg = compile(_packed_sequence_mask, q, k)
    assert "make_constants" not in cg.wrapper_source
    torch.testing.assert_close(cg(q, k)[0], _packed_sequence_mask(q, k), atol=1e-5, rtol=1e-5)


@torch.jit.script
def _scaled_size_sqrt(x: torch.Tensor, factor: int):
    return torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * factor)


def _values_eager_makes_on_the_cpu(x, table):
    """DeBERTa's attention scale (a 0-d tensor from torch.tensor, in Python or in a TorchScript
    function of a GPU tensor) and BEiT's relative position index (torch.zeros without a device,
    written in place): CPU tensors beside the inputs'."""
    scale = torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 2)
    index = torch.zeros(size=(4, 4), dtype=torch.long)
    index[1:, 1:] = torch.arange(9).view(3, 3)
    index[0, :] = 9
    return x / scale, x / _scaled_size_sqrt(x, 3).to(x.dtype), table[index.view(-1)] * 2, index


def test_values_eager_makes_on_the_cpu_stay_there_and_kernels_read_copies():
    """Eager makes them on the CPU and its GPU ops take them (a 0-d tensor as a scalar, an index
    as it is); a kernel reads only its own device's memory: the ops stay torch's on the CPU and
    kernels read one copy each (on a GPU, a kernel handed the CPU pointer faulted)."""
    import fuselens
    x, table = randn(4, 8).bfloat16(), randn(10, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)  # (no eager fall-back)
        got = fuselens.compile(_values_eager_makes_on_the_cpu)(x, table)
    want = _values_eager_makes_on_the_cpu(x, table)
    for g, w in zip(got, want):
        assert g.device == w.device and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def _position_bias(x, table):
    index = torch.zeros(size=(4, 4), dtype=torch.long)  # (BEiT's relative position index, every layer)
    index[1:, 1:] = torch.arange(9).view(3, 3)
    return table[index.view(-1)] * x


@pytest.mark.skipif(DEVICE != "cuda", reason="copies to a GPU: a CPU graph makes none")
def test_copies_of_what_eager_makes_on_the_cpu_are_constants():
    """The copy to the graph's device of a value made on the CPU from no input is a constant like
    the value itself: made on the first call (made each call, it was a copy from pageable memory
    that the host waits for, in every layer of BEiT)."""
    import fuselens
    x, table = randn(16, 3), randn(10, 3)
    compiled = fuselens.compile(_position_bias)
    for _ in range(2):
        torch.testing.assert_close(compiled(x, table), _position_bias(x, table), atol=0, rtol=0)
    (entry,) = fuselens.inspect(compiled)
    source = "\n".join(entry.wrappers)
    copies, each_call = re.findall(r"\.to\(", source), re.findall(r"\.to\(", source.split("def call(", 1)[1])
    assert (len(copies), each_call) == (1, []), source


def test_a_value_made_from_sizes_gets_no_gradient(monkeypatch):
    """A TorchScript function of a tensor that requires grad returns `torch.tensor(x.size(-1))`,
    which requires none in eager: the backward sends it no gradient (its VJP ran torch's autograd
    at run time and, on a GPU, copied a meta stand-in from the CPU while building the backward:
    DeBERTa's training fell back)."""
    import fuselens
    from fuselens.ops import primitives as prim
    vjps = []
    impl = prim.call_torch_vjp.impl
    monkeypatch.setattr(prim.call_torch_vjp, "impl", lambda fn, *a, **k: vjps.append(fn) or impl(fn, *a, **k))
    f = lambda x: x / _scaled_size_sqrt(x, 3).to(x.dtype) * x  # noqa: E731
    x = randn(4, 8).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)  # (no eager fall-back)
        fuselens.compile(f)(x).sum().backward()
    f(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert vjps == []


def test_a_node_on_another_device_is_torchs_op_there_and_copied_once():
    """The mechanism on a machine with one device: the graph built for another device type
    (meta) than the one capture found two nodes on (the CPU)."""
    from fuselens.ops import primitives as prim
    from fuselens.ops import to_primitive_graph

    g = fx.Graph()  # x / s + s, s = torch.tensor(8.0) * 2 made on the CPU, as capture records it
    x = g.placeholder("x")
    s = g.call_function(operator.mul, (g.call_function(torch.tensor, (8.0,)), 2))
    g.output((g.call_function(operator.add, (g.call_function(operator.truediv, (x, s)), s)),))
    for n in g.nodes:
        n.meta["device"] = torch.device("cpu" if n.target in (torch.tensor, operator.mul) else "meta")
    graph = to_primitive_graph(fx.GraphModule(torch.nn.Module(), g), [torch.empty(4, device="meta")], "meta")
    externs = [n for n in graph.nodes if n.target is prim.call_torch]
    assert [n.args[0] for n in externs] == [torch.tensor, operator.mul, torch.Tensor.to]
    assert externs[-1].args[1][1] == torch.device("meta")  # one copy, read by both ops
    assert len(externs[-1].users) == 2


@torch.jit.script
def _log_buckets(relative_pos, bucket_size: int, max_position: int):
    sign = torch.sign(relative_pos)  # (DeBERTa's make_log_bucket_position, a TorchScript function)
    mid = bucket_size // 2
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid), torch.tensor(mid - 1).type_as(relative_pos),
                          torch.abs(relative_pos))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)


def _scripted_calls(x, pos):
    return x / _scaled_size_sqrt(x, 3).to(x.dtype) + _log_buckets(pos, 8, 32).sum()


def test_a_torchscript_function_is_inlined_from_its_python():
    """A `@torch.jit.script` function is captured from its Python original (as torch.compile
    does): its ops are kernels (no call of TorchScript's executor in the wrapper), also after
    eager runs of it have profiled and optimised its TorchScript graph (on a GPU that graph then
    gave capture's stand-ins results unlike eager's: DeBERTa's training faulted)."""
    import fuselens
    x, pos = randn(4, 8), torch.arange(-20, 20, device=DEVICE)
    for _ in range(3):
        want = _scripted_calls(x, pos)
    compiled = fuselens.compile(_scripted_calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        torch.testing.assert_close(compiled(x, pos), want)
    entries = fuselens.inspect(compiled)
    assert all(e.graph_break is None for e in entries)
    assert not [line for e in entries for g in e.graphs for line in g.wrapper.split("\n") if "consts[" in line]
