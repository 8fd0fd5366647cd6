"""Building a program's C++ kernels (codegen/cpp.py) into a shared library and calling them.

A program's kernels are one translation unit: the preamble below (half-precision types, the
primitives' C++ helpers, philox random numbers; a precompiled header) and each kernel's
`extern "C"` function. The
system compiler builds it (`CXX`, else g++, clang++ or c++ on the PATH) with -O3 -march=native
and OpenMP into `<cache dir>/cpp/<hash>.so`, the hash of the source, the compiler and its flags:
a later program or process with the same kernels loads the library built before. The build runs
in the background from when the program is built; the first launch waits for it. The library is
loaded in-process with ctypes (no Python headers: a build is the compiler's time on the kernels
alone); its OpenMP runtime is torch's own libgomp where torch ships one under that name (the
loader finds it already loaded), so torch.set_num_threads sizes the kernels' thread teams too.
A compiler that refuses -fopenmp (Apple's clang) builds without it: the kernels then run on one
thread.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading

from .. import settings
from .cpp_vml import PREAMBLE as VML_PREAMBLE

log = logging.getLogger("fuselens.codegen")

PREAMBLE = r"""#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

static inline uint32_t fl_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
static inline float fl_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
// a selection of floats by bit masks, without a branch: gcc leaves loops of `c ? a : b` on floats
// unvectorised where c is computed apart from a and b ("relevant stmt not supported"), a masked
// max pool's interior among them (its loop vectorises with this)
template <class T> static inline T fl_where(bool c, T a, T b) {
    if constexpr (std::is_same_v<T, float>) {
        uint32_t m = 0u - uint32_t(c);
        return fl_float((fl_bits(a) & m) | (fl_bits(b) & ~m));
    } else return c ? a : b;
}
// bfloat16 in memory (uint16_t); converted from float rounded to nearest even, NaN made quiet (as
// c10::BFloat16), without branches: loops of them vectorise
static inline float fl_round_bf16(float x) {
    uint32_t u = fl_bits(x), nan = 0u - uint32_t(x != x);
    return fl_float((((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u) & ~nan) | (0x7fc00000u & nan));
}
// the same of a float that is not NaN or whose NaN has its low 16 bits clear (quiet: bit 22 set),
// as every NaN computed by float arithmetic from bf16 values is (codegen/cpp_expressions.py's
// `wild`): adding the rounding bias then cannot carry out of its mantissa, no NaN test is needed
// (bf16 GeLU 8.2 -> 5.3 ms on one thread)
static inline float fl_round_bf16_tame(float x) {
    uint32_t u = fl_bits(x);
    return fl_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}
static inline float fl_from_bf16(uint16_t b) { return fl_float(uint32_t(b) << 16); }
static inline uint16_t fl_to_bf16(float x) { return uint16_t(fl_bits(fl_round_bf16(x)) >> 16); }
// a float already a bf16 value (rounded): its upper half
static inline uint16_t fl_bf16_bits(float x) { return uint16_t(fl_bits(x) >> 16); }
static inline float fl_round_f16(float x) { return float(_Float16(x)); }
// float -> integer as eager converts (a C++ cast is undefined out of range, and gcc folds
// float(int64_t(x)) into a truncation that keeps NaN): NaN and values out of range are
// x86-64's "integer indefinite" (the minimum), where AArch64 saturates (NaN 0); types narrower
// than 32 bits go through int32 and wrap, uint32 through int64, as static_cast compiles
#if defined(__x86_64__) || defined(__i386__)
#define FL_CVT_SATURATES 0
#else
#define FL_CVT_SATURATES 1
#endif
template <class I, class F> static inline I fl_to_int(F x) {
    using W = std::conditional_t<(sizeof(I) == 8 || std::is_same_v<I, uint32_t>), int64_t, int32_t>;
    constexpr F lo = -F(uint64_t(1) << (8 * sizeof(W) - 1)), hi = -lo;  // (exact in float)
    // selections by bit masks, without `&&` or `?:`, which leave the loop unvectorised
    W in_range = -W((x >= lo) & (x < hi)), w = W(fl_where(bool(in_range), x, F(0)));
    W out_of_range = std::numeric_limits<W>::min();
    if constexpr (FL_CVT_SATURATES) {
        W nan = -W(x != x), high = -W(x >= hi);
        out_of_range = (std::numeric_limits<W>::max() & high) | (std::numeric_limits<W>::min() & ~high & ~nan);
    }
    return I((w & in_range) | (out_of_range & ~in_range));
}

// Float math as eager computes it on the CPU: ATen's vectorised kernels call SLEEF, which libtorch
// exports; each function below is declared `omp declare simd`, its vector variants (x86-64's vector
// ABI names: SSE b, AVX c, AVX2 d, AVX-512 e) and its scalar version (the loops' remainders) call
// the same SLEEF routine, so the compiler vectorises loops calling it and every lane computes what
// eager's does. Elsewhere (no AVX2, another architecture) the C library's.
#if defined(__AVX2__) && defined(__x86_64__) && defined(FL_SLEEF)
#include <immintrin.h>
#if defined(__AVX512F__)
#define FL_E16(...) __VA_ARGS__
#else
#define FL_E16(...)
#endif
#define FL_SLEEF1(fn, s8, s16) \
    extern "C" __m256 s8(__m256); FL_E16(extern "C" __m512 s16(__m512);) \
    _Pragma("omp declare simd notinbranch") extern "C" float fn(float); \
    extern "C" __m128 _ZGVbN4v_##fn(__m128 x) { return _mm256_castps256_ps128(s8(_mm256_castps128_ps256(x))); } \
    extern "C" __m256 _ZGVcN8v_##fn(__m256 x) { return s8(x); } \
    extern "C" __m256 _ZGVdN8v_##fn(__m256 x) { return s8(x); } \
    FL_E16(extern "C" __m512 _ZGVeN16v_##fn(__m512 x) { return s16(x); }) \
    extern "C" float fn##_scalar(float x) { return _mm256_cvtss_f32(s8(_mm256_set1_ps(x))); } \
    asm(".globl " #fn "\n.set " #fn ", " #fn "_scalar");
#define FL_SLEEF2(fn, s8, s16) \
    extern "C" __m256 s8(__m256, __m256); FL_E16(extern "C" __m512 s16(__m512, __m512);) \
    _Pragma("omp declare simd notinbranch") extern "C" float fn(float, float); \
    extern "C" __m128 _ZGVbN4vv_##fn(__m128 x, __m128 y) { \
        return _mm256_castps256_ps128(s8(_mm256_castps128_ps256(x), _mm256_castps128_ps256(y))); } \
    extern "C" __m256 _ZGVcN8vv_##fn(__m256 x, __m256 y) { return s8(x, y); } \
    extern "C" __m256 _ZGVdN8vv_##fn(__m256 x, __m256 y) { return s8(x, y); } \
    FL_E16(extern "C" __m512 _ZGVeN16vv_##fn(__m512 x, __m512 y) { return s16(x, y); }) \
    extern "C" float fn##_scalar(float x, float y) { return _mm256_cvtss_f32(s8(_mm256_set1_ps(x), _mm256_set1_ps(y))); } \
    asm(".globl " #fn "\n.set " #fn ", " #fn "_scalar");
#define FL_MATH1(name, sleef) FL_SLEEF1(fl_##name##f, Sleef_##sleef##8_u10, Sleef_##sleef##16_u10)
#define FL_MATH2(name, sleef, u) FL_SLEEF2(fl_##name##f, Sleef_##sleef##8_##u, Sleef_##sleef##16_##u)
#else
#define FL_MATH1(name, sleef) static inline float fl_##name##f(float x) { return std::name(x); }
#define FL_MATH2(name, sleef, u) static inline float fl_##name##f(float x, float y) { return std::name(x, y); }
#endif
FL_MATH1(exp2, exp2f) FL_MATH1(log, logf) FL_MATH1(log1p, log1pf) FL_MATH1(sin, sinf)
FL_MATH1(cos, cosf) FL_MATH1(tanh, tanhf) FL_MATH1(erf, erff)
FL_MATH2(pow, powf, u10) FL_MATH2(atan2, atan2f, u10) FL_MATH2(hypot, hypotf, u05)
// exp of a float: SLEEF's expf_u10 (the routine eager's float kernels call) written out, bit-equal to
// it on every float (tests/backend/test_cpp_kernels.py), inline so that loops calling it vectorise
// without a call per vector (no registers saved around it)
static inline float fl_expf(float d) {
    float qf = std::nearbyint(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = std::fma(qf, -0.693145751953125f, d);
    s = std::fma(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = std::fma(u, s, 0.00139304355252534151077271f);
    u = std::fma(u, s, 0.00833336077630519866943359f);
    u = std::fma(u, s, 0.0416664853692054748535156f);
    u = std::fma(u, s, 0.166666671633720397949219f);
    u = std::fma(u, s, 0.5f);
    u = 1.0f + std::fma(s * s, u, s);
    // u * 2^q as two powers of two (2^q alone may not be a float); q of NaN or beyond +-256 is 0 (the
    // selections below decide there). Selections by bit masks, not fmin/fmax or `?:`: with those
    // gcc leaves a loop calling another function besides unvectorised ("control flow in loop")
    int32_t q = int32_t(fl_where(std::fabs(qf) < 256.0f, qf, 0.0f)), h = q >> 1;
    u = u * fl_float(uint32_t(h + 0x7f) << 23) * fl_float(uint32_t(q - h + 0x7f) << 23);
    u = fl_where(d < -104.0f, 0.0f, u);
    return fl_where(100.0f < d, std::numeric_limits<float>::infinity(), u);
}
template <class T> static inline T fl_exp(T x) {
    if constexpr (std::is_same_v<T, float>) return fl_expf(x); else return std::exp(x);
}
// erf as ATen's Vectorized<float>::erf computes it (Abramowitz and Stegun 7.1.26 with SLEEF's exp):
// eager's bf16/fp16 erf kernels compute it in float (SLEEF's erf differs after rounding on 28690 of
// the 65536 bf16 values), and GeLU's erf uses it (ops/primitives.py's gelu_erf)
static inline float fl_erf_aten(float x) {
    float t = 1.0f / std::fma(0.3275911f, std::fabs(x), 1.0f);
    float r = std::fma(1.061405429f, t, -1.453152027f);
    r = std::fma(r, t, 1.421413741f);
    r = std::fma(r, t, -0.284496736f);
    r = std::fma(r, t, 0.254829592f);
    return std::copysign(std::fma(-fl_expf(-(x * x)) * t, r, 1.0f), x);
}
#define FL_FLOAT_OR_STD1(name) template <class T> static inline T fl_##name(T x) { \
    if constexpr (std::is_same_v<T, float>) return fl_##name##f(x); else return std::name(x); }
#define FL_FLOAT_OR_STD2(name) template <class T> static inline T fl_##name(T x, T y) { \
    if constexpr (std::is_same_v<T, float>) return fl_##name##f(x, y); else return std::name(x, y); }
FL_FLOAT_OR_STD1(exp2) FL_FLOAT_OR_STD1(log) FL_FLOAT_OR_STD1(log1p) FL_FLOAT_OR_STD1(sin)
FL_FLOAT_OR_STD1(cos) FL_FLOAT_OR_STD1(tanh) FL_FLOAT_OR_STD1(erf) FL_FLOAT_OR_STD2(atan2) FL_FLOAT_OR_STD2(hypot)

template <class T> static inline T fl_abs(T x) {
    if constexpr (std::is_floating_point_v<T>) return std::fabs(x);
    else if constexpr (std::is_signed_v<T>) return x < 0 ? T(-x) : x;
    else return x;
}
template <class T> static inline T fl_rsqrt(T x) { return T(1) / std::sqrt(x); }
template <class T> static inline T fl_sigmoid(T x) { return T(1) / (T(1) + fl_exp(-x)); }
template <class T> static inline T fl_floor(T x) { if constexpr (std::is_floating_point_v<T>) return std::floor(x); else return x; }
template <class T> static inline T fl_ceil(T x) { if constexpr (std::is_floating_point_v<T>) return std::ceil(x); else return x; }
// integer division truncates; by 0 it gives 0 and by -1 it negates (no trap: eager raises first)
// what a bf16 divisor is scaled by before its reciprocal is taken (codegen/cpp_expressions.py's
// bf16_quotient): 2^64 where it is denormal (1/b would overflow), else 1
static inline float fl_recip_scale(float b) {
    return fl_where(b != 0.0f && std::fabs(b) < 0x1p-126f, 0x1p64f, 1.0f);
}
template <class T> static inline T fl_div(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return a / b;
    else return b == 0 ? T(0) : b == T(-1) ? T(-a) : T(a / b);
}
template <class T> static inline T fl_pow(T a, T b) {
    if constexpr (std::is_same_v<T, float>) return fl_powf(a, b);
    else if constexpr (std::is_floating_point_v<T>) return std::pow(a, b);
    else {  // as ATen's integer pow: by squaring; negative powers of other than +-1 are 0
        if (b < 0) return a == 1 ? T(1) : a == T(-1) ? T((b & 1) ? -1 : 1) : T(0);
        T out = 1;
        while (b) { if (b & 1) out = T(out * a); b >>= 1; a = T(a * a); }
        return out;
    }
}
// NaN from either operand propagates
template <class T> static inline T fl_maximum(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return a != a ? a : b != b ? b : a > b ? a : b;
    else return a > b ? a : b;
}
template <class T> static inline T fl_minimum(T a, T b) {
    if constexpr (std::is_floating_point_v<T>) return a != a ? a : b != b ? b : a < b ? a : b;
    else return a < b ? a : b;
}
// philox 4x32-10 of (offset, 0, 0, 0) under key `seed`: uniform floats in [0, 1), normal ones by Box-Muller
static inline void fl_philox(int64_t seed, uint32_t offset, uint32_t& o0, uint32_t& o1) {
    uint32_t c0 = offset, c1 = 0, c2 = 0, c3 = 0, k0 = uint32_t(seed), k1 = uint32_t(uint64_t(seed) >> 32);
    for (int i = 0; i < 10; i++) {
        uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
        uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
        c1 = uint32_t(p1); c3 = uint32_t(p0); c0 = n0; c2 = n2;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    o0 = c0; o1 = c1;
}
static inline float fl_uniform(uint32_t x) { return float(x >> 8) * (1.0f / 16777216.0f); }
static inline float fl_rand(int64_t seed, uint32_t offset) { uint32_t a, b; fl_philox(seed, offset, a, b); return fl_uniform(a); }
static inline float fl_randn(int64_t seed, uint32_t offset) {
    uint32_t a, b; fl_philox(seed, offset, a, b);
    float u1 = std::fmax(fl_uniform(a), 1e-7f), u2 = fl_uniform(b);
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
}
""" + VML_PREAMBLE

# -fno-math-errno: sqrt and friends inline (and vectorise); no -ffast-math, which would drop NaN
# and reassociate float arithmetic; -fwrapv: integers wrap as torch's do; -ffp-contract=off: a
# product and a sum stay two roundings, as eager's two ops are (g++ 13 with AVX512-FP16 narrows
# fp16 arithmetic done in float back to fp16 and fused a*b + c across the rounding between them:
# 760 of 2112 fp16 results differed); the preamble's fma calls are written out
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno",
         "-fno-trapping-math", "-ffp-contract=off", "-w"]
OPENMP = ["-fopenmp"]


@functools.cache
def libtorch_exports(*names) -> bool:
    """Whether libtorch_cpu exports every one of `names`, made visible to the libraries loaded
    after it (the kernels call them)."""
    import torch
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        for name in names:
            getattr(lib, name)
    except (OSError, AttributeError):
        return False
    return True


def sleef_flags() -> list:
    """["-DFL_SLEEF"] where libtorch exports SLEEF's vector math (x86-64 builds) for the
    preamble's float math, else []."""
    return ["-DFL_SLEEF"] if libtorch_exports("Sleef_expf8_u10", "Sleef_hypotf8_u05") else []


@functools.cache
def vector_width_flags() -> list:
    """["-mprefer-vector-width=512"] where -march=native enables AVX-512: g++ otherwise tunes
    most x86-64 CPUs for 256-bit vectors, half the lanes (Inductor's C++ uses 512-bit vectors
    there too; bf16 layer norm 3.7 -> 2.9 ms on 2 threads), else []."""
    try:
        macros = subprocess.run([compiler(), "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-mprefer-vector-width=512"] if "__AVX512F__" in macros else []


def flags() -> list:
    return FLAGS + vector_width_flags() + sleef_flags()


@functools.cache
def compiler() -> str | None:
    """The C++ compiler kernels are built with, or None where there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


@functools.cache
def compiler_identity() -> str:
    """The compiler's path and version line (a library built by another is built again)."""
    cxx = compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{cxx}\n{version.splitlines()[0] if version else ''}"


NO_COMPILER = ("no C++ compiler found (install g++ or clang, or set CXX to one): CPU graphs run as plain "
               "PyTorch")


_lock = threading.Lock()
_libraries: dict = {}  # hash -> CppLibrary (one build and one load per source in a process)


@atexit.register
def _finish_builds():
    """Builds still running at exit (programs never called) are waited for: no compiler process
    outlives the one that started it."""
    for lib in list(_libraries.values()):
        if lib._build is not None:
            try:
                lib.wait()
            except Exception:  # noqa: BLE001 (its program never ran: nothing to report)
                pass


def _hash(*parts) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _write_whole(path, text):
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@functools.cache
def preamble_header() -> str:
    """The preamble as a header in the cache directory, precompiled for the build's flags: a
    library's build then reads the precompiled header instead of parsing the C++ headers it
    includes (0.40 -> 0.14 s a small library with g++ 12). Built once per preamble, compiler and
    flags; where the compiler cannot precompile it, each build parses it."""
    directory = os.path.join(settings.cache_dir(), "cpp")
    os.makedirs(directory, exist_ok=True)
    used = [f for f in flags() + OPENMP if f != "-shared"]
    path = os.path.join(directory, f"fl_preamble_{_hash(compiler_identity(), *used, PREAMBLE)}.h")
    if not os.path.exists(path):
        _write_whole(path, PREAMBLE)
    if not os.path.exists(path + ".gch"):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.gch"
        done = subprocess.run([compiler(), *used, "-x", "c++-header", path, "-o", tmp], capture_output=True)
        if done.returncode == 0:
            os.replace(tmp, path + ".gch")
        else:
            log.debug("fuselens: the C++ preamble is not precompiled: %s", done.stderr[-2000:])
    return path


class CppLibrary:
    """A translation unit of kernels: built in the background (`start`), loaded at first use (`lib`)."""

    def __init__(self, kernels: str):
        self.source = f'#include "{preamble_header()}"\n{kernels}'
        key = _hash(compiler_identity(), *flags(), *OPENMP, self.source)
        self.directory = os.path.join(settings.cache_dir(), "cpp")
        self.path = os.path.join(self.directory, f"k{key}.so")
        self._build = None  # (process, temporary path, flags) while building
        self._lib = None
        self._lock = threading.Lock()

    @staticmethod
    def of(kernels: str) -> "CppLibrary":
        """The library of `kernels` (their source), shared by every program with the same kernels;
        its build started."""
        lib = CppLibrary(kernels)
        with _lock:
            lib = _libraries.setdefault(lib.path, lib)
        lib.start()
        return lib

    def start(self, with_flags=None):
        with self._lock:
            if self._lib is not None or self._build is not None or os.path.exists(self.path):
                return
            os.makedirs(self.directory, exist_ok=True)
            used = flags() + OPENMP if with_flags is None else with_flags
            src = f"{self.path[:-3]}.{os.getpid()}.{threading.get_ident()}.cpp"
            with open(src, "w") as f:
                f.write(self.source)
            out = f"{src[:-4]}.so"
            process = subprocess.Popen([compiler(), *used, src, "-o", out], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            self._build = (process, src, out, used)

    def wait(self):
        """The library's path, once built (raises with the compiler's messages if it failed)."""
        while True:
            with self._lock:
                build = self._build
                if build is None:
                    break
                process, src, out, used = build
                messages, _ = process.communicate()
                self._build = None
                os.unlink(src)
                if process.returncode == 0:
                    os.replace(out, self.path)
                    break
            if used != flags():  # without OpenMP, which some compilers refuse
                log.warning("fuselens: %s failed with OpenMP, building the CPU kernels single-threaded:\n%s",
                            compiler(), messages[-2000:])
                self.start(flags())
                continue
            raise RuntimeError(f"{compiler()} failed on the generated C++ kernels:\n{messages[-4000:]}")
        return self.path

    @property
    def lib(self):
        if self._lib is None:
            self.start()
            self._lib = ctypes.CDLL(self.wait())
        return self._lib


class CppKernel:
    """A generated C++ kernel as the wrapper calls it: `kernel.launch(*args) or kernel.run(*args,
    xnumel=...)`, args being tensors first, then scalars (the seed, size arguments): the
    function is called with the tensors' data pointers."""

    def __init__(self, name, source, library: CppLibrary, n_tensors: int, n_scalars: int):
        self.name, self.source, self.library = name, source, library
        self.n_tensors, self.n_scalars = n_tensors, n_scalars
        self.call_sizes = None  # (set by the wrapper's generation, as for TritonKernel)
        self.launch = self._first_launch

    def _first_launch(self, *args):
        fn = getattr(self.library.lib, self.name)
        fn.argtypes = [ctypes.c_void_p] * self.n_tensors + [ctypes.c_int64] * self.n_scalars
        n = self.n_tensors
        if f'extern "C" int {self.name}(' in self.source:  # (a write at positions read from a tensor: codegen/cpp.py)
            fn.restype = ctypes.c_int

            def launch(*args):
                if fn(*[t.data_ptr() for t in args[:n]], *args[n:]):
                    raise IndexError(f"{self.name}: an index out of range of the tensor it writes into")
                return True
        else:
            fn.restype = None

            def launch(*args):
                fn(*[t.data_ptr() for t in args[:n]], *args[n:])
                return True
        self.launch = launch
        return launch(*args)

    def run(self, *args, xnumel, rnumel=None):
        if xnumel:
            self.launch(*args)
