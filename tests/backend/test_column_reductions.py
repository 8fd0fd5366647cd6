"""Column reductions (reducing the outer dims) in two stages: partials fused into the kernel
that walks the same rows, then a small reduction of the partials (schedule/fusion.py)."""
import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F

from fl_backend_testing import DEVICE, check, compile, run
from fuselens.codegen import launcher
from fuselens.codegen import triton as triton_codegen
from fuselens.schedule import fusion


@pytest.fixture(autouse=True)
def small_split(monkeypatch):
    """Split from 16 rows, chunks of at least 32 rows (so a chunk takes several blocks)."""
    monkeypatch.setattr(fusion, "COLUMN_SPLIT_MIN_ROWS", 16)
    monkeypatch.setattr(fusion, "TARGET_PARTIALS", 4)
    monkeypatch.setattr(fusion, "MIN_CHUNK", 32)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def schedules(caplog, fn, *inputs, **kwargs):
    """The schedules (forward, then backward) logged while `fn` is compiled and run."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="fuselens.schedule"):
        cg = check(fn, *inputs, **kwargs)
    return cg, [r.getMessage().split("\n")[1:] for r in caplog.records if r.name == "fuselens.schedule"]


def manual_layer_norm(x, w, b):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w + b


@pytest.mark.parametrize("shape,dims", [((100, 37), 0), ((64, 256), 0), ((33, 5, 7), (0, 1)), ((40, 3, 9), 0),
                                        ((257, 1, 130), (0, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keepdim", [False, True])
def test_column_sum(caplog, shape, dims, dtype, keepdim):
    def f(x):
        return x.sum(dims, keepdim=keepdim)
    x = randn(*shape, dtype=dtype)
    cg, scheds = schedules(caplog, f, x, grad=False)
    assert "partials of" in scheds[0][0] and "reducing dims [0]" in scheds[0][1]
    if dtype == torch.bfloat16:  # accumulated in fp32: closer to the fp64 sum than bf16's rounding
        exact = x.double().sum(dims, keepdim=keepdim)
        assert (run(f, x)[1][0].double() - exact).abs().max() <= exact.abs().max() * 2 ** -7


@pytest.mark.parametrize("op", ["amax", "amin", "mean", "prod"])
def test_other_column_reductions(op):
    def f(x):
        return getattr(torch, op)(x, 0)
    x = 1 + 0.01 * randn(70, 19) if op == "prod" else randn(70, 19)
    cg = check(f, x, grad=op != "prod")
    assert "xchunk" in cg.kernels[0].source


@pytest.mark.parametrize("shape,dims", [((3, 40, 40, 24), (1, 2)), ((2, 50, 17), 1), ((2, 3, 30, 4, 16), (2, 3)),
                                        ((2, 1, 30, 1, 4, 16), (2, 4))])
def test_batched_column_sum(caplog, shape, dims):
    """Kept dims outside the reduced ones too ([N, H, W, C] over H and W): partials over chunks of
    rows whose columns are every kept dim (coalesced along the innermost), the chunks outermost in
    memory; stage 2 sums the chunks. (A row reduction per (n, c) read each row's elements C apart:
    DeepLabV3's pooling of 8x2048x64x64 channels-last took 1.1 ms on an H100.)"""
    def f(x):
        return x.sum(dims, keepdim=True) * 2, x.mean(dims)
    cg, scheds = schedules(caplog, f, randn(*shape), grad=True)
    assert "partials of" in scheds[0][0], scheds[0]
    assert "xchunk" in cg.kernels[0].source


def test_squeeze_and_excitation_of_channels_last_activations(caplog):
    """An SE block's mean over H and W of a channels-last activation and an adaptive average
    pooling of it (over windows: its reduced dims apart, a size-1 dim between them), each as
    partials in the kernel computing the ReLU; equal to eager."""
    def f(x):
        y = torch.relu(x * 2)
        return y * torch.sigmoid(y.mean((2, 3), keepdim=True)), F.adaptive_avg_pool2d(y, 1)
    x = randn(3, 24, 20, 20).contiguous(memory_format=torch.channels_last)
    cg, scheds = schedules(caplog, f, x, grad=False)
    assert sum("partials of" in line for line in scheds[0]) == 2, scheds[0]  # (the SE mean, the pooling)


def test_pointwise_prologue_and_epilogue_share_the_chunked_kernel():
    def f(x):
        y = torch.exp(x) * 2
        return y, y.sum(0) + 1
    cg = check(f, randn(90, 21), grad=False)
    assert len(cg.kernels) == 2  # y and the partials; the partials' sum (+ 1)
    assert "rtiles = tl.cdiv(rnumel, RBLOCK)" in cg.kernels[0].source  # no row reduction: columns tiled


def test_layer_norm_backward_reads_x_and_dy_once(caplog):
    x, w, b = randn(100, 48), randn(48), randn(48)
    cg, (fwd, bwd) = schedules(caplog, manual_layer_norm, x, w, b)
    assert len(bwd) == 2, bwd
    assert "reducing dims [1], partials of 32 rows" in bwd[0]  # dx, and the partials of dw and db
    assert "reduction over [4, 48] reducing dims [0]" in bwd[1]  # stage 2: 4 partial rows
    dx_kernel = cg.kernels[1].source
    assert dx_kernel.count("+ xindex * rnumel + rindex, xmask & rmask, other=0)") == 2  # x and dy, loaded once
    assert dx_kernel.count(", 0)[None, :]") == 2  # the column partials of dw and db
    stage2 = cg.kernels[2].source
    assert stage2.count("tl.load(") == 2 and "xchunk" not in stage2


def test_layer_norm_backward():
    check(manual_layer_norm, randn(70, 33), randn(33), randn(33))
    check(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), randn(70, 33), randn(33), randn(33))


@pytest.mark.parametrize("fn", [manual_layer_norm, lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b)])
def test_layer_norm_backward_bf16(fn):
    """bf16 gradients: fuselens accumulates in fp32, so it is at least as close to an fp64
    reference as eager bf16 (whose column sums round as they go)."""
    inputs = [randn(70, 33), randn(33), randn(33)]
    dy = randn(70, 33)

    def grads(f, dtype, compiled):
        xs = [t.to(dtype).requires_grad_() for t in inputs]
        out = (run(f, *xs)[1][0] if compiled else f(*xs))
        return [g.double() for g in torch.autograd.grad(out, xs, dy.to(dtype))]
    exact = grads(fn, torch.float64, False)
    for got, eager, ref in zip(grads(fn, torch.bfloat16, True), grads(fn, torch.bfloat16, False), exact):
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= max((eager - ref).abs().max(), 2 ** -7 * scale) * 1.5


def test_bias_gradients(caplog):
    def linear(x, w, b):
        return x @ w.t() + b  # (F.linear's bias gradient is a matmul with ones)

    def broadcast_add(x, b):
        return torch.tanh(x + b)  # b's gradient sums over two dims
    cg, (_, bwd) = schedules(caplog, linear, randn(80, 12), randn(24, 12), randn(24), atol=1e-4, rtol=1e-4)
    assert any("partials" in line for line in bwd)
    cg, (_, bwd) = schedules(caplog, broadcast_add, randn(6, 15, 10), randn(10))
    assert "partials" in bwd[0]


def conv1d_mlp(x, w1, b1, w2, b2):
    """GPT-2's MLP: Conv1D's addmm on the [tokens, hidden] view, tanh-GeLU over [batch, seq, hidden]."""
    h = torch.addmm(b1, x.view(-1, 12), w1).view(4, 20, 48)
    h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h * h * h)))
    return torch.addmm(b2, h.view(-1, 48), w2).view(4, 20, 12)


def test_a_gradient_and_the_bias_gradient_of_its_reshape_share_a_kernel(caplog):
    # the GeLU's gradient is computed over [4, 20, 48]; b1's gradient sums its [80, 48] view: one
    # kernel computes both, storing the gradient the matmuls read and the partials (it was a
    # kernel storing the GeLU's fp32 intermediates, then the partials' kernel reading them back)
    cg, (_, bwd) = schedules(caplog, conv1d_mlp, randn(4, 20, 12), randn(12, 48), randn(48), randn(48, 12),
                             randn(12), atol=1e-4, rtol=1e-4)
    partials = [line for line in bwd if "partials" in line and "[80, 48]" in line]
    assert len(partials) == 1 and partials[0].split("stores ")[1].count(",") == 1
    assert not any("pointwise over [4, 20, 48]" in line for line in bwd)


def test_long_rows_keep_partials_apart_from_looped_row_reductions(monkeypatch, caplog):
    monkeypatch.setattr(triton_codegen, "PERSISTENT_RNUMEL_MAX", 32)
    monkeypatch.setattr(fusion, "PERSISTENT_RNUMEL_MAX", 32)
    cg, (_, bwd) = schedules(caplog, manual_layer_norm, randn(50, 40), randn(40), randn(40))
    assert len(bwd) == 3 and "partials" in bwd[0] and "partials" not in bwd[1]


def test_small_column_reductions_stay_one_stage(monkeypatch):
    monkeypatch.setattr(fusion, "COLUMN_SPLIT_MIN_ROWS", 1024)
    cg = check(lambda x: x.sum(0), randn(50, 9), grad=False)
    assert len(cg.kernels) == 1


def test_partials_without_a_row_kernel_take_longer_chunks(monkeypatch, caplog):
    monkeypatch.setattr(fusion, "TILE_PROGRAMS", 2)  # 2 chunks of 100 rows: 64 rows each (from 32)
    cg, scheds = schedules(caplog, lambda x: x.sum(0), randn(100, 37), grad=False)
    assert "partials of 64 rows" in scheds[0][0] and "reduction over [2, 37] reducing dims [0]" in scheds[0][1]
    cg, (_, bwd) = schedules(caplog, manual_layer_norm, randn(100, 48), randn(48), randn(48))
    assert "partials of 32 rows" in bwd[0]  # joined the dx kernel: chunks as before


def test_per_column_values_are_loaded_once_before_the_row_loop():
    # a BatchNorm's mean and scale: the same for every row of a chunk, so loaded before the loop
    # over the chunk's rows (inside it, each block of rows loaded them again: 15-20% of a ResNet
    # gradient kernel's time on the H100)
    def f(x, m, s):
        y = (x - m) * s
        return y.sum(0), (y * y).sum(0)
    cg = check(f, randn(2048, 64), randn(64), randn(64), grad=False, atol=1e-3, rtol=1e-4)
    source = next(k.source for k in cg.kernels if "xchunk" in k.source)
    before, loop = source.split("for xoffset in range(")
    assert before.count("tl.load(") == 2 and loop.count("tl.load(") == 1


def test_partials_of_few_columns_without_a_row_kernel_take_shorter_chunks(monkeypatch, caplog):
    # 1024 rows of 8 columns (one column tile): 4 chunks of 256 rows where 32 programs are wanted
    # would leave the GPU idle (a channels-last BatchNorm over 64 channels): 32 chunks of 32 rows
    monkeypatch.setattr(fusion, "TILE_PROGRAMS", 32)
    monkeypatch.setattr(fusion, "TARGET_PARTIALS", 4)
    cg, scheds = schedules(caplog, lambda x: x.sum(0), randn(1024, 8), grad=False)
    assert "partials of 32 rows" in scheds[0][0] and "reduction over [32, 8] reducing dims [0]" in scheds[0][1]


@pytest.mark.skipif(DEVICE != "cuda" or not launcher.supports_pdl(torch.device(DEVICE)),
                    reason="programmatic dependent launch (Hopper and later)")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_kernel_launched_early_reads_what_the_kernel_before_it_wrote(mode):
    # stage 1 lets stage 2 launch once its own programs have all started (gdc_launch_dependents);
    # stage 2 reads the partials only after gdc_wait(): without it, it reads them half written
    import fuselens
    f = fuselens.compile(lambda x: torch.sin(x).sum(0) * 2, mode=mode)
    for _ in range(30):
        x = randn(8192, 1024)
        torch.testing.assert_close(f(x).clone(), torch.sin(x).sum(0) * 2, rtol=1e-4, atol=1e-3)
    kernels = fuselens.inspect(f)[0].kernels
    assert len(kernels) == 2 and all(k.source.count("gdc_wait()") == 1 for k in kernels)


@pytest.mark.parametrize("op", ["sum", "amax", "amin", "mean"])
@pytest.mark.parametrize("shape,dims", [((3, 4, 40, 45), (0, 2, 3)), ((5, 3, 1000), (0, 2)),
                                        ((2, 3, 2, 20, 60), (0, 1, 3, 4))])
def test_reduction_around_kept_dims_in_two_stages(caplog, op, shape, dims):
    """Dims reduced on both sides of the kept ones (BatchNorm's statistics), longer than a block:
    stage 1 reduces the inner dims (contiguous rows, one program per outer x kept index), stage 2
    the outer ones; never a kernel looping over all the reduced elements of a kept index."""
    def f(x):
        return getattr(torch, op)(x, dims)
    x = randn(*shape)
    cg, scheds = schedules(caplog, f, x, grad=False)
    inner = [d for d in dims if d > max(set(range(len(shape))) - set(dims))]
    assert f"reducing dims {inner}" in scheds[0][0], scheds[0]
    rnumels = [int(n) for n in re.findall(r"rnumel=(\d+)", cg.wrapper_source)]
    assert max(rnumels) < math.prod(shape[d] for d in dims), cg.wrapper_source


def _group_norm(x, w, b):
    return F.group_norm(x, 4, w, b)


def _group_norm_of_relu(x, w, b):  # (its operand a lazy value laid out as x: reshaped, still channels-last)
    return F.group_norm(torch.relu(x), 4, w, b)


@pytest.mark.parametrize("fn,domain", [
    (lambda x, w, b: x.sum((1, 2, 3)), "reduction over [2, 5, 3, 8] reducing dims [1, 2, 3]"),
    (lambda x, w, b: (x * w[:, None, None]).amax(1), "reduction over [2, 5, 3, 8] reducing dims [3]"),
    (_group_norm, "reduction over [2, 5, 3, 4, 2] reducing dims [1, 2, 4]"),
    (_group_norm_of_relu, "reduction over [2, 5, 3, 4, 2] reducing dims [1, 2, 4]")])
def test_reductions_read_their_operand_in_memory_order(caplog, fn, domain):
    """A reduction of a value laid out in another order than its logical one (a channels-last
    activation) runs over it in memory order, whatever dims it reduces: neighbouring lanes read
    neighbouring elements. A channels-last GroupNorm's statistics (each group's channels and H, W)
    had been read at a stride of C, 8 times the memory traffic (2x Inductor's time for a GroupNorm
    ResNet-50 on an H100). Gradients too."""
    x = randn(2, 8, 5, 3).contiguous(memory_format=torch.channels_last)
    cg, (fwd, *_) = schedules(caplog, fn, x, randn(8), randn(8))
    assert any(domain in line for line in fwd), fwd


def test_channels_last_group_norm_statistics_read_x_once_into_small_partials():
    """A channels-last GroupNorm's statistics ([N, H, W, G, C/G] over H, W and a group's C/G
    channels): stage 1 sums over H and W per channel as column partials, then the groups' short
    rows; nothing between x and the statistics holds more than a few elements per channel (rows
    of C/G summed first were stored per pixel and group in fp32: as many bytes as x)."""
    x = randn(2, 32, 40, 40).contiguous(memory_format=torch.channels_last)  # (rows of 40*40*4: split)
    w, b = randn(32), randn(32)
    cg = check(lambda x, w, b: F.silu(F.group_norm(x, 8, w, b)), x, w, b, grad=False)
    sizes = [math.prod(eval(shape)) for shape in re.findall(r"empty\((\(.*?\)), \(.*?\), torch\.float32\)",
                                                             cg.wrapper_source)]
    assert max(s for s in sizes if s != x.numel()) * 16 <= x.numel(), sizes


def test_group_norm_backward_reads_x_and_dy_twice(caplog):
    """An affine GroupNorm's backward as ATen's: sums of dy and dy * x per sample and channel over
    the spatial dims (one pass), then dx (a second); its weight's and bias's gradients come from
    those sums. (Derived from the normalization and the affine apart, with groups' rows too long
    for a persistent kernel (C/G x H x W = 6400 here), the weight's gradient was a third pass
    over dy and x.)"""
    x = randn(2, 16, 40, 40).contiguous(memory_format=torch.channels_last)
    _, (*_, bwd) = schedules(caplog, lambda x, w, b: F.silu(F.group_norm(x, 4, w, b)), x, randn(16), randn(16))
    passes = [line for line in bwd if (m := re.search(r"over (\[.*?\])", line)) and
              math.prod(eval(m.group(1))) == x.numel()]
    assert len(passes) == 2, bwd
