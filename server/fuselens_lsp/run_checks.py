"""What a Compile & benchmark run compares and times where the plain comparison would mislead:
functions that draw random numbers (dropout, `torch.rand`), and machines without a GPU.

Random ops: eager and fuselens run from the same seed, but a compiled graph draws its random
numbers its own way, so their outputs differ by design. Those ops are found by running eager
under a dispatch mode (ATen tags them `nondeterministic_seeded`); the check is then made again
with every module in eval mode (dropout off), and says what it did."""
from __future__ import annotations

import time

#: what a user wrote, for the ATen random ops they meet most
_USER_NAMES = {"native_dropout": "dropout", "bernoulli_": "dropout/bernoulli", "bernoulli": "bernoulli",
               "rand": "torch.rand", "randn": "torch.randn", "rand_like": "torch.rand_like",
               "randn_like": "torch.randn_like", "randint": "torch.randint", "randperm": "torch.randperm",
               "normal": "torch.normal", "normal_": "Tensor.normal_", "uniform_": "Tensor.uniform_",
               "multinomial": "torch.multinomial", "exponential_": "Tensor.exponential_"}


def random_ops(run) -> list[str]:
    """The random ops `run()` calls, by the names users write."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    found: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags:
                name = func.overloadpacket.__name__
                name = _USER_NAMES.get(name, f"aten.{name}")
                if name not in found:
                    found.append(name)
            return func(*args, **(kwargs or {}))

    with Record():
        run()
    return found


def modules_in(fn, args, kwargs) -> list:
    """The nn.Modules a call reaches directly: bound to the function, or passed to it."""
    import torch.nn as nn
    roots = [getattr(fn, "__self__", None), fn, *args, *kwargs.values()]
    out = []
    for v in roots:
        items = v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else [v]
        for m in items:
            if isinstance(m, nn.Module) and all(m is not o for o in out):
                out.append(m)
    return out


class eval_mode:
    """Every module of the call in eval mode (dropout off) for the `with` block, then as it was."""

    def __init__(self, modules):
        self.modules = modules
        self.was = []

    def __enter__(self):
        self.was = [(m, m.training) for mod in self.modules for m in mod.modules()]
        for mod in self.modules:
            mod.eval()
        return self

    def __exit__(self, *exc):
        for m, t in self.was:
            m.training = t


def time_cpu(fn, args, kwargs, budget_s=0.5) -> float:
    """Median milliseconds per call on the CPU, after warm-up."""
    for _ in range(2):
        fn(*args, **kwargs)
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 100):
        t = time.perf_counter()
        fn(*args, **kwargs)
        times.append((time.perf_counter() - t) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def cpp_compiler_found() -> bool:
    """Whether fuselens finds a C++ compiler for its CPU kernels."""
    from fuselens.codegen import cpp_build
    return cpp_build.compiler() is not None


def use_cpp_kernels() -> bool:
    """From now on CPU graphs run as fuselens's C++ kernels, where a C++ compiler is found: what
    the worker then checks, shows and times. Called before anything compiles (compile workers
    fork with the settings of their time). Whether it did."""
    from fuselens import settings
    if not cpp_compiler_found():
        return False
    settings.INTERPRET, settings.CPU_BACKEND = False, "cpp"
    return True


class cpu_kernels:
    """fuselens compiles made inside the block run their CPU graphs as its C++ kernels (not in
    Triton's interpreter, whose times mean nothing), or as plain PyTorch where there is no C++
    compiler: what a CPU can time of them. `cpp`: whether the kernels are C++."""

    def __enter__(self):
        from fuselens import settings
        self.settings, self.was = settings, (settings.INTERPRET, settings.CPU_BACKEND)
        self.cpp = cpp_compiler_found()
        settings.INTERPRET, settings.CPU_BACKEND = False, "cpp" if self.cpp else "eager"
        return self

    def __exit__(self, *exc):
        self.settings.INTERPRET, self.settings.CPU_BACKEND = self.was
