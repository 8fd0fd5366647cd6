"""The C++ kernels of CPU graphs (codegen/cpp.py, cpp_build.py), whatever FUSELENS_CPU_BACKEND the
run has: each test chooses the C++ backend itself. Their structure (parallel outer loops,
vectorised inner ones, checked with the compiler's own report), the library cache, the fallback
where there is no compiler, and semantics where C++ and torch differ by default (integer
wrap-around, NaN in max, half-precision rounding, dynamic sizes)."""
import math
import re
import subprocess
import warnings

import pytest
import torch

from fl_backend_testing import check, compile, run
from fuselens import FuselensWarning, settings
from fuselens.backend import driver
from fuselens.codegen import cpp_build, cpp_vml, wrapper
from test_fusion import manual_layer_norm, manual_softmax

pytestmark = pytest.mark.skipif(cpp_build.compiler() is None, reason="no C++ compiler")


@pytest.fixture(autouse=True)
def cpp_backend(monkeypatch):
    monkeypatch.setattr(settings, "CPU_BACKEND", "cpp")


def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))




def vectorized_loops(kernel_source):
    """Lines of the library of one kernel that the compiler reports vectorising (gcc's -fopt-info):
    the library's source is the preamble's #include, an empty line, then the kernel."""
    library = cpp_build.CppLibrary("\n" + kernel_source)  # (as the driver makes it; not built here)
    path = library.path[:-3] + ".check.cpp"
    with open(path, "w") as f:
        f.write(library.source)
    flags = [f for f in cpp_build.flags() if f != "-shared"]
    out = subprocess.run([cpp_build.compiler(), *flags, *cpp_build.OPENMP, "-c", path, "-o", "/dev/null",
                          "-fopt-info-vec-optimized"], capture_output=True, text=True)
    return {int(line.split(":")[1]) for line in out.stderr.splitlines() if "loop vectorized" in line}


def erf_times_exp(x):
    """erf (a call to SLEEF's vector routine) and exp (inline) in one loop, as a GeLU's gradient:
    gcc vectorised neither while exp had `?:` selections."""
    return torch.erf(x) * torch.exp(-x * x)


def masks_as_floats(x, m):
    """bool values as floats, loaded (a mask tensor) and computed (an amax's gradient mask), summed:
    gcc vectorised neither a load through `const bool*` nor a bool-to-float conversion, and the
    sum then added in one lane (its rounding error ~8x that of lanes)."""
    return (x * m).sum(-1), ((x == x.amax(-1, keepdim=True)).float() * x).sum(-1)


def floats_through_ints(x):
    """Conversions to integers and back (fl_to_int: eager's results out of range, by selections
    that vectorise)."""
    return (x * 3).long().float() + (x * 2).int().float() + (x * 2).to(torch.uint8).float()


@pytest.mark.parametrize("fn,shapes", [(gelu, [(64, 512)]), (manual_softmax, [(64, 512)]), (erf_times_exp, [(64, 512)]),
                                       (manual_layer_norm, [(64, 512), (512,), (512,)]),
                                       (masks_as_floats, [(64, 512), lambda: torch.rand(64, 512) > 0.5]),
                                       (floats_through_ints, [(64, 512)])])
def test_kernels_share_rows_among_threads_and_every_inner_loop_vectorises(fn, shapes):
    """Outer loops `omp parallel for` (the domain is worth threads), inner loops `omp simd`, and
    the compiler vectorises every one of them (exp and erf through SLEEF's vector variants)."""
    inputs = [torch.randn(*s) if isinstance(s, tuple) else s() for s in shapes]
    cg = check(fn, *inputs, grad=False)
    (kernel,) = cg.kernels
    assert "#pragma omp parallel for" in kernel.source
    if "gcc" not in cpp_build.compiler_identity().lower() and "g++" not in cpp_build.compiler_identity():
        return  # (-fopt-info is gcc's)
    lines = kernel.source.split("\n")
    simd_loops = [i + 2 for i, line in enumerate(lines) if "#pragma omp simd" in line]  # the `for` after it
    assert simd_loops
    offset = 2  # (vectorized_loops)
    vectorized = vectorized_loops(kernel.source)
    # (gcc names a loop by its `for` line or its body's first line)
    assert all({i + offset, i + offset + 1} & vectorized for i in simd_loops), (simd_loops, vectorized)


def test_a_long_row_is_split_among_threads_and_a_column_sum_walks_rows():
    x, y = torch.randn(4, 65536), torch.randn(256, 512)
    cg = check(lambda x, y: (x.sum(), y.amax(0)), x, y, grad=False)
    whole, columns = cg.kernels
    # chunks of the row shared among threads, each summed in float lanes, the chunks' sums in double
    assert "#pragma omp parallel for reduction(+:acc" in whole.source
    assert "#pragma omp simd reduction(+:acc0_part)" in whole.source
    assert "xt +=" in columns.source  # tiles of columns, the rows walked in order


def test_a_float_sum_of_millions_is_as_close_as_eager_to_the_exact_sum():
    """Float lanes add at most SUM_CHUNK elements before a double takes their sum: 4M values near
    1 summed in float lanes alone drifted 2.3e-6 from the exact sum (each lane's total outgrows
    its values), 20x eager's error."""
    x = 1 + 0.01 * torch.randn(1 << 22)
    cg, (got,) = run(lambda x: (x.sum(),), x)
    exact = x.double().sum()
    assert abs(got.double() - exact) / exact <= max(2 * abs(x.sum().double() - exact) / exact, 1e-7)
    (kernel,) = cg.kernels
    assert "r0c += 1024" in kernel.source
    short, _ = run(lambda x: (x.sum(-1),), torch.randn(64, 56))  # (a row within one chunk: no chunk loop)
    assert "_part" in short.kernels[0].source and "c += 1024" not in short.kernels[0].source


def ops_called_alone(x):
    """Float ops a user calls alone (eager: MKL's routines), on values the kernel computes, on
    another such op's result and in a reduction, beside the same math inside composites (eager:
    ATen's vectorised code)."""
    y = x * 1.5
    return (torch.erf(y) + torch.tanh(x) * torch.exp(-x.abs()), torch.sin(torch.cos(y)) - torch.log(x.abs() + 1),
            torch.tanh(x).sum(-1), torch.nn.functional.gelu(x) + torch.softmax(x, -1))


@pytest.mark.skipif(not cpp_vml.available(), reason="libtorch without MKL's vector math")
@pytest.mark.parametrize("shape", [(3, 1000), (2, 2051), (1 << 16,)])
def test_float_ops_called_alone_compute_eagers_routines(shape):
    """Each is computed by eager's routine over chunks of the kernel's loops (codegen/cpp_vml.py):
    results equal eager's bit for bit (SLEEF's differed on 0.6-7% of elements), in kernels of
    outer parallel loops, of one loop shared among threads and of reductions; composites keep
    ATen's math; a training graph's forward calls them too."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    cg, got = run(ops_called_alone, x)
    want = ops_called_alone(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], atol=1e-4, rtol=1e-5)  # (sums of ~2000 in another order)
    torch.testing.assert_close(got[3], want[3])
    source = "".join(k.source for k in cg.kernels)
    assert all(f"{r}(" in source for r in cpp_vml.ROUTINES.values())
    composite, _ = run(lambda x: (torch.nn.functional.gelu(x) + torch.softmax(x, -1),), x)
    assert "vms" not in "".join(k.source for k in composite.kernels)
    trained = check(lambda x: torch.tanh(x * 2) * x, x)
    assert "vmsTanh(" in "".join(k.source for k in trained.kernels)


@pytest.mark.skipif(not cpp_vml.available(), reason="libtorch without MKL's vector math")
def test_float_ops_called_alone_over_lengths_a_kernel_takes_as_arguments():
    """Chunks of a loop whose length is a kernel argument (a dim made dynamic by a second length)."""
    import fuselens
    f = lambda x: torch.tanh(x) * torch.exp(x * 0.5)  # noqa: E731
    compiled = fuselens.compile(f)
    for n in (100, 3000, 37):
        x = torch.randn(3, n)
        assert torch.equal(compiled(x), f(x))
    (entry,) = [e for e in fuselens.inspect(compiled) if e.dynamic_dims]
    assert all("vmsTanh(" in k.source and "ks0" in k.source for g in entry.graphs for k in g.kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_computes_each_exponential_once(dtype):
    """exp(x - max) is computed in the sum's loop and kept in a row cache that the store's loop
    reads: one exp per element (a float32 `torch.exp` by eager's routine: codegen/cpp_vml.py),
    results as eager's."""
    x = torch.randn(64, 512).to(dtype)
    cg, (got,) = run(lambda x: (manual_softmax(x),), x)
    (kernel,) = cg.kernels
    exps = ("fl_exp(", "vmsExp(") if dtype == torch.bfloat16 or not cpp_vml.available() else ("vmsExp(", "fl_exp(")
    assert kernel.source.count(exps[0]) == 1 and exps[1] not in kernel.source and "row0[r1] = " in kernel.source
    want = manual_softmax(x)
    assert torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("source", [torch.float32, torch.float64])
def test_floats_converted_to_integers_equal_eagers_out_of_range(source):
    """NaN, infinities and values beyond the integer type convert as eager's do (a C++ cast is
    undefined there: gcc folded float(int64_t(x)) into a truncation that kept NaN), to every
    integer dtype, in and out of a round trip."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3e9, -3e9, 40000.0, 300.0,
                      255.9, 256.0, -129.0, -5.0, -0.7, 0.7, 70000.5], dtype=source).repeat(4)
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        f = lambda x: (x.to(dtype), x.to(dtype).to(source) * 2)  # noqa: E731
        _, got = run(f, x)
        for g, w in zip(got, f(x)):
            assert torch.equal(g, w), (dtype, g, w)


def test_a_sum_along_memory_rows_of_a_transposed_value_is_a_row_reduction():
    """A reduction whose kept dim is innermost in the kernel but strided in memory (the bias
    gradient of a transposed operand) reads each row in order, not column tiles that gather every
    element (gcc took 23 s to compile one such kernel of SegFormer's backward)."""
    g = torch.randn(256, 1024).bfloat16()
    cg, (got,) = run(lambda g: ((g.t() * 2).sum(0),), g)
    (kernel,) = cg.kernels
    assert "acc0[" not in kernel.source and "reduction(+:acc0_part)" in kernel.source
    assert torch.equal(got, (g.t() * 2).sum(0))


def test_a_channels_last_batch_norms_backward_walks_memory_in_order():
    """Its input gradient reads the channels' sums: the column reduction (channels innermost,
    vectorised) keeps them in arrays of its tile and walks the rows again to store it. It was a
    thread per channel striding across the rows: 20 ms of MobileViT's step for one layer, 2.6 now."""
    x = torch.randn(2, 64, 24, 24).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(64) + 0.5, torch.randn(64)
    cg = check(lambda x, w, b: torch.nn.functional.silu(torch.nn.functional.batch_norm(x, None, None, w, b, True)),
               x, w, b)
    assert any("col0[" in k.source and "acc0[" in k.source for k in cg.kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transposing_kernel_walks_tiles(dtype):
    """A pointwise kernel that stores along a dim its loads stride (channels-last to NCHW, `.t()`
    then contiguous, at sizes that leave a partial tile) walks tiles of both dims, so each line it
    reads is used whole (a 16M-element copy of SegFormer's backward took 209 ms, 12 ns an element);
    results equal eager's."""
    x = torch.randn(2, 48, 40, 40).to(dtype).contiguous(memory_format=torch.channels_last)
    y = torch.randn(70, 100).to(dtype)
    for f, a in ((lambda x: (x * 2).contiguous(), x), (lambda y: y.t().contiguous() + 1, y)):
        cg, (got,) = run(lambda a: (f(a),), a)
        (kernel,) = cg.kernels
        assert "t += 32) {" in kernel.source
        assert torch.equal(got, f(a)) and got.stride() == f(a).stride()


def test_a_row_cache_keeps_its_values_dtype():
    """float64 values kept in a row cache are stored as doubles: a float array rounded them, and
    an amax's gradient, which compares each cached value with the max, found no maximum and
    divided by a count of zero (a random program's NaN gradients)."""
    x = torch.randn(64, 512, dtype=torch.float64)
    cg, (got,) = run(lambda x: (manual_softmax(x),), x)
    (kernel,) = cg.kernels
    assert "double row0[" in kernel.source
    torch.testing.assert_close(got, manual_softmax(x), rtol=1e-14, atol=1e-15)
    check(lambda y: (torch.tanh(y) / (y * y + 1), torch.tanh(y).amax(0, keepdim=True)),
          torch.randn(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_padded_pool_runs_its_interior_without_masks(channels_last):
    """A max pool with padding: where every mask holds (checked at both ends of the inner loop's
    interior range), a copy of the body without masks runs, and gcc vectorises it; along the
    inner dim (NCHW's columns) the border columns run the masked body."""
    import torch.nn.functional as F
    x = torch.randn(2, 16, 56, 56)  # (a stem's pool: rows long enough that any compiler's cost model vectorises)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    f = lambda x: (F.max_pool2d(torch.relu(x * 2.0), 3, 2, 1),)  # noqa: E731
    cg, (got,) = run(f, x)
    assert torch.equal(got, f(x)[0])
    (kernel,) = [k for k in cg.kernels if "bool interior" in k.source]
    lines = kernel.source.split("\n")
    loops = [i for i, line in enumerate(lines) if line.strip().startswith("for (") and "; x" in line]
    unmasked = [i for i in loops if " = lo; " in lines[i]]
    assert len(unmasked) == 1 and sum(" = hi; " in lines[i] for i in loops) == (0 if channels_last else 1)
    # gcc 12 (these machines') vectorises it; gcc 13.3 (the GPU host's) declines NCHW's stride-2
    # loads at 512-bit vectors ("no vectype"), channels-last's contiguous ones it vectorises
    if re.search(r"(gcc|g\+\+)[^\n]* 12\.", cpp_build.compiler_identity()) or channels_last \
            and "gcc" in cpp_build.compiler_identity().lower():
        assert {unmasked[0] + 3, unmasked[0] + 4} & vectorized_loops(kernel.source)  # (the `for`, 1-based, after 2 lines)


def test_training_runs_the_backward_kernels_in_cpp():
    w = torch.randn(32)
    cg = check(lambda x, w: manual_layer_norm(torch.tanh(x), w, w).sigmoid(), torch.randn(16, 32), w)
    assert all(k.source.startswith('extern "C"') for k in cg.kernels) and len(cg.kernels) >= 2


def test_half_precision_results_round_after_each_op():
    """Each op's result rounded to its dtype, as eager's ops store them. The reference computes each
    op exactly (float64: a product or sum of two half-precision values is exact there) and rounds
    it once; eager's own kernels are not the arbiter (on a CPU with AVX512-FP16, torch 2.11's fp16
    kernels differ from per-op rounding in the last bit of some elements)."""
    def rounded_ops(rounded):
        return lambda a, b: rounded(rounded(rounded(a * b) + a) * b) - a

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        a, b = (torch.randn(64, 33, generator=g).to(dtype) for _ in range(2))
        _, (got,) = run(rounded_ops(lambda t: t), a, b)
        expected = rounded_ops(lambda t: t.to(dtype).double())(a.double(), b.double()).to(dtype)
        assert torch.equal(got, expected), (got != expected).sum()


def every_value(dtype):
    """The 65536 values of a 16-bit float dtype (NaNs and infinities included), as one row."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)


def same_bits(got, want):
    """Equal bit for bit, NaN where eager has NaN (its NaN payloads differ between kernels)."""
    both_nan = got.isnan() & want.isnan()
    return bool(((got.view(torch.int16) == want.view(torch.int16)) | both_nan).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_exp_erf_and_gelu_equal_eagers_on_every_value(dtype):
    """exp (SLEEF's, inline) and erf (ATen's reduced-precision formula) in float, each rounded to
    the half type: eager's result bit for bit on all 65536 inputs."""
    x = every_value(dtype)
    _, got = run(lambda x: (torch.exp(x), torch.erf(x), gelu(x)), x)
    for g, w in zip(got, (torch.exp(x), torch.erf(x), gelu(x))):
        assert same_bits(g, w)


@pytest.mark.parametrize("fn,looked_up", [
    (gelu, "fl_table_"), (lambda x: torch.nn.functional.silu(x), "fl_table_"),
    (lambda x: torch.tanh(x) * torch.sigmoid(x), "fl_table_"), (manual_softmax, "fl_recip_scale"),
    (lambda x: x / x.abs().amax(-1, keepdim=True), "fl_recip_scale")], ids=["gelu", "silu", "tanh_sigmoid",
                                                                             "softmax", "row_divisor"])
def test_functions_of_one_bf16_value_are_tables_and_row_divisors_reciprocals(fn, looked_up):
    """A value computed from one bf16 value through heavy routines (not exp alone) is looked up in a
    table of the kernel's own results for the 65536 bf16 values (codegen/cpp_tables.py); a bf16 quotient by a
    row's bf16 value is a product with its reciprocal (cpp_expressions.py's bf16_quotient). Both
    give eager's bits on every input."""
    x = every_value(torch.bfloat16).reshape(256, 256)
    cg, (got,) = run(lambda x: (fn(x),), x)
    assert same_bits(got, fn(x))
    assert any(looked_up in k.source for k in cg.kernels)


def test_a_bf16_quotient_as_a_product_with_the_reciprocal_rounds_as_the_quotient():
    """bf16_quotient's premise: rounded to bf16, (a * (1 / (b * s))) * s equals a / b for bf16 a and
    b, s = 2^64 for a denormal b, else 1. Here for every b and every 16th a (all 2^32 pairs: 0
    differ; bench/NOTES.md 73); without s, 2058240 pairs with a denormal b differed."""
    import ctypes
    src = r'''
extern "C" int64_t fl_test_quotients(int64_t step) {
    int64_t differ = 0;
    #pragma omp parallel for reduction(+:differ)
    for (int64_t bi = 0; bi < 65536; bi++) {
        float b = fl_float(uint32_t(bi) << 16), s = fl_recip_scale(b), r = 1.0f / (b * s);
        #pragma omp simd reduction(+:differ)
        for (int64_t ai = 0; ai < 65536; ai += step) {
            float a = fl_float(uint32_t(ai) << 16);
            uint32_t q = fl_bits(fl_round_bf16(a / b)), p = fl_bits(fl_round_bf16((a * r) * s));
            differ += q != p && !((q & 0x7fffffffu) > 0x7f800000u && (p & 0x7fffffffu) > 0x7f800000u);
        }
    }
    return differ;
}
'''
    lib = ctypes.CDLL(cpp_build.CppLibrary.of(src).wait())
    lib.fl_test_quotients.restype = ctypes.c_int64
    assert lib.fl_test_quotients(ctypes.c_int64(16)) == 0


def test_nans_with_any_payload_stay_nan_in_bf16():
    """bf16 rounding skips its NaN test only for values whose NaNs have clear low bits (computed from
    bf16 values): float NaNs of any payload (signaling, all bits set) still round to NaN."""
    bits = torch.tensor([0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF - 2 ** 32, 0x7FBFFFFF, 0x7FC00000, 0x3F800000],
                        dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    y = torch.ones(6, dtype=torch.bfloat16)

    def f(x, y):
        return x.to(torch.bfloat16), (x * 1.0).to(torch.bfloat16) * y, torch.log(y - 2.0), torch.exp(x.to(torch.bfloat16))
    _, got = run(f, x, y)
    for g, w in zip(got, f(x, y)):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[~g.isnan()], w[~w.isnan()]), (g, w)


def test_float_exp_is_within_an_ulp_of_eagers():
    """fp32 exp is SLEEF's expf_u10 (1 ulp) written out; eager's may be another library's."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-110, 110, 1 << 16), torch.randn(1 << 16, generator=g) * 20,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.72, -87.33, 1e-30])])
    _, (got,) = run(lambda x: (torch.exp(x),), x)
    want = torch.exp(x)
    ulp = (torch.nextafter(want, torch.tensor(float("inf"))) - want).abs()
    close = ((got - want).abs() <= ulp) | (got == want) | (got.isnan() & want.isnan())
    assert bool(close.all()), x[~close][:8]


def test_integers_wrap_and_nan_propagates_as_in_torch():
    big = torch.tensor([2 ** 31 - 1, -2 ** 31, 7], dtype=torch.int32)
    small = torch.tensor([100, -100, 27], dtype=torch.int8)
    x = torch.tensor([[1.0, float("nan"), 3.0], [1.0, 2.0, 3.0]])

    def f(big, small, x):
        return big + big, small * 3, x.amax(1), torch.maximum(x, x.flip(1)), torch.pow(small, 2)
    _, got = run(f, big, small, x)
    for g, e in zip(got, f(big, small, x)):
        assert torch.equal(g, e) or torch.allclose(g, e, equal_nan=True), (g, e)


def test_a_library_is_built_once_per_source(monkeypatch):
    x = torch.randn(8, 16)
    fn = lambda x: torch.sigmoid(x) * x  # noqa: E731
    run(fn, x)
    builds = []
    real = subprocess.Popen
    monkeypatch.setattr(cpp_build.subprocess, "Popen", lambda *a, **k: builds.append(a) or real(*a, **k))
    cpp_build._libraries.clear()  # (as in a new process: the library is found on disk)
    _, (got,) = run(fn, x)
    assert builds == [] and torch.equal(got, fn(x))


def test_dynamic_sizes_are_kernel_arguments():
    x, w = torch.randn(6, 40), torch.randn(40)
    cg = compile(manual_layer_norm, x, w, w, dynamic_dims=[{0, 1}, {0}, {0}])
    assert "int64_t ks0" in cg.kernels[0].source
    for shape in ((6, 40), (3, 24)):
        x, w = torch.randn(*shape), torch.randn(shape[1])
        torch.testing.assert_close(cg(x, w, w)[0], manual_layer_norm(x, w, w))


def test_a_dynamic_graphs_static_sizes_are_its_kernels_literals():
    """Rows of a dynamic count, 48 wide (a transformer's tokens, its hidden size): the kernels
    take the row count as an argument and loop over the row's 48 as a static graph's do, a layer
    norm without chunks and the bias-GeLU written over the GEMM's result in place as in the
    static program (the dynamic entry's C++ kernels had been 13% slower than the static's on a
    BERT)."""
    import fuselens
    w, b = torch.randn(48, 48), torch.randn(48)

    def f(x):
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
        return torch.nn.functional.layer_norm(h, (48,))
    compiled = fuselens.compile(f)
    for n in (7, 9, 11):
        x = torch.randn(n, 48)
        torch.testing.assert_close(compiled(x), f(x))
    (entry,) = [e for e in fuselens.inspect(compiled) if e.dynamic_dims]
    source = "".join(k.source for k in entry.kernels)
    assert "< 48;" in source and "ks1" not in source and "r1c" not in source, source
    assert "in place" in "".join(entry.wrappers)


def test_without_a_compiler_one_warning_and_the_graph_runs_eagerly(monkeypatch):
    monkeypatch.setattr(cpp_build, "compiler", lambda: None)
    monkeypatch.setattr(driver, "_warned_no_compiler", False)
    x = torch.randn(4, 5)
    with pytest.warns(FuselensWarning, match="install g\\+\\+ or clang"):
        cg = driver.compile_graph(*_traced(manual_softmax, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(cg(x)[0], manual_softmax(x))  # eagerly, no second warning


def _traced(fn, *inputs):
    from fl_backend_testing import trace
    gm = trace(fn)
    for node, t in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs):
        node.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        node.meta["device"] = t.device
    return gm, list(inputs)


def test_every_pointwise_primitive_spelled_in_triton_is_spelled_in_cpp():
    from fuselens.ops.primitives import PRIMITIVES
    assert [n for n, p in PRIMITIVES.items() if p.kind == "pointwise" and p.triton and not p.cpp] == []


@pytest.mark.parametrize("channels, size, nhwc", [(3, 48, True), (192, 2, False)])
def test_convolutions_run_channels_last_where_the_activations_outweigh_the_weights(channels, size, nhwc):
    """oneDNN's NHWC convolutions save reordering activations, but an NCHW weight is copied to NHWC
    on every call: a stem-like conv (3 channels, a 48x48 image: activations >> weights) runs
    channels-last, a late conv on a 2x2 map (192 -> 192 3x3: weights >> activations) as eager."""
    conv = torch.nn.Conv2d(channels, 192, 3, padding=1)
    x = torch.randn(1, channels, size, size)
    cg = check(lambda x, w, b: torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)), x,
               conv.weight.detach(), conv.bias.detach(), grad=False, atol=1e-4, rtol=1e-4)
    assert (".permute(" in cg.wrapper_source) == nhwc, cg.wrapper_source


def test_a_value_stored_and_reduced_is_computed_once_in_the_reductions_loop():
    """A GeLU stored and averaged over each row (a squeeze-excite block's input): one loop over the
    row computes it, stores it and sums it (its tanh once an element), not a second loop."""
    def f(x, w):
        y = torch.nn.functional.gelu(x * w, approximate="tanh")
        return y, y.mean((2, 3), keepdim=True)
    cg = check(f, torch.randn(2, 8, 6, 10), torch.randn(1, 8, 1, 1), grad=False, atol=1e-5, rtol=1e-5)
    (kernel,) = [k for k in cg.kernels if "sum" in k.name]
    assert kernel.source.count("fl_tanh(") == 1 and kernel.source.count("for (int64_t r2") == 1, kernel.source


def huge_page_kb(address):
    """AnonHugePages (kB) of the mapping of this process that holds `address` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                lo, hi = (int(a, 16) for a in first.split("-"))
                inside = lo <= address < hi
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(wrapper._madvise() is None, reason="transparent huge pages are not given on request here")
@pytest.mark.parametrize("fn,shapes", [(lambda x: x * 2, [(8192, 2048)]),
                                       (lambda x, w: torch.nn.functional.linear(x, w), [(4096, 64), (4096, 64)])],
                         ids=["kernel", "product"])
def test_a_large_output_is_written_to_huge_pages(fn, shapes):
    """A program's buffers of HUGE_PAGE_MIN_BYTES or more ask for 2 MB pages before they are first
    written (a fresh 32 MB output faulted in 4 KB at a time took longer than the GeLU kernel
    writing it), a kernel's and an ATen product's alike (a language model's logits). 64 MB: torch's
    allocator takes it from mmap, untouched, on every call."""
    inputs = [torch.randn(s) for s in shapes]
    cg, (out,) = run(fn, *inputs)
    assert "empty_huge(" in cg.wrapper_source
    inside = -(-out.data_ptr() // wrapper.HUGE_PAGE) * wrapper.HUGE_PAGE  # (its first page stays 4 KB)
    assert huge_page_kb(inside) >= 2048
    assert torch.equal(out, fn(*inputs))
