"""fuselens's own compile and launch path (codegen/cuda.py), the parts that run without a GPU:
argument specialization, cubin cache keys and files, the launch function's parameter buffer
(read back through a stand-in for cuLaunchKernelEx), and Triton's stages compiling a cubin."""
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from fuselens import settings
from fuselens.codegen import cuda, launcher

P = types.SimpleNamespace
ROOT = pathlib.Path(__file__).resolve().parents[2]


def params(*names, seed=None, constexpr=("XBLOCK",)):
    return [launcher.Param(n, n in constexpr, n == seed) for n in names]


def test_specialization_follows_tritons_rules():
    x = torch.empty(64)
    ps = params("in_ptr0", "out_ptr0", "seed", "ks0", "ks1", "ks2", "xnumel", "XBLOCK", seed="seed")
    sig, consts, attrs = cuda.specialize(ps, (x, x[1:], 1, 1, 48, 2 ** 31 + 16), (100,), launcher.Config(128))
    assert sig == {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "seed": "i64", "ks0": "constexpr", "ks1": "i32",
                   "ks2": "i64", "xnumel": "i32", "XBLOCK": "constexpr"}
    assert consts == {(3,): 1, (7,): 128}  # the seed is never a constant, even when it is 1
    assert set(attrs) == {(0,), (4,), (5,)}  # aligned pointer, ints divisible by 16; not x[1:], not the seed
    bf = cuda.specialize(params("a", "xnumel", "XBLOCK"), (torch.empty(4, dtype=torch.bfloat16), 0.5), (),
                         launcher.Config(4))[0]
    assert bf == {"a": "*bf16", "xnumel": "fp32", "XBLOCK": "constexpr"}


def test_cache_key_covers_what_changes_the_cubin():
    x = torch.empty(64)
    ps = params("in_ptr0", "xnumel", "XBLOCK")
    spec = cuda.specialize(ps, (x,), (64,), launcher.Config(64))
    base = cuda.cache_key("src", "k", *spec, 4, 90)
    assert base == cuda.cache_key("src", "k", *spec, 4, 90)
    unaligned = cuda.specialize(ps, (x[1:],), (64,), launcher.Config(64))
    other_block = cuda.specialize(ps, (x,), (64,), launcher.Config(32))
    others = {cuda.cache_key("src2", "k", *spec, 4, 90), cuda.cache_key("src", "k", *spec, 8, 90),
              cuda.cache_key("src", "k", *spec, 4, 80), cuda.cache_key("src", "k", *unaligned, 4, 90),
              cuda.cache_key("src", "k", *other_block, 4, 90)}
    assert base not in others and len(others) == 5


def test_cubin_cache_compiles_once(tmp_path):
    calls = []

    def compile_fn():
        calls.append(1)
        return b"\x7fELF cubin", {"name": "k", "shared": 0, "num_warps": 4, "n_params": 3}
    first = cuda.cached_cubin(str(tmp_path), "key", compile_fn)
    second = cuda.cached_cubin(str(tmp_path), "key", compile_fn)
    assert first == second == (b"\x7fELF cubin", {"name": "k", "shared": 0, "num_warps": 4, "n_params": 3})
    assert calls == [1] and sorted(os.listdir(tmp_path)) == ["key.cubin", "key.json"]


class FakeDriver:
    """cuLaunchKernelEx's stand-in: reads the launch config and the parameters back through
    their pointers."""

    def __init__(self, codes):
        self.codes, self.calls, self.attrs = codes, [], []

    def cuLaunchKernelEx(self, config_ptr, function, params, extra):
        c = cuda.LaunchConfig.from_address(config_ptr.value)
        values = [ctypes.cast(params[i], ctypes.POINTER(ctype)).contents.value for i, ctype in enumerate(self.codes)]
        self.calls.append(((c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                           c.sharedMemBytes, c.hStream, values))
        self.attrs.append([(c.attrs[i].id, c.attrs[i].value) for i in range(c.numAttrs)])
        return 0


def test_launch_packs_parameters_and_refuses_what_it_was_not_built_for(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0x7F00_0000_1234, raising=False)
    u64, i64, i32, f32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    # in_ptr0, out_ptr0, seed (i64), ks1 (i32), scale (fp32), xnumel (i64), 2 scratch pointers
    fake = FakeDriver([u64, u64, i64, i32, f32, i64, u64, u64])
    monkeypatch.setattr(cuda, "_lib", fake)
    ps = params("in_ptr0", "out_ptr0", "seed", "ks0", "ks1", "scale", "xnumel", "XBLOCK", seed="seed")
    x, y = torch.empty(64), torch.empty(64)
    args, sizes, config = (x, y, 5, 1, 48, 0.5), (2 ** 33,), launcher.Config(1024, None, 8)
    spec = cuda.specialize(ps, args, sizes, config)
    binary = P(name="k", function=ctypes.c_void_p(1234), threads=256, shared=0, n_params=8)
    launch = cuda.make_launch(binary, ps, spec, args, sizes, grid=2 ** 23, device=0)
    assert launch(*args) and launch(x, y, 6, 1, 48, 0.25)
    assert fake.calls == [((2 ** 23, 1, 1), (256, 1, 1), 0, 0x7F00_0000_1234,
                           [x.data_ptr(), y.data_ptr(), seed, 48, scale, 2 ** 33, 0, 0])
                          for seed, scale in ((5, 0.5), (6, 0.25))]
    assert not launch(x[1:], y, 5, 1, 48, 0.5)  # compiled for an aligned in_ptr0
    assert not launch(x, y, 5, 2, 48, 0.5)      # ks0 was the constant 1
    assert not launch(x, y, 5, 1, 32, 0.5)      # another size
    assert not cuda.make_launch(binary, ps, spec, args, sizes, grid=2 ** 23, device=1)(*args)  # current is 0
    assert len(fake.calls) == 2 and fake.attrs == [[], []]
    # programmatic dependent launch: the one launch attribute that lets the kernel start early
    assert cuda.make_launch(binary, ps, spec, args, sizes, grid=2 ** 23, device=0, pdl=True)(*args)
    assert fake.calls[-1] == fake.calls[0]
    assert fake.attrs[-1] == [(cuda.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)]


def test_launch_error_names_the_kernel(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)

    class Failing(FakeDriver):
        def cuLaunchKernelEx(self, *a):
            return 719  # CUDA_ERROR_LAUNCH_FAILED

        def cuGetErrorName(self, err, out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_LAUNCH_FAILED"
            return 0
    monkeypatch.setattr(cuda, "_lib", Failing([]))
    ps = params("in_ptr0", "xnumel", "XBLOCK")
    x = torch.empty(16)
    spec = cuda.specialize(ps, (x,), (16,), launcher.Config(16))
    launch = cuda.make_launch(P(name="fl_kernel_3", function=ctypes.c_void_p(1), threads=128, shared=0, n_params=4),
                              ps, spec, (x,), (16,), grid=1, device=0)
    with pytest.raises(cuda.CudaError, match=r"719 \(CUDA_ERROR_LAUNCH_FAILED\) in cuLaunchKernelEx\(fl_kernel_3\)"):
        launch(x)


def test_wrapper_call_binds_the_launch_for_its_sizes_only(monkeypatch):
    # the wrapper calls `k.launch(*args) or k.run(*args, xnumel=...)`: `launch` must only ever be
    # a launch function built for the sizes of that call (they are not among its arguments)
    monkeypatch.setattr(settings, "INTERPRET", False)
    built = []

    def launch_for(self, args, sizes, config):
        def launch(*a):
            refuse = a[0] is not args[0]  # as a real one refuses arguments it was not built for
            calls.append((sizes, refuse))
            return not refuse
        built.append(sizes)
        return launch
    monkeypatch.setattr(launcher.TritonKernel, "launch_for", launch_for)
    calls = []
    k = launcher.TritonKernel("fl_poi_k_0", "source", "pointwise")
    k.call_sizes = (64,)
    x, y = torch.empty(64), torch.empty(64)
    assert not k.launch(x)  # nothing bound before a first run
    k.run(x, xnumel=32)  # not the wrapper's call: its launch is not bound
    assert not k.launch(x) and built == [(32,)]
    k.run(x, xnumel=64)
    assert k.launch(x) and built == [(32,), (64,)]
    assert not k.launch(y)  # refused: run builds one for these arguments, bound in its place
    k.run(y, xnumel=64)
    assert k.launch(y) and built == [(32,), (64,), (64,)]
    assert all(sizes == (64,) for sizes, _ in calls[1:])


@pytest.fixture
def gpu_stand_in(monkeypatch, tmp_path):
    """A launcher that autotunes as on a GPU (the interpreter has one config to try), on a GPU model
    named GPU-A, with its cache in tmp_path and no choices remembered yet."""
    monkeypatch.setattr(settings, "INTERPRET", False)
    monkeypatch.setenv("FUSELENS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launcher, "torch_cuda_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "GPU-A")
    monkeypatch.setattr(launcher, "_choices", {})


def test_autotuning_times_a_kernel_source_once_across_kernels_and_processes(monkeypatch, gpu_stand_in):
    # a model's identical kernels (its layers) and a later process reuse the choice: timing
    # candidates is a GPU run of each; a warm process also compiles only the chosen config ahead
    timed = []
    monkeypatch.setattr(launcher.TritonKernel, "autotune",
                        lambda self, args, sizes, candidates: timed.append((self.name, sizes)) or candidates[1])
    monkeypatch.setattr(launcher.TritonKernel, "launch_for", lambda self, args, sizes, config: lambda *a: True)
    source = "@triton.jit\ndef fl_red_k_{}(in_ptr0, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):\n"
    first, second = (launcher.TritonKernel(f"fl_red_k_{i}", source.format(i), "looped", itemsize=2)
                     for i in (3, 9))
    x = torch.empty(8)
    expected = launcher.configs("looped", 4096, 8192, False, False, None, 2)
    assert len(expected) > 1  # (else nothing to choose)
    first.run(x, xnumel=4096, rnumel=8192)
    second.run(x, xnumel=4096, rnumel=8192)
    assert timed == [("fl_red_k_3", (4096, 8192))]
    assert first.best == second.best and list(first.best.values()) == [expected[1]]
    sizes = (4096, 8192)
    assert [c for _, _, c in second.expected_launches([torch.bfloat16], [], sizes, 0)] == [expected[1]]
    second.run(x, xnumel=1024, rnumel=8192)  # other sizes: timed
    assert timed[-1] == ("fl_red_k_9", (1024, 8192))

    monkeypatch.setattr(launcher, "_choices", {})  # a later process: read from the cache directory
    third = launcher.TritonKernel("fl_red_k_5", source.format(5), "looped", itemsize=2)
    assert [c for _, _, c in third.expected_launches([torch.bfloat16], [], sizes, 0)] == [expected[1]]
    third.run(x, xnumel=4096, rnumel=8192)
    assert len(timed) == 2 and list(third.best.values()) == [expected[1]]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "GPU-B")  # another GPU model: timed
    assert len(third.expected_launches([torch.bfloat16], [], sizes, 0)) == len(expected)
    launcher.TritonKernel("fl_red_k_6", source.format(6), "looped", itemsize=2).run(
        x, xnumel=4096, rnumel=8192)
    assert len(timed) == 3


def test_autotuning_a_kernel_that_writes_over_its_input_times_it_on_copies(monkeypatch, gpu_stand_in):
    # the wrapper passes one buffer as an input and the output written over it (`# in place`):
    # each timed run would apply the kernel to its own result again; the call's run, once
    monkeypatch.setattr(launcher, "cubin_job", lambda *a: None)
    monkeypatch.setattr(launcher, "compile_concurrently", lambda jobs: None)
    monkeypatch.setattr(launcher.TritonKernel, "specialize", lambda self, args, sizes, config: ((None,), None))
    monkeypatch.setattr(launcher.TritonKernel, "launch_for",  # (a kernel doubling its input into its output)
                        lambda self, args, sizes, config: lambda x, y, out: out.copy_((x * 2 + y).view(-1)) is not None)
    monkeypatch.setattr(launcher, "gpu_time", lambda fn: [fn() for _ in range(3)] and 1.0)
    k = launcher.TritonKernel("fl_red_k_0", "@triton.jit\ndef fl_red_k_0(in_ptr0, in_ptr1, out_ptr0, xnumel, "
                              "rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):\n", "looped")
    x, y = torch.ones(4, 8), torch.ones(4, 8)
    k.run(x, y, x.view(32), xnumel=4096, rnumel=8192)
    assert torch.equal(x, torch.full((4, 8), 3.0)) and torch.equal(y, torch.ones(4, 8))


COMPILE = '''
import torch
from fuselens.codegen import cuda, launcher
src = """import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit(do_not_specialize=["seed"])
def k(in_ptr0, out_ptr0, seed, xnumel, RBLOCK_UNUSED, XBLOCK: tl.constexpr):
    gdc_wait()
    gdc_launch_dependents()
    x = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    tl.store(out_ptr0 + x, tl.load(in_ptr0 + x, x < xnumel) + tl.rand(seed, x), x < xnumel)
"""
fn = launcher.load_module(src).k
x = torch.empty(4096)
spec = cuda.specialize(fn.params, (x, x, 7), (4096, 3), launcher.Config(1024))
cubin, meta = cuda.compile_cubin(fn, *spec, 4, 90)
print(cubin[:4] == b"\\x7fELF", meta)
'''


def test_tritons_stages_compile_a_cubin_without_a_gpu(tmp_path):
    """Triton's stages for an explicit target need no GPU (nor Triton's driver): the cubin and the
    parameter count the launch relies on (pointers, seed, xnumel, an unused int, 2 scratch pointers),
    for a kernel as written for programmatic dependent launch (gdc_wait first)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FUSELENS_INTERPRET", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT / "compiler"), FUSELENS_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True {'name': 'k', 'shared': 0, 'num_warps': 4, 'n_params': 7}"
    assert not any(p.name.endswith(".so") for p in tmp_path.rglob("*"))  # no driver helper was built


COMPILE_IN_WORKERS = COMPILE.rsplit("cubin, meta =", 1)[0] + '''
import os
jobs = []
for block, warps in ((1024, 4), (512, 4), (1024, 8)):
    spec = cuda.specialize(fn.params, (x, x, 7), (4096, 3), launcher.Config(block))
    jobs.append((cuda.cache_key(src, "k", *spec, warps, 90), (src, "k", spec, warps, 90)))
futures = launcher.start_compiles(jobs + jobs[:1])  # (a job twice: compiled once)
pids = {f.result() for f in futures}
print(len(futures), os.getpid() not in pids, sorted(os.listdir(launcher.cubin_dir())) ==
      sorted(k + ext for k, _ in jobs for ext in (".cubin", ".json")), launcher.start_compiles(jobs))
'''


def test_kernels_compile_in_worker_processes_into_the_cache(tmp_path):
    """A program's kernels compile in forked workers (Triton's front end holds the GIL: in threads
    they compiled one at a time) into the cubin cache, where the launch then finds them."""
    env = {k: v for k, v in os.environ.items() if k not in ("FUSELENS_INTERPRET", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT / "compiler"), FUSELENS_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", COMPILE_IN_WORKERS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
    assert out.stdout.strip() == "3 True True []"


COMPILE_WHILE_LOCKED = COMPILE.rsplit("cubin, meta =", 1)[0] + '''
import os, sys, threading, time
def job(block):
    spec = cuda.specialize(fn.params, (x, x, 7), (4096, 3), launcher.Config(block))
    return cuda.cache_key(src, "k", *spec, 4, 90), (src, "k", spec, 4, 90)
def loading():  # another thread inside load_module (graphs compile on several threads) when the workers fork
    with launcher._lock:
        time.sleep(1.0)
t = threading.Thread(target=loading)
t.start()
time.sleep(0.2)
first = launcher.start_compiles([job(1024)])[0]
t.join()
print(first.result(timeout=120) != os.getpid())
pid = os.fork()  # a process forked later (a user's) compiles with workers of its own
if pid == 0:  # (and exits as a program does: its own workers stop, its parent's are not its to stop)
    sys.exit(0 if launcher.start_compiles([job(512)])[0].result(timeout=120) != os.getpid() else 1)
print(os.waitpid(pid, 0)[1] == 0)
'''


def test_workers_fork_safely_beside_other_threads_and_in_forked_processes(tmp_path):
    """A fork holds the kernel modules' lock (a worker forked while another thread held it waited
    on it forever); a forked process starts without its parent's pool."""
    env = {k: v for k, v in os.environ.items() if k not in ("FUSELENS_INTERPRET", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT / "compiler"), FUSELENS_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", COMPILE_WHILE_LOCKED], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"]


def test_parameters_read_from_the_source_are_the_ones_triton_builds(tmp_path):
    """A process launching cached cubins reads each kernel's parameters from its generated source
    (launcher.kernel_params), building no Triton JIT function: they must be that function's, for
    kernels of every kind (pointwise, a seeded one, reductions with combine functions, chunked)."""
    from fl_backend_testing import DEVICE, compile
    cases = [(lambda x: torch.relu(x) * 2, (64,)), (lambda x: x + torch.rand_like(x), (64,)),
             (lambda x: x.softmax(-1), (8, 32)), (lambda x: (x * 2).prod(-1), (8, 32)),
             (lambda x: (x * 2).amax(0), (4096, 8))]  # (chunked columns, then their maxima)
    sources = {launcher.canonical(k.name, k.source)[1]: launcher.canonical(k.name, k.source)[0]
               for fn, shape in cases for k in compile(fn, torch.randn(shape, device=DEVICE)).kernels}
    assert len(sources) == 6 and all(any(part in s for s in sources) for part in ("do_not_specialize", "_combine", "xchunk"))
    script = (f"import json\nfrom fuselens.codegen import launcher\nsources = json.loads({json.dumps(json.dumps(sources))})\n"
              "print(json.dumps({n: [(p.name, p.is_constexpr, p.do_not_specialize) for p in "
              "getattr(launcher.load_module(s), n).params] for s, n in sources.items()}))")
    env = {k: v for k, v in os.environ.items() if k not in ("FUSELENS_INTERPRET", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(ROOT / "compiler"), FUSELENS_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tritons = json.loads(out.stdout.strip().splitlines()[-1])
    assert {n: [[p.name, p.is_constexpr, p.do_not_specialize] for p in launcher.kernel_params(n, s)]
            for s, n in sources.items()} == tritons
