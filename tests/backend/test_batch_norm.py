"""BatchNorm in training mode (batch statistics) as primitives: compiled equals eager in outputs,
gradients of the input, weight and bias, and the running statistics and batch count left in
the module's buffers, for every BatchNorm a user writes (1d/2d/3d, affine or not, running
statistics tracked or not, cumulative averaging, eval mode without running statistics, half
precision and mixed dtypes); and no BatchNorm extern is left: the statistics, the normalization
and the ReLU/residual around it share kernels, forward and backward."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuselens
from fl_backend_testing import DEVICE, exact_fp32_convolutions, vary_batch_norm
from fl_backend_testing import check as check_graph

BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
SHAPES = {2: (6, 3), 3: (3, 4, 5), 4: (2, 3, 4, 5), 5: (2, 3, 2, 3, 4)}
# reductions sum in another order than ATen's kernels (statistics and gradients are per-channel sums)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def assert_close(a, b, dtype, msg=None):
    """Within `TOL`, relative to the largest value of the result: a sum with cancellation (a
    weight's gradient) rounds to an ulp of its terms, not of itself."""
    tol = dict(TOL[dtype])
    tol["atol"] *= max(1.0, b.abs().max().item())
    torch.testing.assert_close(a, b, msg=msg, **tol)


def make(ndim, module_dtype, affine=True, track=True, momentum=0.1, shape=None):
    torch.manual_seed(0)
    m = BN[ndim]((shape or SHAPES[ndim])[1], affine=affine, track_running_stats=track, momentum=momentum)
    return vary_batch_norm(m.to(DEVICE, module_dtype))


def steps(m, xs, grads, compiled):
    """Forward and backward of each batch: the outputs and the input gradients."""
    f = fuselens.compile(m) if compiled else m
    outs, dxs = [], []
    for x, g in zip(xs, grads):
        x = x.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an eager fallback fails the test
            y = f(x)
            y.backward(g)
        outs.append(y.detach())
        dxs.append(x.grad)
    return outs, dxs


def check(ndim, x_dtype, module_dtype, train=True, n_steps=2, shape=None, **kw):
    shape = shape or SHAPES[ndim]
    want_m = make(ndim, module_dtype, shape=shape, **kw).train(train)
    got_m = make(ndim, module_dtype, shape=shape, **kw).train(train)
    torch.manual_seed(1)
    xs = [torch.randn(shape, device=DEVICE).mul(2).add(0.5).to(x_dtype) for _ in range(n_steps)]
    grads = [torch.randn(shape, device=DEVICE).to(x_dtype) for _ in range(n_steps)]
    want, want_dx = steps(want_m, xs, grads, compiled=False)
    got, got_dx = steps(got_m, xs, grads, compiled=True)
    dtype = x_dtype if module_dtype == torch.float32 else module_dtype
    for a, b in zip(got + got_dx, want + want_dx):
        assert a.dtype == b.dtype
        assert_close(a, b, dtype)
    for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
        assert_close(a.grad, b.grad, dtype, msg=n)
    for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
        assert not a.requires_grad
        assert_close(a, b, dtype, msg=n)


@pytest.mark.parametrize("ndim", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_equals_eager(ndim, dtype):
    check(ndim, dtype, dtype)


@pytest.mark.parametrize("kw", [dict(affine=False), dict(track=False), dict(momentum=None),
                                dict(affine=False, track=False)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_options_equal_eager(kw, dtype):
    check(4, dtype, dtype, **kw)


@pytest.mark.parametrize("shape", [(2, 3, 48, 48), (3, 2, 5000), (2, 2, 72, 72), (3000, 5)], ids=str)
def test_training_with_more_values_per_channel_than_a_block_equals_eager(shape):
    """The statistics and the gradient's sums in two stages (rows per sample, then over the
    batch: schedule/fusion.py's split_outer_inner_reductions; rows longer than a block looped;
    BatchNorm1d of a large batch: a column reduction in two stages)."""
    check(len(shape), torch.float32, torch.float32, n_steps=1, shape=shape)


def test_half_input_with_float_parameters_equals_eager():
    """A bf16 activation into a float32 BatchNorm (as under autocast): normalized in fp32,
    the output bf16, the running statistics float32."""
    check(4, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eval_without_running_statistics_uses_batch_statistics(dtype):
    check(4, dtype, dtype, train=False, track=False)


SPELLINGS = {
    "F.batch_norm": lambda x, w, b, rm, rv: torch.nn.functional.batch_norm(x, rm, rv, w, b, True, 0.3, 1e-3).relu(),
    "torch.batch_norm": lambda x, w, b, rm, rv: torch.batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5, False) * 2,
}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_functional_spellings_equal_eager(spelling, channels_last):
    """The functions themselves, with their momentum and eps, on an input of any layout: the
    result in eager's layout, the running statistics passed in written."""
    fn = SPELLINGS[spelling]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, device=DEVICE)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    params = [torch.rand(3, device=DEVICE) for _ in range(2)]
    stats = [torch.rand(3, device=DEVICE), torch.rand(3, device=DEVICE) + 0.5]
    want_args = [x.clone().requires_grad_(), *(p.clone().requires_grad_() for p in params), *(t.clone() for t in stats)]
    got_args = [x.clone().requires_grad_(), *(p.clone().requires_grad_() for p in params), *(t.clone() for t in stats)]
    want = fn(*want_args)
    compiled = fuselens.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(*got_args)
    assert got.stride() == want.stride()
    assert_close(got, want, torch.float32)
    want.sum().backward()
    got.sum().backward()
    for a, b in zip(got_args, want_args):
        assert_close(a.grad if b.requires_grad else a, b.grad if b.requires_grad else b, torch.float32)
    assert torch_calls("".join(wrappers(compiled))) == []


def test_gradient_of_a_batch_of_one_in_channels_last_strides_is_the_true_one():
    """At batch 1, a gradient of (1, C, H, W) whose strides are channels-last's (a transposed
    sequence, CvT's convolutional projection) is given to eager's CPU kernel, which reads it
    wrongly (torch 2.13: the bias gradient is not the sum of the output gradients). fuselens's
    kernels compute the definition: the bias gradient is that sum, the input gradient as from a
    contiguous copy of the same gradient."""
    torch.manual_seed(0)
    c = 16
    bn = nn.BatchNorm2d(c).to(DEVICE)
    x = torch.randn(1, c, 2, 2, device=DEVICE, requires_grad=True)
    g = torch.randn(1, 4, c, device=DEVICE).transpose(1, 2).unflatten(2, (2, 2))  # strides (.., 1, 2c, c)
    y = fuselens.compile(bn)(x)
    dx, db = torch.autograd.grad(y, (x, bn.bias), g)
    want_dx, want_db = torch.autograd.grad(bn(x), (x, bn.bias), g.contiguous())
    torch.testing.assert_close(db, g.sum((0, 2, 3)))
    torch.testing.assert_close(db, want_db)
    torch.testing.assert_close(dx, want_dx)


def test_one_value_per_channel_raises_as_eager():
    m = make(4, torch.float32).train()
    x = torch.randn(1, 3, 1, 1, device=DEVICE)
    with pytest.raises(ValueError) as want:
        m(x)
    with pytest.raises(ValueError) as got:
        fuselens.compile(m)(x)
    assert str(got.value) == str(want.value)


def test_running_statistics_are_written_in_place():
    """The module's buffers are the same tensors after the step, updated (a user holding them,
    or an optimizer state, sees the new values)."""
    m = make(4, torch.float32).train()
    mean, var, count = m.running_mean, m.running_var, m.num_batches_tracked
    before = mean.clone()
    fuselens.compile(m)(torch.randn(SHAPES[4], device=DEVICE))
    assert m.running_mean is mean and m.running_var is var and m.num_batches_tracked is count
    assert not torch.equal(mean, before) and count.item() == 1


def compiled_step(model, x, loss):
    """The compiled model's forward and backward of `loss` (an eager fallback fails the test)."""
    compiled = fuselens.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(x)
        loss(got).backward()
    return compiled, got


def wrappers(compiled):
    """The code of the forward and backward wrappers, without the source-line comments."""
    (entry,) = fuselens.inspect(compiled)
    code = "\n".join(line.split("  # ")[0] for line in "\n".join(entry.wrappers).splitlines())
    return code.split("# backward")


def torch_calls(code):
    """The wrapper lines that call a torch function as an extern (`call_torch`: its function is
    a constant, `consts[i]`, or named; a written call's on-copies form is a constant) or its
    gradient, other than the convolutions' primitives."""
    return [line for line in code.splitlines()
            if re.search(r"consts\[\d+\]\(|prims\.call_torch|torch\.nn\.functional\.|torch\.(batch|instance)_norm", line)]


def one_element_kernels(code):
    return [line for line in code.splitlines() if re.search(r"\.run\(.*xnumel=1\)", line)]


def count_increments(code):
    """nn.BatchNorm's `num_batches_tracked.add_(1)`: the counts read by one-element kernels
    (those of several modules fuse into one)."""
    return sum(len(re.findall(r"\barg\d+", line.split(".run(")[1])) for line in one_element_kernels(code))


class Block(nn.Module):
    """ResNet's basic block: conv -> BN -> ReLU -> conv -> BN, + residual, ReLU."""

    def __init__(self, c=4):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + x)


# kernels per BatchNorm, forward and backward. Up to a block's worth of values per channel: one
# (statistics + normalization + ReLU (+ residual) + running statistics; the ReLU backward,
# sum(g), sum(g * (x - mean)) and dx). More: three (row sums per sample and channel, their sums
# over the batch with the per-channel values, the [N, C, H, W] pass)
@pytest.mark.parametrize("shape,kernels", [((2, 4, 5, 5), 1), ((2, 4, 48, 48), 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resnet_block_trains_with_no_batch_norm_extern(dtype, shape, kernels, monkeypatch):
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "eager")  # (the kernels counted are NCHW's; CUDA's run channels-last)
    torch.manual_seed(0)
    want_m = Block().to(DEVICE, dtype).train()
    got_m = Block().to(DEVICE, dtype).train()
    got_m.load_state_dict(want_m.state_dict())
    ref_m = Block().to(DEVICE).train()  # (fp32: the reference of bf16 results)
    ref_m.load_state_dict(want_m.state_dict())
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    compiled, got = compiled_step(got_m, x, lambda y: y.sum())
    want = want_m(x)
    want.sum().backward()
    if dtype == torch.float32:
        assert_close(got, want, dtype)
        for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
            assert_close(a.grad, b.grad, dtype, msg=n)
        for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
            assert_close(a, b, dtype, msg=n)
    else:  # eager's bf16 (cuDNN's BatchNorm on a GPU) rounds otherwise: both as close to fp32's
        ref = ref_m(x.float())
        ref.sum().backward()
        pairs = [("output", got, want, ref)] + [
            (n, a.grad, b.grad, r.grad) for (n, a), (_, b), (_, r) in
            zip(got_m.named_parameters(), want_m.named_parameters(), ref_m.named_parameters())] + [
            (n, a, b, r) for (n, a), (_, b), (_, r) in
            zip(got_m.named_buffers(), want_m.named_buffers(), ref_m.named_buffers()) if a.is_floating_point()]
        for n, a, b, r in pairs:
            scale = max(1.0, r.abs().max().item())
            got_err, eager_err = ((t.float() - r).abs().max().item() for t in (a, b))
            assert got_err <= 2 * eager_err + 1e-2 * scale, (n, got_err, eager_err)
    forward, backward = wrappers(compiled)
    # no extern, forward or backward; the batch counts' increments are one-element kernels
    assert torch_calls(forward) == torch_calls(backward) == [] and count_increments(forward) == 2
    assert forward.count(".run(") == 2 * kernels + len(one_element_kernels(forward)), forward
    assert backward.count(".run(") == 2 * kernels, backward


def test_block_under_autocast_trains_as_eager():
    """Mixed precision (the usual bf16 training): convolutions in bf16, BatchNorm given a bf16
    input with float32 parameters and statistics (it is on no autocast list): its output bf16
    (float32 after the residual add of the float32 input), its statistics float32."""
    torch.manual_seed(0)
    want_m = Block().to(DEVICE).train()
    got_m = Block().to(DEVICE).train()
    got_m.load_state_dict(want_m.state_dict())
    x = torch.randn(2, 4, 5, 5, device=DEVICE)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    compiled = fuselens.compile(got_m)
    with torch.autocast(device_type, torch.bfloat16):
        want = want_m(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = compiled(x)
    assert got.dtype == want.dtype
    want.float().sum().backward()
    got.float().sum().backward()
    assert_close(got, want, torch.bfloat16)
    for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
        assert_close(a.grad, b.grad, torch.bfloat16, msg=n)
    for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
        assert a.dtype == b.dtype
        assert_close(a, b, torch.bfloat16, msg=n)
    code = "".join(wrappers(compiled))
    assert torch_calls(code) == [] and count_increments(code) == 2


IN = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}


@pytest.mark.parametrize("kw", [dict(), dict(affine=True), dict(track_running_stats=True),
                                dict(affine=True, track_running_stats=True)], ids=str)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("ndim,dtype", [(4, torch.float32), (3, torch.float32), (5, torch.float32),
                                        (4, torch.bfloat16)], ids=str)
def test_instance_norm_equals_eager(kw, train, ndim, dtype):
    """InstanceNorm: statistics per sample and channel (running statistics, when tracked, the
    average over the samples of batch norm's per-sample update), or the running statistics in
    eval; no extern but in half precision (ops/decompositions/normalization.py says why)."""
    torch.manual_seed(0)
    want_m = IN[ndim](3, **kw).to(DEVICE, dtype).train(train)
    got_m = IN[ndim](3, **kw).to(DEVICE, dtype).train(train)
    with torch.no_grad():
        for p in list(want_m.parameters()) + [t for t in want_m.buffers() if t.is_floating_point()]:
            p.uniform_(0.5, 2)
    got_m.load_state_dict(want_m.state_dict())
    shape = {3: (2, 3, 7), 4: (2, 3, 4, 5), 5: (2, 3, 2, 3, 4)}[ndim]
    x = (torch.randn(shape, device=DEVICE) * 2 + 1).to(dtype)
    g = torch.randn(shape, device=DEVICE).to(dtype)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    want = want_m(xs[0])
    compiled = fuselens.compile(got_m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(xs[1])
        got.backward(g)
    want.backward(g)
    assert_close(got, want, dtype)
    assert_close(xs[1].grad, xs[0].grad, dtype)
    for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
        assert_close(a.grad, b.grad, dtype, msg=n)
    for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
        assert_close(a, b, dtype, msg=n)
    if dtype == torch.float32:
        code = "".join(wrappers(compiled))
        assert torch_calls(code) == []


def test_write_whose_decomposition_writes_nothing_stays_one_extern():
    """A call capture runs on copies of what it writes whose decomposition has no written values
    (in-place dropout): the call itself, with nothing of the attempt left in the graph (no seed
    drawn from torch's generator: the same numbers as eager's after torch.manual_seed)."""
    def f(x):
        y = x * 2
        torch.nn.functional.dropout(y, 0.5, True, inplace=True)
        return y + 1
    x = torch.ones(8, 8, device=DEVICE)
    compiled = fuselens.compile(f)
    torch.manual_seed(0)
    want = f(x)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(x)
    torch.testing.assert_close(got, want)
    (code,) = wrappers(compiled)
    assert code.startswith("def call(arg0):") and len(torch_calls(code)) == 1


class GroupNormBlock(nn.Module):
    """A diffusion UNet's residual unit: GroupNorm -> SiLU -> conv, twice, + residual."""

    def __init__(self, conv, c=8, groups=4):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(groups, c), conv(c, c, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(groups, c, affine=False), conv(c, c, 3, padding=1)

    def forward(self, x):
        h = self.c1(torch.nn.functional.silu(self.n1(x)))
        return x + self.c2(torch.nn.functional.silu(self.n2(h)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 5, 5), (3, 8, 7)], ids=str)
def test_group_norm_block_trains_with_no_extern(dtype, shape):
    """GroupNorm as primitives (batch norm's statistics and closed-form gradient over each group),
    forward and backward, fused with the SiLU after it: equal to eager, neither left to ATen."""
    torch.manual_seed(0)
    conv = nn.Conv2d if len(shape) == 4 else nn.Conv1d
    want_m = GroupNormBlock(conv).to(DEVICE, dtype)
    got_m = GroupNormBlock(conv).to(DEVICE, dtype)
    got_m.load_state_dict(want_m.state_dict())
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    with exact_fp32_convolutions():
        compiled, got = compiled_step(got_m, x, lambda y: y.float().square().sum())
        want = want_m(x)
        want.float().square().sum().backward()
    assert_close(got, want, dtype)
    for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
        assert_close(a.grad, b.grad, dtype, msg=n)
    forward, backward = wrappers(compiled)
    assert "group_norm" not in forward + backward and "silu" not in forward + backward


@pytest.mark.parametrize("bias", [True, False])
def test_group_norm_of_rows_without_spatial_dims(bias):
    """An (N, C) input: the per-channel sums of the backward are over no dims (an empty dims
    tuple sums over all)."""
    torch.manual_seed(0)
    x, w, b = (torch.randn(shape, device=DEVICE) for shape in ((6, 8), (8,), (8,)))
    if bias:
        check_graph(lambda x, w, b: F.group_norm(x, 2, w, b).sin(), x, w, b)
    else:
        check_graph(lambda x, w: F.group_norm(x, 2, w).sin(), x, w)
