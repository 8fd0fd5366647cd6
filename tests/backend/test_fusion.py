"""Kernel counts and kernel structure: what fuses, what needs no kernel, what the kernels say."""
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fuselens
from fl_backend_testing import DEVICE, check, compile, run, trace, triton_kernels
from fuselens.codegen import launcher
from fuselens.codegen import triton as triton_codegen


def manual_softmax(x):
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(-1, keepdim=True)


def manual_layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(-1, keepdim=True)
    return centered / torch.sqrt(var + 1e-5) * w + b


def manual_gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def sin_plus_cos(x, y):
    return torch.sin(x) + torch.cos(y)


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


@pytest.mark.parametrize("fn,inputs,name", [
    (manual_softmax, lambda: [randn(5, 33)], "fl_red_fused_amax_div_exp_sub_sum_0"),
    (manual_layer_norm, lambda: [randn(6, 40), randn(40), randn(40)], "fl_red_fused_add_div_mul_sqrt_sub_sum_0"),
    (manual_gelu_tanh, lambda: [randn(7, 30)], "fl_poi_fused_add_mul_tanh_0"),
    (sin_plus_cos, lambda: [randn(9, 13), randn(13, 9).t()], "fl_poi_fused_add_cos_sin_0"),
])
def test_fuses_into_one_kernel(fn, inputs, name):
    args = inputs()
    cg, out = run(fn, *args)
    assert [k.name for k in cg.kernels] == [name]
    torch.testing.assert_close(out[0], fn(*args))
    # intermediates of a single fused kernel never touch memory: only the output is allocated
    assert len(re.findall(r"= empty\(", cg.wrapper_source)) == 1


def test_pure_views_need_no_kernel_and_alias_the_input():
    def views(x):
        return x.t()[1:, ::2].unsqueeze(0), x.reshape(-1), x[-1]
    x = randn(4, 6)
    cg, (a, b, c) = run(views, x)
    assert cg.kernels == []
    for got, expected in zip((a, b, c), views(x)):
        torch.testing.assert_close(got, expected)
        assert got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert got.stride() == expected.stride()


@pytest.mark.parametrize("fn,shape", [
    (lambda x: torch.sin(x.t()) * 2, (9, 7)),
    (lambda x: (x.permute(2, 0, 1) + 1) * 2, (3, 4, 5)),
    (lambda x: torch.exp(x.transpose(0, 1)).sum(0), (6, 5, 4)),
    (lambda x: (x * 2).t().clone(), (9, 7)),  # clone keeps the layout
    (lambda x: (x * 2).t().contiguous(), (9, 7)),  # contiguous does not
    (lambda x: (x * 2).t(), (9, 7)),
])
def test_outputs_have_eagers_layout_and_are_written_in_it(fn, shape):
    # eager gives a pointwise op on a permuted input that input's layout; storing the output
    # in it too makes the kernel read and write in one linear order (no strided stores)
    x = randn(*shape)
    cg, (out,) = run(fn, x)
    expected = fn(x)
    torch.testing.assert_close(out, expected)
    assert out.stride() == expected.stride()
    if len(cg.kernels) == 1 and cg.kernels[0].name.startswith("fl_poi"):
        assert "tl.store(out_ptr0 + xindex," in cg.kernels[0].source


def test_a_gemm_output_read_through_its_3d_view_is_read_at_xindex():
    # F.linear on (B, S, K) is a 2-D GEMM viewed back as (B, S, N): the activation after it reads
    # the GEMM's output in its own row-major order, so at `xindex`, with no division or modulus
    # for it (BERT's GeLU: three divisions an element by kernel arguments, 0.36 against 0.27 ms)
    fn = lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))  # noqa: E731
    cg, (out,) = run(fn, randn(4, 8, 16), randn(24, 16), randn(24))
    (kernel,) = cg.kernels
    loads = [line.split("  #")[0].strip() for line in kernel.source.splitlines() if "tl.load" in line]
    assert any(re.match(r"tmp\d+ = tl\.load\(in_ptr\d \+ xindex\b", load) for load in loads), loads
    assert "x0 =" not in kernel.source and "x1 =" not in kernel.source  # only the bias's column index


def test_a_view_that_fails_in_eager_fails_compiled():
    # the graph returns `(x * 2).T.contiguous()`; Python transposes it back and views it flat,
    # which eager refuses: so must fuselens, with eager's error and no fallback warning
    def fn(x):
        v = (x * 2).T.contiguous().T
        return v.view(-1)
    x = randn(4, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        fn(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            fuselens.compile(fn)(x)


def test_reductions_over_the_same_rows_share_a_kernel():
    def stats(x):
        return x.sum(-1), x.amax(-1), (x * x).mean(-1)
    check(stats, randn(8, 20), grad=False)
    cg, _ = run(stats, randn(8, 20))
    assert len(cg.kernels) == 1


def rotary(q, k, pos):
    """Llama's rotary embedding: cos and sin of (S, D), broadcast over batch and heads of q and k."""
    d = q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=q.device).float() / d))
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    return tuple(x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin for x in (q, k))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("least", [0, None])
def test_heavy_values_broadcast_to_many_elements_are_computed_once(grad, least, monkeypatch):
    """cos and sin that q and k broadcast over every head are stored once by the forward (and once
    more by the backward where it needs them again), not computed again for each element of each
    head (sin + cos over their own elements stays one kernel: the parametrized cases above); under
    RECOMPUTE_MIN elements in all (None: these small shapes) they are computed where they are used."""
    from fuselens.lower import lowering
    if least is not None:
        monkeypatch.setattr(lowering, "RECOMPUTE_MIN", {"cuda": least, "cpu": least})
    q, k, pos = randn(2, 8, 6, 16), randn(2, 2, 6, 16), torch.arange(6, device=DEVICE) * 37
    cg = check(rotary, q, k, pos, grad=grad)  # (kernels: the forward's and the backward's)
    text = "".join(k.source for k in cg.kernels)
    if least is None:
        assert text.count("tl.cos(") > 1 + grad, [k.name for k in cg.kernels]
    else:
        assert text.count("tl.cos(") == text.count("tl.sin(") <= 1 + grad, [k.name for k in cg.kernels]


def test_a_matrix_vector_products_heavy_vector_is_computed_once_where_a_kernel_costs_less():
    """A decode step's down projection of silu(a) * b: each of its 512 rows reads the whole vector.
    Where its 1M elements of users reach the device's RECOMPUTE_MIN (a CPU's C++ kernels), the
    vector is stored by a pointwise kernel of its 2048 elements; below (a GPU), recomputed."""
    a, b, w = randn(1, 2048), randn(1, 2048), randn(512, 2048)
    # (sums of 2048 products in another order than BLAS's: an absolute error of ~1e-5 is rounding)
    cg = check(lambda a, b, w: (torch.nn.functional.linear(torch.nn.functional.silu(a) * b, w),), a, b, w, grad=False,
               atol=1e-4, rtol=1e-4)
    with_sigmoid = [k.name for k in cg.kernels if "sigmoid" in k.source]
    stored = torch.device(DEVICE).type == "cpu"
    assert with_sigmoid and all(n.startswith("fl_poi") == stored for n in with_sigmoid), with_sigmoid


def test_pointwise_prologue_and_epilogue_fuse_with_reduction():
    def f(x):
        y = torch.exp(x) * 2
        return y, y.sum(0) + 1  # reduction over dim 0: columns
    cg = check(f, randn(9, 5), grad=False)
    assert len(cg.kernels) == 1


def rms_norm_then_projections(x, w, wq, wk, wv):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return torch.nn.functional.linear(h, wq), torch.nn.functional.linear(h, wk), torch.nn.functional.linear(h, wv)


def test_a_value_reshaped_for_several_externs_is_stored_once_in_its_producers_kernel():
    # each projection flattens the norm's (batch, seq, hidden) output to (tokens, hidden): stored
    # once, by the norm's own kernel, and viewed (it was a second kernel writing three copies)
    cg = check(rms_norm_then_projections, randn(2, 5, 16), randn(16), randn(8, 16), randn(8, 16), randn(8, 16),
               grad=False)
    assert len(cg.kernels) == 1
    assert cg.wrapper_source.count("empty(") == 1


def merge_heads(q, k, w):
    a = (q * k).sigmoid()  # lazy, then permuted and reshaped for a projection (attention's heads merged)
    return torch.nn.functional.linear(a.transpose(1, 2).reshape(2, 5, 8), w)


def test_a_reshape_of_a_permuted_value_is_stored_once():
    # the permutation cannot be viewed as the reshape: the reshape is stored on its own (its base,
    # stored first for nothing, made a kernel without outputs and a backend error)
    cg = check(merge_heads, randn(2, 2, 5, 4), randn(2, 2, 5, 4), randn(8, 8), grad=False)
    assert len(cg.kernels) == 1


def merge_transposed_heads(x, w):
    a = x.transpose(1, 2) * 2  # stored in its operand's (transposed) layout, then reshaped for a projection
    return torch.nn.functional.linear(a.reshape(2, 5, 8), w)


def test_a_reshape_of_a_value_laid_out_as_its_permuted_operand_is_stored_once():
    # its stored form is permuted like the base's operand, which the reshape cannot view either (the
    # base, stored first for nothing, made a kernel without outputs: BERT-base's fallback on an H100)
    cg = check(merge_transposed_heads, randn(2, 2, 5, 4), randn(8, 8), grad=False)
    assert len(cg.kernels) == 1


def grouped_query_attention(q, k, v, cos):
    # rotary embeddings (queries and keys read `cos`: one kernel), then transformers' repeat_kv:
    # each key/value head expanded for the query heads sharing it, reshaped (causal: attention
    # reads the repeated keys, where without is_causal it folds the query heads instead)
    b, kv, s, d = k.shape
    q, k = q * cos, k * cos
    k = k[:, :, None].expand(b, kv, 2, s, d).reshape(b, kv * 2, s, d)
    v = v[:, :, None].expand(b, kv, 2, s, d).reshape(b, kv * 2, s, d)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_reshaped_broadcast_is_stored_in_its_reshaped_shape():
    # stored through its (5-d, expanded) base, the repeated keys would be a kernel of their own
    cg = check(grouped_query_attention, randn(2, 4, 5, 8), randn(2, 2, 5, 8), randn(2, 2, 5, 8), randn(5, 8),
               grad=False)
    assert len(cg.kernels) == 1


@pytest.mark.parametrize("shape", [(4, 15), (60,), (2, 3, 10)])
def test_a_value_joins_the_kernels_of_reductions_over_its_reshapes(shape):
    # y is stored by the kernel reducing its [6, 10] view (its elements in the same order), not by
    # a kernel of its own; its [10, 6] view's column sum needs the same elements in another split
    def f(x):
        y = torch.sin(x)
        return y, y.view(10, 6).sum(0), y.view(6, 10).amax(1)
    check(f, randn(*shape))
    cg = check(f, randn(*shape), grad=False)
    assert len(cg.kernels) == 2


def test_a_wide_value_of_narrow_inputs_is_recomputed_not_stored():
    # fp32 computed from two bf16 tensors (autocast's GroupNorm backward: the bf16 convolution
    # gradient and input): each consumer reading the inputs again reads as many bytes as reading a
    # stored copy, which would cost a write and 4 bytes an element of memory
    def f(x, y):
        v = x.float() * y.float()
        return v.sum(1, keepdim=True), v.sum(0, keepdim=True)  # (rows and columns: two kernels)
    x, y = randn(16, 32).to(torch.bfloat16), randn(16, 32).to(torch.bfloat16)
    cg = check(f, x, y, grad=False)
    assert "empty((16, 32), (32, 1), torch.float32)" not in cg.wrapper_source
    # the same in fp32 (reads twice its own bytes): stored, as before
    assert "empty((16, 32), (32, 1), torch.float32)" in check(f, x.float(), y.float(), grad=False).wrapper_source


def test_unrelated_reductions_stay_separate_kernels():
    def f(x):
        return x.sum(0), x.sum(1)
    cg = check(f, randn(6, 7), grad=False)
    assert len(cg.kernels) == 2


def test_looped_reduction(monkeypatch):
    monkeypatch.setattr(triton_codegen, "PERSISTENT_RNUMEL_MAX", 16)
    x, w, b = randn(3, 1000), randn(1000), randn(1000)
    cg = check(manual_layer_norm, x, w, b, grad=False)
    assert len(cg.kernels) == 1
    assert "for roffset in range(0, rnumel, RBLOCK):" in cg.kernels[0].source
    check(manual_softmax, randn(4, 700), grad=False)


def test_looped_reductions_that_read_none_of_each_other_share_one_loop(monkeypatch):
    """sum(x) and sum(x * x) (a one-pass variance) read the row once; a reduction that reads
    another's result (layer norm's variance of x - mean) loops after it."""
    monkeypatch.setattr(triton_codegen, "PERSISTENT_RNUMEL_MAX", 16)

    def moments(x):
        s1, s2 = x.sum(-1, keepdim=True), (x * x).sum(-1, keepdim=True)
        return s2 / 100 - (s1 / 100) ** 2
    cg = check(moments, randn(3, 100), grad=False)
    assert cg.kernels[0].source.count("for roffset in range(0, rnumel, RBLOCK):") == 1
    cg = check(manual_layer_norm, randn(3, 100), randn(100), randn(100), grad=False)
    assert cg.kernels[0].source.count("for roffset in range(0, rnumel, RBLOCK):") == 3


def test_persistent_kernels_issue_their_loads_before_the_reductions():
    # w and b are read after the row's mean and variance: loaded first, their latency overlaps
    # the reductions (layer norm forward on an H100: 94.1 -> 93.7 us)
    cg = check(manual_layer_norm, randn(8, 64), randn(64), randn(64), grad=False)
    lines = cg.kernels[0].source.splitlines()
    loads = [i for i, line in enumerate(lines) if "tl.load(" in line]
    assert len(loads) == 3 and max(loads) < next(i for i, line in enumerate(lines) if "tl.sum(" in line)


def test_kernels_for_pdl_wait_for_the_kernel_before_them_first(monkeypatch):
    # launched with programmatic dependent launch on Hopper (codegen/cuda.py), a kernel's programs
    # may start before the previous kernel has finished: nothing may be read before gdc_wait()
    source = compile(manual_layer_norm, randn(8, 64), randn(64), randn(64)).kernels[0].source
    assert ("gdc_wait()" in source) == launcher.supports_pdl(torch.device(DEVICE))
    monkeypatch.setattr(launcher, "supports_pdl", lambda device: True)
    lines = compile(manual_layer_norm, randn(8, 64), randn(64), randn(64)).kernels[0].source.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1:]
    assert [line.split("(")[0].strip() for line in body[:2]] == ["gdc_wait", "gdc_launch_dependents"]
    assert "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait" in lines


def test_masks_only_where_sizes_need_them():
    cg, _ = run(manual_softmax, randn(1024, 64))
    source = cg.kernels[0].source
    assert "rmask" not in source.split("rmask = rindex < rnumel")[1]  # 64 is a power of two
    assert "xmask" not in source.split("xmask = xindex < xnumel")[1]  # 1024 rows fill whole blocks
    cg, _ = run(manual_softmax, randn(5, 33))
    assert "xmask & rmask" in cg.kernels[0].source


def test_kernel_lines_carry_their_source_line():
    cg, _ = run(manual_gelu_tanh, randn(4, 4))
    kernel = cg.kernels[0]
    line = manual_gelu_tanh.__code__.co_firstlineno + 1
    assert kernel.source_lines == [(__file__, line)]
    computing = [ln for ln in kernel.source.splitlines() if ln.strip().startswith("tmp")]
    assert computing and all(f"test_fusion.py:{line}" in ln for ln in computing)


def test_sizes_are_kernel_arguments_and_kernels_are_reused_across_shapes(monkeypatch):
    # (the interpreter loads a kernel's module; a GPU loads its cubin, compiled or from the cache)
    loads = []
    real, real_binary = launcher.load_module, launcher.load_binary
    monkeypatch.setattr(launcher, "load_module", lambda src: loads.append(src) or real(src))
    monkeypatch.setattr(launcher, "load_binary", lambda src, *a: loads.append(src) or real_binary(src, *a))
    x = randn(6, 10)
    cg, _ = run(manual_softmax, x)
    first = cg.kernels[0].source
    for rows in (3, 11):
        y = randn(rows, 10)
        torch.testing.assert_close(cg(y)[0], manual_softmax(y))
    assert cg.kernels[0].source == first
    assert set(loads) == {launcher.canonical(cg.kernels[0].name, first)[1]}  # one module, as compiled


def test_buffer_reuse():
    def f(x):
        a = x.sum(1, keepdim=True)          # kernel 0 writes a (rows)
        b = (x * a).sum(0, keepdim=True)    # kernel 1 reads a (columns); a is dead afterwards
        return (x + b).sum(1, keepdim=True)  # kernel 2's (rows) output takes a's memory
    cg = check(f, randn(6, 5), grad=False)
    assert len(cg.kernels) == 3
    assert "buf2 = buf0; del buf0  # reuse" in cg.wrapper_source


def test_a_dead_buffer_no_later_buffer_takes_is_freed_at_its_last_use():
    def f(x):
        a = x.sum(1, keepdim=True)            # kernel 0 writes a (6, 1)
        b = (x * a).sum(0, keepdim=True)      # kernel 1 reads a, its last use
        return torch.sin(b) * 3               # no later buffer of a's layout: a is freed, not held
    lines = check(f, randn(6, 5), grad=False).wrapper_source.splitlines()
    last = max(i for i, line in enumerate(lines) if "buf0" in line and "del buf0" not in line)
    assert lines[last + 1].strip() == "del buf0"


def test_a_dead_buffer_is_not_held_through_the_peak_for_a_later_buffer():
    def f(x, w):
        a = x.sum(1, keepdim=True)        # kernel 0 writes a (8, 1)
        b = (x * a).sum(0, keepdim=True)  # kernel 1 reads a, its last use
        c = torch.sin(x * b) @ w          # x's size stored for the matmul: the peak, freed after it
        return c.sum(1, keepdim=True)     # a's layout: taking a's memory would hold a through the peak
    # (x small: sin of x * b, b a sum of sums, stays well conditioned; at randn's scale its argument
    # reached hundreds and eager's and the kernels' summation orders differed by 2e-3 after the GEMM)
    lines = check(f, randn(8, 256) / 16, randn(256, 256), grad=False, atol=1e-3, rtol=1e-3).wrapper_source.splitlines()
    last = max(i for i, line in enumerate(lines) if "buf0" in line and "del buf0" not in line)
    assert lines[last + 1].strip() == "del buf0"
    assert not any("# reuse" in line for line in lines)


def test_buffers_are_allocated_in_the_layouts_kernels_index():
    # each buffer by its size, strides and dtype (codegen/wrapper.py allocators): an output's
    # layout is eager's, per-row values keep their (n, 1) strides
    x, y = randn(9, 13), randn(9, 1)
    out = check(lambda x: torch.sin(x.t()) * 2, x, grad=False)(x)
    assert out[0].stride() == (1, 13)

    def f(x, y):
        return x.sum(1, keepdim=True), x.amax(1, keepdim=True).to(torch.float64) + y
    cg = check(f, x, y, grad=False)
    assert [(o.stride(), o.dtype) for o in cg(x, y)] == [((1, 1), torch.float32), ((1, 1), torch.float64)]


def view_of_an_extern(x):
    a = torch.relu(x)          # a kernel's buffer, read by an extern whose result views it
    u = a.unfold(0, 2, 1)
    c = torch.sigmoid(x * u.sum())  # of a's layout, after a's last read: taking a's memory would change u
    return c, u


def convolutions(x, w):
    a = torch.relu(x)          # a kernel's buffer, read by a convolution (a new tensor)
    b = F.conv2d(a, w, padding=1)
    return F.conv2d(torch.sigmoid(b), w, padding=1)  # the sigmoid's buffer takes a's memory


def test_memory_read_by_an_extern_is_reused_unless_its_result_may_view_it():
    """After its last read, a buffer of a convolution's input is taken over by a later one of its
    layout (in a CNN's training step nearly every kernel's output is one: each allocation is host
    time); not one that an extern which may return a view of it read."""
    assert "# reuse" not in check(view_of_an_extern, randn(8, 8), grad=False).wrapper_source
    src = check(convolutions, randn(2, 4, 6, 6), randn(4, 4, 3, 3), grad=False).wrapper_source
    # (names and layouts differ by device: cuDNN's channels-last, the CPU's contiguous)
    conv_inputs = set(re.findall(r"conv\w*\((buf\d+)", src))
    taken = set(re.findall(r"buf\d+ = (buf\d+); del \1  # reuse", src))
    assert conv_inputs & taken, src


def test_large_pointwise_chain_is_split_not_exponential():
    def deep(x):
        for _ in range(30):
            x = x * torch.sigmoid(x) + x
        return x
    check(deep, randn(3, 5), grad=False)


def test_dynamic_dims_need_no_new_kernel_source():
    x, w, b = randn(6, 40), randn(40), randn(40)
    cg = compile(manual_layer_norm, x, w, b, dynamic_dims=[{0, 1}, {0}, {0}])
    source = cg.kernels[0].source
    assert "40" not in source  # the row length and the mean's divisor are arguments
    for rows, cols in ((3, 24), (9, 57)):
        args = (randn(rows, cols), randn(cols), randn(cols))
        torch.testing.assert_close(cg(*args)[0], manual_layer_norm(*args))
        assert cg.kernels[0].source == source


def test_a_dynamic_entrys_kernels_are_the_static_entrys():
    """Rows of a dynamic count, each a static [4, 8] read through a view of [32]: the dynamic
    entry's kernel reads its rows at `xindex` (their strides equal by the static sizes' values) and
    masks only the dynamic rows, as the static entry's kernel does (it had divided the index and
    masked the reduction too)."""
    import fuselens
    w = randn(4, 8)

    def f(x):
        return (x.view(x.shape[0], 4, 8) * w).sum(-1)
    cf = fuselens.compile(f)
    for n in (7, 9, 11):
        x = randn(n, 32)
        torch.testing.assert_close(cf(x), f(x))
    static, dynamic = fuselens.inspect(cf)
    assert dynamic.dynamic_dims and not static.dynamic_dims
    assert [k.source for k in dynamic.kernels] == [k.source for k in static.kernels]
    assert "xindex * rnumel + rindex" in static.kernels[0].source


def test_a_dynamic_entry_reads_a_products_output_at_its_own_position():
    """A Linear's output, [2 * n, 24], read back as [2, n, 24] by the GeLU after it, n dynamic (its
    weight a module's parameter, whose sizes are no input's static dims): the
    view's stride n * 24 is a size of its own value, equal to the product at this program's sizes
    (a program is built for one input shape), so the GeLU reads at `xindex` with no division, as
    the static entry's does; it had divided its flat position by the length twice an element."""
    import fuselens
    f = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU()).to(DEVICE)
    cf = fuselens.compile(f)
    with torch.no_grad():
        for n in (5, 7, 9):
            x = randn(2, n, 16)
            torch.testing.assert_close(cf(x), f(x))
    static, dynamic = fuselens.inspect(cf)
    assert dynamic.dynamic_dims and not static.dynamic_dims
    for entry in (static, dynamic):
        gelu = [k.source for k in entry.kernels if "erf" in k.source]
        assert len(gelu) == 1 and "//" not in gelu[0] and "tl.load(in_ptr0 + xindex" in gelu[0], gelu


def test_half_inputs_compute_in_fp32():
    x = randn(4, 8).half()
    cg, out = run(manual_softmax, x)
    assert ".to(tl.float32)" in cg.kernels[0].source
    torch.testing.assert_close(out[0], manual_softmax(x.float()).half(), atol=2e-3, rtol=2e-3)


def test_int64_indexing_only_for_huge_buffers():
    from fuselens.ops import to_primitive_graph
    from fuselens.backend.driver import build_program

    def f(x):
        return x * 2
    gm = trace(f)
    huge_strided = torch.empty_strided((4, 4), (2 ** 30, 1), device="meta")  # few elements, far apart
    for meta, wide in ((torch.empty(1024, 1024, device="meta"), False),  # code generation only: nothing runs
                       (torch.empty(65536, 65536, device="meta"), True), (huge_strided, True)):
        program = build_program(to_primitive_graph(gm, [meta], DEVICE), DEVICE)  # (Triton's kernels)
        assert ("tl.program_id(0).to(tl.int64)" in program.kernels[0].source) == wide


def test_large_kernels_divide_their_indices_by_literals():
    """A kernel of 2^26 elements or more divides its indices by constants (a multiply and shift,
    not ~20 integer instructions an element); smaller ones whose divisors differ from those of
    another kernel of their source take sizes as arguments, so those kernels share a compile
    (test_launch.py: divisors the same in all kernels of a source are constants at any size)."""
    from fuselens.ops import to_primitive_graph
    from fuselens.backend.driver import build_program
    from fuselens.lower.ir import DynamicValues
    gm = trace(lambda x, b, y, c: (x + b, y + c))
    for rows, literal in ((4096, True), (64, False)):  # code generation only: nothing runs
        x, b = torch.empty(rows, 50257, device="meta"), torch.empty(50257, device="meta")
        y, c = torch.empty(rows, 50001, device="meta"), torch.empty(50001, device="meta")
        program = build_program(to_primitive_graph(gm, [x, b, y, c], DEVICE), DEVICE)
        assert ("% 50257" in program.kernels[0].source) == literal, program.kernels[0].source
        assert ("% 50001" in program.kernels[1].source) == literal, program.kernels[1].source
    gm = trace(lambda x, b: x + b)
    # with a dynamic size T, the divisors of static sizes only (the vocabulary's, an input's static
    # dim): a symbol may stand for a product of T (T * 50257), and the source must not change with T
    sources = set()
    for t in (512, 513):
        x, b = torch.empty(4, t, 50257, device="meta"), torch.empty(4, 1, 50257, device="meta")
        program = build_program(to_primitive_graph(gm, [x, b], DEVICE), DEVICE,
                                dynamic_values=DynamicValues({t}, static={4, 50257}))
        sources.add(program.kernels[0].source)
    (source,) = sources
    assert "% 50257" in source and f"{4 * 50257}" not in source, source


@triton_kernels
def test_divisors_are_literals_unless_kernels_of_one_source_divide_by_different_sizes():
    """An index's divisions (a transpose's, the pairs of a rotary embedding) are by literals where
    every kernel of the program compiled from the same source divides by the same sizes (a
    model's layers: GPT-J's rotary kernel took 6x Inductor's time dividing by arguments), and by
    size arguments where those kernels' sizes differ (a ResNet's stages), which then still share
    one compile."""
    flat_t = lambda v: v.t().reshape(-1) * 2  # noqa: E731
    x = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731

    def divisors(fn, *inputs):
        cg, _ = run(fn, *inputs)
        return {launcher.canonical(k.name, k.source)[1]: re.findall(r"// (\w+)\)", k.source) for k in cg.kernels}
    assert list(divisors(lambda a: flat_t(a), x(8, 12)).values()) == [["8"]]
    assert list(divisors(lambda a, b: (flat_t(a), flat_t(b)), x(8, 12), x(8, 12)).values()) == [["8", "8"]]
    shared = divisors(lambda a, b: (flat_t(a), flat_t(b)), x(8, 12), x(16, 24))
    assert len(shared) == 1 and re.fullmatch(r"ks\d", list(shared.values())[0][0])


ONLINE = {"softmax": (lambda x: torch.softmax(x, -1), 2),  # (the second loop stores the probabilities)
          "log_softmax": (lambda x: torch.log_softmax(x, -1), 2),
          "cross_entropy": (lambda x: torch.nn.functional.cross_entropy(x, torch.arange(6, device=x.device) * 997,
                                                                        reduction="none"), 1)}


@pytest.mark.parametrize("name", ONLINE)
def test_long_rows_find_max_and_sum_of_exponentials_in_one_pass(name):
    """Rows too long for one block (a vocabulary's logits) are read once for softmax's max and
    sum(exp(x - max)) together (online softmax), with eager's results: a row all -inf, one
    holding +inf, one holding NaN, one mostly -inf."""
    fn, loops = ONLINE[name]
    x = torch.randn(6, 5000, device=DEVICE) * 3
    x[1], x[2, 7], x[3, 11], x[4, :4000] = float("-inf"), float("inf"), float("nan"), float("-inf")
    cf = fuselens.compile(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cf(x)
    torch.testing.assert_close(got, fn(x), equal_nan=True, rtol=1e-5, atol=1e-5)
    (kernel,) = [k for e in fuselens.inspect(cf) for k in e.kernels if "amax" in k.name]
    assert kernel.source.count("for roffset") == loops, kernel.source


def test_reductions_joining_an_online_loop_read_only_computed_ones():
    """After a max and its sum of exponentials, a reduction joins their loop only if every
    reduction it reads is computed by then: `t` reads `q`, which is passed over between the max
    and its sum (it reads `r1`), so `t` waits for `q`'s loop (it had read q's summand instead)."""
    def fn(x):
        m = x.amax(-1, keepdim=True)
        r1 = x.sum(-1, keepdim=True)
        q = (x * r1).sum(-1, keepdim=True)
        s = torch.exp(x - m).sum(-1, keepdim=True)
        return m, r1, q, s, (x * q).sum(-1, keepdim=True)
    check(fn, randn(4, 5000), grad=False, rtol=1e-4, atol=1e-2)


def test_max_autotune_tries_more_block_sizes():
    default = launcher.configs("pointwise", 1 << 20, 1, interpret=False, max_autotune=False)
    more = launcher.configs("pointwise", 1 << 20, 1, interpret=False, max_autotune=True)
    assert len(more) > len(default) == 1  # default mode: one config (no autotuning compiles)
    assert len(launcher.configs("looped", 4096, 8192, interpret=False, max_autotune=False)) > 1
    assert launcher.configs("persistent", 64, 100, interpret=False, max_autotune=False)[0].RBLOCK == 128


def test_persistent_reductions_keep_the_gpu_busy():
    """A block holds as many rows as fit, unless that leaves fewer than MIN_PROGRAMS programs:
    a bias gradient's second stage (768 columns of 256 partials) gets 384 programs, not 24. Timed
    against it: blocks of about 1024 elements, where those are fewer rows."""
    def programs(xnumel, rnumel):
        config, *other = launcher.configs("persistent", xnumel, rnumel, interpret=False, max_autotune=False)
        return launcher.grid0("persistent", (xnumel, rnumel), config), config.XBLOCK, [c.XBLOCK for c in other]
    assert programs(768, 256) == (384, 2, [])
    assert programs(1 << 16, 768) == (8192, 8, [1])  # many rows: the largest block, or one row
    assert programs(100, 4096) == (100, 1, [])


def test_pointwise_warps_follow_the_narrowest_dtype():
    # 1024 elements a block: fp32 4 elements a thread (one 16-byte load), half types 16
    warps = lambda itemsize: launcher.configs("pointwise", 1 << 20, 1, False, False, itemsize=itemsize)[0].num_warps
    assert (warps(8), warps(4), warps(2), warps(1)) == (8, 8, 2, 2)


def test_stages_log_what_they_built(caplog):
    import logging
    with caplog.at_level(logging.DEBUG, logger="fuselens"):
        run(manual_softmax, randn(4, 6))
    text = caplog.text
    assert "prim_amax" in text  # ops: the primitive graph
    assert "buf0 = max of [4, 6] over dims [1]" in text  # lower
    assert "kernel (reduction over [4, 6] reducing dims [1]): buf0, buf1, buf2; stores buf2" in text  # schedule
    assert "def fl_red_fused_amax_div_exp_sub_sum_0(" in text  # codegen


def test_a_value_computed_twice_is_computed_once():
    # two equal sums (what the two BatchNorms of a downsample block's backward both take of one
    # gradient): one accumulator in the kernel, not two
    # (2048 rows: summed in partials, each partial its own accumulator)
    def f(x):
        return x.sum(0) * (x - 1).sum(0) + x.sum(0)
    cg = check(f, randn(2048, 8), grad=False, atol=1e-4, rtol=1e-4)
    assert len(set(re.findall(r"\bbuf\d+_partial\b", cg.wrapper_source))) == 2


def test_equal_outputs_stay_two_tensors():
    # merged, the caller would get one tensor twice: a write into one would show in the other
    def f(x):
        return x + 1, x + 1
    x = randn(8)
    cg, (a, b) = run(f, x)
    assert a is not b
    a.mul_(0)
    torch.testing.assert_close(b, x + 1)


def test_equal_numbers_of_other_types_are_not_merged():
    # an int tensor times 1 stays int, times 1.0 becomes float; adding -0.0 keeps a -0.0, adding
    # 0.0 does not; -(+0.0) is -0.0 (on a GPU, Triton <= 3.6 made a -0.0 constant +0.0 and `-x` 0 - x)
    def f(i, x):
        return i * 1, i * 1.0, x + 0.0, x + -0.0, torch.where(x > 0, x, -0.0), -x
    i, x = torch.arange(4, device=DEVICE), torch.tensor([-0.0, 1.0, 0.0], device=DEVICE)
    cg, got = run(f, i, x)
    for g, w in zip(got, f(i, x)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)
        assert torch.equal(torch.signbit(g), torch.signbit(w)) if g.is_floating_point() else True

