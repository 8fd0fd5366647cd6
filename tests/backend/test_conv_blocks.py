"""Convolution blocks as CNNs run them (ResNet's conv -> BatchNorm -> ReLU, residual add):
compiled equals eager, and inference needs one pass after each convolution (no kernel copying a
convolution's result, BatchNorm with its running statistics fused with the ReLU and the add)."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuselens
from fuselens.runtime.compiled import compiled_of
from fl_backend_testing import DEVICE, check, exact_fp32_convolutions, triton_kernels, vary_batch_norm


@pytest.fixture(autouse=True)
def no_tf32():
    with exact_fp32_convolutions():
        yield


class Bottleneck(nn.Module):
    def __init__(self, c=8, affine=True):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, affine=affine)
        self.c2, self.b2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c, affine=affine)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.b1(self.c1(x)))
        return self.relu(self.b2(self.c2(y)) + x)


def model(affine=True, dtype=torch.float32):
    torch.manual_seed(0)
    m = Bottleneck(affine=affine).to(DEVICE, dtype).eval()
    for bn in (m.b1, m.b2):
        vary_batch_norm(bn)
    return m


def first_call(m, x):
    compiled = fuselens.compile(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an eager fallback fails the test
        out = compiled(x)
    (entry,) = fuselens.inspect(compiled)
    return out, entry.kernels, "\n".join(entry.wrappers)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_block_is_one_pass_after_each_convolution(affine, dtype, monkeypatch):
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "eager")  # (CUDA's graphs run channels-last: below)
    x = torch.randn(2, 8, 6, 6, device=DEVICE, dtype=dtype)
    want = model(affine, dtype)(x)
    with torch.no_grad():
        want_ng = model(affine, dtype)(x)
        got, kernels, wrapper = first_call(model(affine, dtype), x)
        kernels = [k.name for k in kernels]
    torch.testing.assert_close(got, want_ng)
    torch.testing.assert_close(got, want.detach())
    assert not got.requires_grad
    assert len(kernels) == 2, kernels  # BN+ReLU after the first conv, BN+add+ReLU after the second
    assert not any("stop_gradient" in k or "copy" in k for k in kernels), kernels
    assert "batch_norm" not in wrapper  # no extern BatchNorm


def _layout(t):
    """Strides of the dims longer than 1 (a size-1 dim's addresses nothing; AccumulateGrad ignores it)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


@pytest.mark.parametrize("train", [False, True])
def test_convolutions_run_channels_last(train, monkeypatch):
    """FUSELENS_CONV_LAYOUT=channels_last (what CUDA's graphs get): an NCHW model's
    convolutions take channels-last operands and return channels-last results, as predicted (no
    copy after them); BatchNorm and ReLU between them keep that layout; the output and the
    gradients come back in eager's layout and equal eager's."""
    from fuselens.codegen import wrapper as W
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    copied = []

    def ensure_layout(t, size, stride):
        copied.append(t is not None and t.numel() > 1 and t.stride() != tuple(stride))
        return real(t, size, stride)
    real = W.ensure_layout
    monkeypatch.setattr(W, "ensure_layout", ensure_layout)
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    want_m, got_m = model().train(train), model().train(train)
    with torch.set_grad_enabled(train):
        want = want_m(x)
        got, kernels, wrapper = first_call(got_m, x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    cl = str(torch.empty(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).stride())
    assert set(re.findall(r"ensure_layout\(\w+, \(2, 8, 6, 6\), (\(.*?\))\)", wrapper)) == {cl}
    assert copied and not any(copied)
    if not train:  # the input and the 3x3 weight copied in; BN+ReLU; BN+add; the ReLU into eager's layout
        assert len([k for k in kernels if "copy" in k.name]) == 2 and len(kernels) == 5, [k.name for k in kernels]
    else:
        want.sum().backward()
        got.sum().backward()
        for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
            assert _layout(a.grad) == _layout(b.grad), n
            torch.testing.assert_close(a.grad, b.grad, msg=n, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("train", [False, True])
def test_a_channels_last_model_keeps_its_layout(train):
    """A model and input in channels-last (`model.to(memory_format=torch.channels_last)`): the
    convolutions return channels-last, as eager's do (predicted contiguous, every result was
    copied into that layout), and so does the block's output."""
    cl = torch.channels_last
    x = torch.randn(2, 8, 6, 6, device=DEVICE).contiguous(memory_format=cl)
    want_m, got_m = model().train(train).to(memory_format=cl), model().train(train).to(memory_format=cl)
    with torch.set_grad_enabled(train):
        want = want_m(x)
        got, _, wrapper = first_call(got_m, x)
    assert got.stride() == want.stride() and want.is_contiguous(memory_format=cl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # each convolution's result expected in the layout cuDNN/oneDNN return (no copy into another)
    assert set(re.findall(r"ensure_layout\(\w+, \(2, 8, 6, 6\), (\(.*?\))\)", wrapper)) == {str(want.stride())}
    if train:
        want.sum().backward()
        got.sum().backward()
        for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=n, rtol=1e-5, atol=1e-4)


def test_inference_under_autocast_equals_eager():
    m = model()
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.no_grad(), torch.autocast(device_type, torch.bfloat16):
        want = m(x)
        got, kernels, _ = first_call(model(), x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_training_block_still_equals_eager():
    """Training BatchNorm (batch statistics, running statistics written) keeps eager's result
    (to the rounding of per-channel sums taken in another order than ATen's: the convolutions'
    weight gradients, sums over every position, differ from eager's by a few 1e-5)."""
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    want_m, got_m = model().train(), model().train()
    want = want_m(x)
    got = fuselens.compile(got_m)(x)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    want.sum().backward()
    got.sum().backward()
    for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n, **tol)
    for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
        torch.testing.assert_close(a, b, msg=n, **tol)


@triton_kernels
def test_channels_last_training_saves_and_reduces_in_that_layout(monkeypatch):
    """Training channels-last (what CUDA's graphs get): the values the forward saves for the
    backward stay channels-last (stored in eager's layout, each kernel beside a convolution read
    one layout and wrote the other), the backward is the one compiled ahead for them, and the
    BatchNorm statistics are summed in memory order (column partials over N*H*W rows of C, not
    rows of H*W at a stride of C). Gradients and running statistics equal eager's, over steps."""
    import inspect
    from fuselens import stats
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    want_m, got_m = model().train(), model().train()
    compiled = fuselens.compile(got_m)
    tol = dict(rtol=1e-5, atol=1e-4)
    for _ in range(2):
        x = torch.randn(2, 8, 24, 24, device=DEVICE)  # 1152 rows: long enough to be split
        g = torch.randn(2, 8, 24, 24, device=DEVICE)  # (contiguous: the gradient compiled ahead)
        layouts = stats.backend["backward_layouts"]
        compiled(x).backward(g)
        want_m(x).backward(g)
        assert stats.backend["backward_layouts"] == layouts  # no backward built for other layouts
        for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=n, **tol)
            a.grad = b.grad = None
        for (n, a), (_, b) in zip(got_m.named_buffers(), want_m.named_buffers()):
            torch.testing.assert_close(a, b, msg=n, **tol)
    spec = next(iter(compiled_of(compiled).entries[0].graph_calls[0].compiled._specializations.values()))
    state = inspect.getclosurevars(spec.run).nonlocals["state"]
    forward = state.forward
    saved = [stride for shape, stride in filter(None, forward.output_layouts[state.num_fw_outputs:])
             if shape == (2, 8, 24, 24)]
    cl = torch.empty(2, 8, 24, 24).contiguous(memory_format=torch.channels_last).stride()
    assert cl in saved and [s for s in saved if s != cl] == [x.stride()], saved  # (x itself, as given)
    assert len(set(re.findall(r"\b(buf\d+)_partial\b", forward.wrapper_source))) == 4  # 2 statistics, 2 BatchNorms


@triton_kernels
def test_the_gradient_through_relu_follows_its_condition_layout(monkeypatch):
    """At the top of a channels-last network the average pool's gradient reaches ReLU's VJP
    (`where(out <= 0, 0, g / 49)`) as a row-major broadcast: the result takes the layout of the
    condition, as ATen's TensorIterator lays out `where` (its condition is its first operand).
    So the gradient is stored channels-last and the BatchNorm's sums over it are column
    partials, not a reduction over rows read at a stride of C."""
    import inspect
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    torch.manual_seed(0)
    conv, bn, fc = nn.Conv2d(8, 8, 1, bias=False).to(DEVICE), nn.BatchNorm2d(8).to(DEVICE), nn.Linear(8, 4).to(DEVICE)

    def top(x):
        y = torch.relu(bn(conv(x)) + x)
        return fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))
    x = torch.randn(32, 8, 7, 7, device=DEVICE).contiguous(memory_format=torch.channels_last).requires_grad_()
    compiled = fuselens.compile(top)
    compiled(x).sum().backward()
    got = [x.grad] + [p.grad for p in (*conv.parameters(), *bn.parameters(), *fc.parameters())]
    for t in [x, *conv.parameters(), *bn.parameters(), *fc.parameters()]:
        t.grad = None
    top(x).sum().backward()
    want = [x.grad] + [p.grad for p in (*conv.parameters(), *bn.parameters(), *fc.parameters())]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    spec = next(iter(compiled_of(compiled).entries[0].graph_calls[0].compiled._specializations.values()))
    backward = inspect.getclosurevars(spec.run).nonlocals["state"].backward
    source = next(iter(backward.programs.values())).wrapper_source
    assert "empty((32, 8, 7, 7), (392, 49, 7, 1)" not in source  # no row-major [N, C, H, W] value
    assert len(set(re.findall(r"\b(buf\d+)_partial\b", source))) == 2  # BatchNorm's two sums


def test_an_output_saved_for_backward_is_stored_once(monkeypatch):
    """A value both returned (in eager's layout) and saved for the backward (tanh's result) is
    stored once, in eager's layout, and the backward reads it there: not a second, channels-last
    copy of it."""
    import inspect
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1).to(DEVICE)

    def f(x):
        return torch.tanh(conv(x))
    compiled = fuselens.compile(f)
    x = torch.randn(2, 8, 12, 12, device=DEVICE)
    g = torch.randn(2, 8, 12, 12, device=DEVICE)
    compiled(x).backward(g)
    got = conv.weight.grad.clone()
    conv.weight.grad = None
    f(x).backward(g)
    torch.testing.assert_close(got, conv.weight.grad, rtol=1e-5, atol=1e-4)
    spec = next(iter(compiled_of(compiled).entries[0].graph_calls[0].compiled._specializations.values()))
    source = inspect.getclosurevars(spec.run).nonlocals["state"].forward.wrapper_source
    out, *saved = re.search(r"return \((.*)\)", source).group(1).split(", ")
    assert out in saved and source.count(".launch(") == 3, source  # x and the weight copied in; conv's epilogue


def test_training_backward_is_one_call_per_convolution():
    """Each convolution's input and weight gradients come from one ATen call (two cost twice
    cuDNN's host time), which skips the input's gradient where nothing needs it."""
    m = fuselens.compile(model().train())
    m(torch.randn(2, 8, 6, 6, device=DEVICE)).sum().backward()
    (entry,) = fuselens.inspect(m)
    calls = re.findall(r"conv2d_backward\(.*, (\(\w+, \w+\))\)", "\n".join(entry.wrappers))
    assert sorted(calls) == ["(False, True)", "(True, True)"]  # the first conv's input needs none


def test_detach_of_an_input_is_no_copy():
    def f(x):
        return x.detach() * 2, x.detach()
    x = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    got = fuselens.compile(f)(x)
    want = f(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
        assert a.requires_grad == b.requires_grad is False
    assert got[1].data_ptr() == x.data_ptr()  # an alias, as eager's detach


@triton_kernels
def test_identical_kernels_compile_once(monkeypatch):
    """A ResNet's repeated blocks generate the same kernel at several places in the graph: it is
    one module (one cubin on a GPU), however its source lines and index in the graph differ."""
    from fuselens.codegen import launcher
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "eager")  # (the kernels counted below are NCHW's)
    m = torch.nn.Sequential(model(), model(), model())
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    with torch.no_grad():
        want = m(x)
        before = len(launcher._modules)
        got, kernels, _ = first_call(m, x)
    torch.testing.assert_close(got, want)
    assert len(kernels) == 6
    compiled = {launcher.canonical(k.name, k.source) for k in kernels}
    assert len(compiled) < len(kernels)
    if DEVICE == "cpu":  # the interpreter loads every kernel it runs
        assert len(launcher._modules) - before <= len(compiled)


class PreNormBlock(nn.Module):
    def __init__(self, d, rows=False):
        super().__init__()
        self.n1, self.f1, self.n2, self.f2 = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.rows = rows

    def forward(self, x):
        x = x + self.f1(self.n1(x))
        if self.rows:  # OPT's MLP: the residual flattened to rows, then viewed back
            shape, x = x.shape, x.reshape(-1, x.shape[-1])
            return (x + self.f2(self.n2(x))).view(shape)
        return x + self.f2(self.n2(x))


@pytest.mark.parametrize("rows", [False, True], ids=["as_is", "through_views"])
def test_residual_stream_is_stored_not_recomputed_by_every_later_kernel(rows):
    """x = x + f(x), block after block: each kernel reads a bounded number of buffers, however
    deep the stack (recomputed, the residual stream made the n-th layer norm read n outputs),
    also where the stream reaches its two readers through a view (counted as two users)."""
    d, depth = 16, 8
    torch.manual_seed(0)
    m = nn.Sequential(*[PreNormBlock(d, rows) for _ in range(depth)]).to(DEVICE).eval()
    x = torch.randn(2, 5, d, device=DEVICE)
    with torch.no_grad():
        want = m(x)
        got, kernels, _ = first_call(m, x)
    torch.testing.assert_close(got, want)
    sources = [k.source for k in kernels]
    reads = [len(set(re.findall(r"\bin_ptr\d+\b", s.split("):", 1)[0]))) for s in sources]
    assert max(reads) <= 5, reads


def test_a_dim_of_size_one_may_have_any_stride():
    """An extern's (N, C, 1, 1) result laid out contiguous where channels-last was predicted (cuDNN's
    squeeze-excite convolutions, which were each copied) is used as it is, and a backward program
    compiled for the one layout serves the other; a dim of another size laid out otherwise is copied."""
    from fuselens.backend.training import layout_key
    from fuselens.codegen.wrapper import ensure_layout
    t = torch.randn(4, 8, 1, 1)
    assert ensure_layout(t, (4, 8, 1, 1), (8, 1, 8, 8)) is t
    assert layout_key([t]) == layout_key([t.contiguous(memory_format=torch.channels_last)])
    u = torch.randn(4, 8, 2, 1)
    v = ensure_layout(u, (4, 8, 2, 1), (16, 1, 8, 8))
    assert v is not u and v.stride() == (16, 1, 8, 8) and torch.equal(v, u)
    assert layout_key([u]) != layout_key([v])


LAYOUTS_WITH_SIZE_1_DIMS = [((8, 2, 1, 3), torch.channels_last), ((2, 8, 1, 10), torch.channels_last),
                            ((1, 8, 5, 5), torch.channels_last), ((1, 8, 5, 5), torch.contiguous_format),
                            ((2, 3, 1, 4, 1), torch.channels_last_3d), ((4, 1, 1, 6), torch.contiguous_format)]


@pytest.mark.parametrize("shape,memory_format", LAYOUTS_WITH_SIZE_1_DIMS, ids=str)
def test_size_1_dims_take_the_strides_of_atens_layout_of_the_same_order(shape, memory_format):
    """A value laid out in the order of ATen's contiguous or channels-last format (its dims of
    other sizes) gets that format's strides, its size-1 dims' included: ATen's kernels read them."""
    from fuselens.lower.lowering import dense_order, strides_in
    want = torch.empty(shape, memory_format=memory_format).stride()
    assert strides_in(shape, dense_order(shape, want)) == want


@pytest.mark.parametrize("groups", [1, 4])
def test_a_grouped_conv1d_of_a_transposed_input(monkeypatch, groups):
    """wav2vec2-style positional convolution `conv1d(h.transpose(1, 2), groups=...)`, run as a
    channels-last conv2d over a height of 1: its weight's height had the stride of its numel, not
    ATen's, and oneDNN's grouped convolution gave wrong values (SEW, UniSpeech, Data2VecAudio)."""
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    g = torch.Generator().manual_seed(0)
    h, w = (torch.randn(*s, generator=g).to(DEVICE) for s in ((2, 10, 8), (8, 8 // groups, 3)))
    with exact_fp32_convolutions():
        check(lambda h, w: F.conv1d(h.transpose(1, 2), w, padding=1, groups=groups).transpose(1, 2) + h, h, w)


def test_a_batch_of_one_stored_channels_last_reaches_aten_as_channels_last(monkeypatch):
    """A value stored in a permuted order has its size-1 dims outermost, with the stride ATen's
    dense layouts give them: ATen picks a convolution's layout from its operand's strides (c10's
    suggest_memory_format counts a batch of one's), and a channels-last input whose batch dim had
    stride 1 (stored innermost) looked contiguous, so oneDNN copied it to NCHW first (SegFormer's
    decode head at batch 1: 33.8 of its 187 ms on a CPU)."""
    from torch._prims_common import suggest_memory_format
    from torch.utils._python_dispatch import TorchDispatchMode
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    f = lambda a, b, w: F.conv2d(torch.cat([a.relu(), b], 1), w)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    a, b, w = (torch.randn(*s, generator=g).to(DEVICE) for s in ((1, 8, 6, 6), (1, 8, 6, 6), (4, 16, 1, 1)))
    cf, seen = fuselens.compile(f), []

    class Convolutions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution.default:
                seen.append(args[0])
            return func(*args, **(kwargs or {}))
    with torch.no_grad():
        want = f(a, b, w)
        cf(a, b, w)  # (compiled outside the mode)
        with Convolutions():
            got = cf(a, b, w)
    torch.testing.assert_close(got, want)
    (x,) = seen
    assert x.is_contiguous(memory_format=torch.channels_last) and suggest_memory_format(x) == torch.channels_last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_group_norm_block_trains_as_eager(monkeypatch, dtype):
    """A diffusion UNet's block (conv -> GroupNorm -> SiLU -> conv) channels-last, where
    GroupNorm's statistics and its gradient's sums run over each group's channels and pixels in
    memory order: outputs and gradients equal eager's over two steps."""
    monkeypatch.setenv("FUSELENS_CONV_LAYOUT", "channels_last")
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),  # noqa: E731
                                  nn.Conv2d(16, 8, 1)).to(DEVICE, dtype)
    want_m = block()
    got_m = block()
    got_m.load_state_dict(want_m.state_dict())
    compiled = fuselens.compile(got_m)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    for _ in range(2):
        x = torch.randn(2, 8, 12, 12, device=DEVICE, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = compiled(x)
        want = want_m(x)
        torch.testing.assert_close(out, want, **tol)
        g = torch.randn_like(want)
        out.backward(g)
        want.backward(g)
        for (n, a), (_, b) in zip(got_m.named_parameters(), want_m.named_parameters()):
            if dtype == torch.float32:
                torch.testing.assert_close(a.grad, b.grad, msg=n, **tol)
            else:  # (bf16 sums of 288 products: each side ~0.4% from float64's, elements 5e-2 apart)
                assert ((a.grad - b.grad).float().norm() / b.grad.float().norm()) < 2e-2, n
            a.grad = b.grad = None


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a biased depthwise 7x7 convolution, a layer norm over channels-last
    pixels, an MLP, the residual add."""

    def __init__(self, c=8):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.fc2(F.gelu(self.fc1(y))).permute(0, 3, 1, 2)


def test_half_precision_convolution_bias_fuses_with_its_reader():
    """In bf16 the depthwise convolution's bias is added where eager adds it (in the oneDNN call
    on a CPU; on a GPU after cuDNN's rounded result) and costs no pass of its own: the layer
    norm's kernel reads the convolution's result (no kernel of the wrapper's own or of ATen's adds
    it), and the block equals eager."""
    torch.manual_seed(0)
    m = ConvNeXtBlock().to(DEVICE, torch.bfloat16).eval()
    x = torch.randn(2, 8, 10, 10, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x)
        got, kernels, wrapper = first_call(m, x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    ((result, conv),) = re.findall(r"(\w+) = torch\.conv2d\((.*)\)", wrapper)
    assert (", None, " in conv) == (DEVICE == "cuda"), conv
    readers = re.findall(rf"(\w+)\.launch\([^)]*\b{result}\b", wrapper)
    # the norm's kernels (its statistics and the normalisation, or one kernel doing both) and no other
    assert readers and all("sum" in k or "rsqrt" in k for k in readers), readers
