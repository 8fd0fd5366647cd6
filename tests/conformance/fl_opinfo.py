"""PyTorch's OpInfo database (`op_db`, what Inductor's test_torchinductor_opinfo.py runs) through
fuselens.compile, compared with eager: each op's functional, in-place and out= variants, its
error inputs, forward values and input gradients.

`check()` runs one sample and classifies it (`Outcome.kind`):
  equal     compiled result equals eager's (values, dtype, shape, requires_grad, gradients,
            the exception type when eager raises)
  fallback  equal, but fuselens warned (FuselensWarning) and ran eagerly: `detail` is the cause
  xfail     eager itself is not deterministic, so only dtype/shape are compared
  mismatch  anything else: `detail` says what differs
FUSELENS_OPINFO=full runs every sample; FUSELENS_OPINFO=N (default 1, what CI runs) the first N
of each op, variant and dtype.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

import torch
from torch.testing._internal.common_device_type import onlyCPU, onlyCUDA
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

import fuselens
from fuselens import FuselensWarning, settings

# FUSELENS_OPINFO=full: every sample; =N: the first N samples of each op, variant and dtype
_MODE = os.environ.get("FUSELENS_OPINFO", "1")
SAMPLES = None if _MODE == "full" else int(_MODE)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
# (rtol, atol) per dtype: eager's default tolerances loosened for another summation order
# (reductions, matmuls); bfloat16 rounds once per value, eager may round per step
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
GRAD_TOL_FACTOR = 4  # a gradient is one more reduction away from the inputs


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


# where the samples live: CUDA with real Triton kernels when FUSELENS_INTERPRET is off on a GPU
# machine (`make test-gpu`), else the CPU, with kernels in Triton's interpreter
DEVICE = "cuda" if os.environ.get("FUSELENS_INTERPRET", "1") in ("", "0") and torch.cuda.is_available() else "cpu"
# gathers are loads in Triton kernels (CUDA and the interpreter), ATen's calls beside the C++ ones
_TRITON_GATHERS = DEVICE == "cuda" or settings.CPU_BACKEND == "interpret"
# the ops that run on that device
OPS = sorted((op for op in op_db if (onlyCPU if DEVICE == "cuda" else onlyCUDA) not in op.decorators), key=op_id)


@dataclass
class Outcome:
    kind: str          # equal | fallback | xfail | mismatch
    detail: str = ""   # fallback cause, xfail reason, or what mismatched
    graph_break: str = ""  # the first graph break's code and detail, if capture broke

    def label(self, where: str) -> str:
        return f"{where}: {self.kind}" + (f": {self.detail}" if self.detail else "")


def _call(op):
    """The compiled function: a plain call of the variant, as a user writes it."""
    def call(*args, **kwargs):
        return op(*args, **kwargs)
    return call


# -- inputs ----------------------------------------------------------------------------------
def _copy_tensor(t):
    """Same values, dtype, sizes, strides and storage offset, in a storage of its own; a new
    leaf with t's requires_grad."""
    t = t.detach()
    if t.layout != torch.strided:  # sparse: no storage of its own to copy
        return t.clone().requires_grad_(t.requires_grad)
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())
    return out.requires_grad_(t.requires_grad)


def _copy(tree):
    return pytree.tree_map(lambda x: _copy_tensor(x) if isinstance(x, torch.Tensor) else x, tree)


def _sentinel(t):
    """An out= tensor whose old contents show if the compiled code does not write it."""
    fill = float("nan") if t.dtype.is_floating_point else (True if t.dtype == torch.bool else 17)
    return torch.full_like(t.detach(), fill)


# -- running ---------------------------------------------------------------------------------
class _SeededOps(TorchDispatchMode):
    """Sees whether eager dispatched an op that draws random numbers (schema tag)."""
    def __init__(self):
        super().__init__()
        self.random = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and self.random is None:
            self.random = str(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _run(fn, args, kwargs, grad: bool, seeded: _SeededOps | None = None):
    """(result, grads) or the exception; grads of the float results with a fixed cotangent."""
    torch.manual_seed(0)
    try:
        if seeded is not None:
            with seeded:
                out = fn(*args, **kwargs)
        else:
            out = fn(*args, **kwargs)
        grads = None
        if grad:
            leaves = [t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            outs = [t for t in pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point]
            if leaves and outs:
                gen = torch.Generator().manual_seed(1)
                cots = [torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype) for t in outs]
                grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        return out, grads
    except Exception as e:  # noqa: BLE001 - compared with the other side
        return e


def _diff(expected, actual, grad=False) -> str | None:
    """None if equal, else what differs (first difference)."""
    e_leaves, e_spec = pytree.tree_flatten_with_path(expected)
    a_leaves, a_spec = pytree.tree_flatten(actual)
    if e_spec != a_spec:
        shape = f"returns {_structure(actual)} where eager returns {_structure(expected)}"
        if len(e_leaves) != len(a_leaves):
            return shape
        values = _diff(pytree.tree_leaves(expected), a_leaves, grad)  # a tuple for a structseq:
        return shape + (f"; {values}" if values else "")                  # the values still count
    for (path, e), a in zip(e_leaves, a_leaves):
        where = f"{pytree.keystr(path)} " if path else ""
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"{where}{type(a).__name__} where eager has {type(e).__name__}"
        if isinstance(e, torch.Tensor) and e.requires_grad != a.requires_grad:
            return f"{where}requires_grad={a.requires_grad}, eager {e.requires_grad}"
        # a float result of integer inputs gets its own dtype's tolerance
        dtype = e.dtype if isinstance(e, torch.Tensor) else torch.float32 if isinstance(e, float) else None
        rtol, atol = TOL.get(dtype, (None, None))  # None: assert_close's own (exact for integers)
        if grad and rtol is not None:
            rtol, atol = rtol * GRAD_TOL_FACTOR, atol * GRAD_TOL_FACTOR
        if not isinstance(e, (torch.Tensor, int, float, complex)):  # None, a dtype, a string
            if a != e:
                return f"{where}{a!r} where eager has {e!r}"
            continue
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_stride=False, rtol=rtol, atol=atol)
        except AssertionError as err:
            return where + " ".join(str(err).split("\n")[:4])
    return None


def _structure(tree) -> str:
    """A result's containers, e.g. `tuple(Tensor, Tensor)` or `torch.return_types.max(...)`."""
    if isinstance(tree, (tuple, list)):
        name = type(tree).__name__
        if hasattr(tree, "n_fields"):  # a structseq
            name = f"{type(tree).__module__}.{name}"
        return f"{name}({', '.join(_structure(t) for t in tree)})"
    return type(tree).__name__


def _compare(expected, actual, grad) -> str | None:
    if isinstance(expected, Exception) or isinstance(actual, Exception):
        if type(expected) is type(actual):
            return None
        def say(r):
            return f"raises {type(r).__name__}: {str(r)[:120]}" if isinstance(r, Exception) else "returns"
        return f"compiled {say(actual)}, eager {say(expected)}"
    (e_out, e_grads), (a_out, a_grads) = expected, actual
    out = _diff(e_out, a_out)
    grads = grad and _diff(e_grads, a_grads, grad=True)
    return "; ".join([d for d in (out, grads and f"grad {grads}") if d]) or None


def _fallback_cause(msg: str) -> str:
    """A FuselensWarning's message without the function's name and numbers, to count causes."""
    msg = re.sub(r"^fuselens: (\S*call: )?", "", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg if len(msg) < 120 else msg[:117] + "..."


def _run_compiled(fn, args, kwargs, grad):
    cf = fuselens.compile(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FuselensWarning)
        res = _run(cf, args, kwargs, grad)
    fell_back = [str(w.message) for w in caught if issubclass(w.category, FuselensWarning)]
    brk = next((e.graph_break for e in cf.entries if e.graph_break is not None), None)
    brk = f"{brk.code} {brk.detail or brk.title}" if brk is not None else ""
    return res, fell_back, brk


def check(op, variant: str, dtype, sample) -> Outcome | None:
    """One sample through one variant; None where the variant does not apply to the sample."""
    if variant == "error":  # sample is an ErrorInput: eager raises it, compiled must raise alike
        sample = sample.sample_input
    grad = variant == "grad"
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    if variant == "inplace" and not isinstance(sample.input, torch.Tensor):
        return None
    fn = _call(op.inplace_variant if variant == "inplace" else op.op)
    if variant == "out":
        probe = _run(_call(op.op), _copy(args), _copy(kwargs), False)
        if isinstance(probe, Exception):
            return None
        if not all(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(probe[0])):
            return None
        kwargs["out"] = pytree.tree_map(_sentinel, probe[0])
        if isinstance(kwargs["out"], list):  # torch takes a tuple of outs, not a list
            kwargs["out"] = tuple(kwargs["out"])
    seeded = _SeededOps()  # a run of its own: a dispatch mode can change eager's results (out=)
    _run(fn, *_copy((args, kwargs)), False, seeded)
    e_args, e_kwargs = _copy((args, kwargs))
    expected = _run(fn, e_args, e_kwargs, grad)
    if variant in ("inplace", "out"):  # what was written is part of the result
        expected = _with_written(expected, e_args, e_kwargs, variant)
    c_args, c_kwargs = _copy((args, kwargs))
    actual, fell_back, brk = _run_compiled(fn, c_args, c_kwargs, grad)
    if variant in ("inplace", "out"):
        actual = _with_written(actual, c_args, c_kwargs, variant)
    raised = isinstance(expected, Exception)
    if variant == "error" and not raised:
        return None  # torch's own error sample does not raise on this build
    nondet = not raised and (
        (seeded.random and f"eager draws random numbers ({seeded.random})")
        or (_uninitialized(op, fn, args, kwargs, expected) and "eager returns uninitialized memory"))
    if nondet:
        expected, actual = _metadata(expected), _metadata(actual)
    if raised:  # capture stops at the error (a graph break) to let eager raise it: no news
        brk = ""
    if variant == "error" and not isinstance(actual, Exception) and _TRITON_GATHERS and \
            re.search(r"\bindex\b.*out of (bounds|range)", str(expected)):
        # a gather's index out of range: the Triton kernels read 0 (their loads masked), where
        # eager's CUDA kernel asserts (on a CPU it raises): the GPU's semantics, as Inductor's
        return Outcome("xfail", "an index out of range reads 0 in Triton kernels (eager's CUDA kernel asserts)", brk)
    d = _compare(expected, actual, grad and not nondet)
    if d is not None:
        return Outcome("mismatch", d, brk)
    if nondet:
        return Outcome("xfail", nondet, brk)
    if fell_back:
        return Outcome("fallback", _fallback_cause(fell_back[0]), brk)
    return Outcome("equal", "", brk)


def _uninitialized(op, fn, args, kwargs, expected) -> bool:
    """Whether eager's result holds memory it never wrote (torch.empty and its kin): OpInfo's
    `has_nondeterministic_output` where this torch has it (2.12 and later), else seen: two calls,
    each made right after a block of each result's size was filled with other bytes and freed,
    return different bits."""
    flag = getattr(op, "has_nondeterministic_output", None)
    if flag is not None:
        return flag
    results = [t for t in pytree.tree_leaves(expected[0]) if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    if not results:
        return False
    bits = []
    for fill in (0x55, 0xAA):
        inputs = _copy((args, kwargs))  # (copied first: a copy made after the fill would take its block)
        for t in results:  # freed at once: the allocator hands the block to the call's result
            torch.full((t.untyped_storage().nbytes(),), fill, dtype=torch.uint8, device=t.device)
        again = _run(fn, *inputs, False)
        if isinstance(again, Exception):
            return False
        bits.append([t.detach().contiguous().view(-1).view(torch.uint8).cpu()
                     for t in pytree.tree_leaves(again[0]) if isinstance(t, torch.Tensor) and t.layout == torch.strided])
    return any(not torch.equal(a, b) for a, b in zip(*bits))


def _with_written(res, args, kwargs, variant):
    """An in-place or out= call's result, plus the tensor it wrote into and whether the result
    aliases it (as eager's does)."""
    if isinstance(res, Exception):
        return res
    out, grads = res
    written = args[0] if variant == "inplace" else kwargs["out"]
    aliased = [r is w or isinstance(r, torch.Tensor) and r.layout == w.layout == torch.strided
               and r.data_ptr() == w.data_ptr()
               for r, w in zip(pytree.tree_leaves(out), pytree.tree_leaves(written))]
    return {"result": out, "written": written, "result aliases written": aliased}, grads


def _metadata(res):
    if isinstance(res, Exception):
        return res
    meta = lambda t: (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t
    return pytree.tree_map(meta, res[0]), None


# -- cases -----------------------------------------------------------------------------------
def dtypes(op):
    supported = op.supported_dtypes(DEVICE)
    return [d for d in DTYPES if d in supported]


def variants(op, dtype):
    """functional: inference; grad: the same with inputs that require grad, gradients compared;
    inplace and out: the op's in-place and out= forms; error: torch's inputs that must raise."""
    out = ["functional"]
    if dtype.is_floating_point and op.supports_autograd:
        out.append("grad")
    if op.inplace_variant is not None:
        out.append("inplace")
    if op.supports_out:
        out.append("out")
    if op.error_inputs_func is not None:
        out.append("error")
    return out


def samples(op, variant, dtype):
    """The samples to run: all of them with FUSELENS_OPINFO=full, else the first SAMPLES."""
    if variant == "error":
        it = op.error_inputs(DEVICE) if dtype == torch.float32 else iter(())
    else:
        it = op.sample_inputs(DEVICE, dtype, requires_grad=variant == "grad")
    for k, s in enumerate(it):
        if k == SAMPLES:
            return
        yield k, s


def run_op(op, dtype) -> list[tuple[str, Outcome]]:
    """Every (variant, sample) of one op at one dtype: [(where, outcome)]."""
    results = []
    for variant in variants(op, dtype):
        try:
            for k, sample in samples(op, variant, dtype):
                out = check(op, variant, dtype, sample)
                if out is not None:
                    results.append((f"{op_id(op)} {variant} {str(dtype)[6:]} #{k}", out))
        except Exception as e:  # noqa: BLE001 - a sample generator of torch's failing on CPU
            results.append((f"{op_id(op)} {variant} {str(dtype)[6:]}",
                            Outcome("mismatch", f"harness: {type(e).__name__}: {e}")))
    return results


if __name__ == "__main__":  # one op's outcomes: python tests/conformance/fl_opinfo.py OP [DTYPE]
    import sys
    name, only = sys.argv[1], sys.argv[2:]
    for op in (op for op in OPS if op_id(op) == name):
        for dtype in (d for d in dtypes(op) if not only or str(d)[6:] in only):
            for where, outcome in run_op(op, dtype):
                print(outcome.label(where) + (f" [{outcome.graph_break}]" if outcome.graph_break else ""))
