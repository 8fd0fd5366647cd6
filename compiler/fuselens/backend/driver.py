"""The single entry from the runtime into the backend: ops -> autograd -> lower -> schedule -> codegen.

`compile_graph(gm, example_inputs, ...)` returns a `CompiledGraph`. Calling it runs the graph as
Triton kernels when its tensors are on a GPU, or on the CPU under Triton's interpreter when
FUSELENS_INTERPRET=1; otherwise it runs `gm` eagerly (the kernels are still generated, so they can
be shown). Programs are specialized per input shape/stride/dtype (a small cache); kernel sources
do not contain sizes, so a new shape reuses the kernels already compiled. If any backend stage
fails for a graph, or its compiled program raises where the graph run eagerly does not, that
graph runs eagerly for those inputs (errors.fall_back: one warning naming the cause); an error
that the eager graph raises too is the user's program's and is raised as eager raises it.
Once a graph's programs have run without error they are stored on disk (backend/program_cache.py):
a later process that captures the same graph for the same inputs loads them instead of compiling.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..autograd.facts import check_shapes, eager_value
from ..codegen import cpp_build, launcher
from ..codegen.cpp import generate_cpp_kernel
from ..codegen.triton import fixed_divisors, generate_kernel
from ..codegen.wrapper import generate_wrapper, load_wrapper
from ..lower import lower_graph
from ..lower.ir import DynamicValues, View
from ..ops import merge_common_subexpressions, to_primitive_graph, values_only
from ..ops.contract import verify
from ..schedule.contract import check_schedule
from ..schedule.fusion import FusedKernel, schedule
from .. import settings, stats
from ..errors import FuselensWarning, fall_back
from . import program_cache
from .cudagraphs import TrainingGraphs
from .training import Compiled, compile_training

SPECIALIZATION_LIMIT = 8


def _log(stage, fmt, value):
    """Each stage's result, on logger `fuselens.<stage>` at DEBUG (built only when enabled)."""
    logger = logging.getLogger(f"fuselens.{stage}")
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(fmt, value() if callable(value) else value)


@dataclass
class KernelInfo:
    name: str
    source: str
    source_lines: list  # sorted (filename, line) the kernel's lines came from
    bytes_moved: int | None = None  # of the tensors it reads and writes; None with dynamic sizes


@dataclass
class Program:
    """One primitive graph compiled for one set of input shapes: `call(*inputs[, seed])`, or where
    `boxed`, `call([*inputs[, seed]])`, which empties the list and frees each input at its last use.
    `compile_jobs`: its kernels' cubins as its first call will need them (codegen/launcher.py),
    compiling in worker processes from when it is built; its first call waits for them.
    `made_from`: what `load_program` makes it again from (sources, no graph): how it is pickled
    into the program cache (backend/program_cache.py)."""
    call: object
    kernels: list
    wrapper_source: str
    has_seed: bool
    compile_jobs: list = field(default_factory=list)
    made_from: dict = field(default_factory=dict, repr=False)
    boxed: bool = False

    @property
    def output_layouts(self) -> list:
        """(shape, stride) of each output tensor as returned; None where a size is dynamic or the
        output is no tensor."""
        return self.made_from["output_layouts"]

    def __reduce__(self):
        return load_program, (self.made_from,)

    def compile_ahead(self):
        if self.compile_jobs:  # built but not yet compiled ahead (a backward for a new layout)
            compile_ahead([self])

    def __call__(self, *inputs):
        if self.boxed:
            return self.call_boxed(list(inputs))
        if self.has_seed:  # drawn from torch's default generator: torch.manual_seed makes it reproducible
            inputs = inputs + (_seed(),)
        return self.call(*inputs)

    def call_boxed(self, args: list):
        """Run a boxed program on `args`, which it empties (the caller keeps no other reference)."""
        if self.has_seed:
            args.append(_seed())
        return self.call(args)


def _seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, ()).item())


def compile_ahead(programs):
    """Every kernel the programs' first calls will launch, compiled (concurrently) by now."""
    launcher.compile_concurrently([job for p in programs for job in p.compile_jobs])
    for p in programs:
        p.compile_jobs = []


def kernel_target(device) -> str | None:
    """What runs the kernels of a graph on `device`: "triton" (compiled, or in Triton's interpreter
    under FUSELENS_INTERPRET=1), "cpp" (CPU tensors: codegen/cpp.py) or None (the graph runs as
    plain PyTorch: settings.CPU_BACKEND "eager", or no C++ compiler, warned of once)."""
    if torch.device(device).type != "cpu":
        return "triton"
    backend = settings.CPU_BACKEND
    if backend == "cpp" and cpp_build.compiler() is None:
        global _warned_no_compiler
        if not _warned_no_compiler:
            _warned_no_compiler = True
            warnings.warn(f"fuselens: {cpp_build.NO_COMPILER}", FuselensWarning, stacklevel=2)
        return None
    return {"cpp": "cpp", "interpret": "triton"}.get(backend)


_warned_no_compiler = False


def build_program(prim_graph: fx.Graph, device, mode="default", dynamic_values=DynamicValues(),
                  input_vals=None, first_kernel_index=0, boxed=False, free_outputs=None) -> Program:
    """`boxed`: see Program. `first_kernel_index` numbers this program's kernels after another's (a backward's after
    its forward's), so kernel names stay unique within a compiled graph. `free_outputs`: lower_graph's."""
    _log("ops", "primitive graph:\n%s", prim_graph)
    lowered = lower_graph(merge_common_subexpressions(prim_graph), device, input_vals, free_outputs)
    _log("lower", "buffers:\n%s", lowered.describe)
    cpp = kernel_target(device) == "cpp"
    sched = schedule(lowered, column_partials=not cpp)
    verify(check_schedule, lowered, sched)
    _log("schedule", "kernels:\n%s", sched.describe)
    fused = [s for s in sched.steps if isinstance(s, FusedKernel)]
    made = (_cpp_kernels if cpp else _triton_kernels)(fused, lowered, device, mode, dynamic_values, first_kernel_index)
    kernels, infos, launches, jobs, kernel_args = made
    source, code, call, consts = generate_wrapper(lowered, sched, kernels, device, boxed, triton=not cpp)
    _log("codegen", "%s", lambda: "\n\n".join([info.source for info in infos] + [source]))
    made_from = dict(source=source, code=code, device=str(device), has_seed=lowered.has_seed, infos=infos, consts=consts,
                     kernels=kernel_args, cpp=cpp, launches=launches, boxed=boxed,
                     output_layouts=[_layout(o) for o in lowered.outputs])
    return Program(call, infos, source, lowered.has_seed, jobs, made_from, boxed)


def _kernel_info(name, source, writer):
    tensors, _, _ = writer.launch_signature()
    return KernelInfo(name, source, sorted(writer.source_lines), _bytes_moved([writer.buffers[n] for n in tensors]))


def _triton_kernels(fused, lowered, device, mode, dynamic_values, first_kernel_index):
    """(FusedKernel id -> (TritonKernel, writer), KernelInfos, launches, cubin jobs, what load_program
    makes the kernels again from). A kernel starts compiling (in worker processes, while the next
    are generated) once written; one that divides by sizes is written again first where some of
    them are the same in every kernel of its source (`fixed_divisors`), known once all are written."""
    pdl = launcher.supports_pdl(torch.device(device))
    cuda = torch.device(device).type == "cuda"
    made, jobs = [None] * len(fused), []

    def write(i, fixed_sizes=frozenset()):
        return generate_kernel(fused[i], first_kernel_index + i, lowered.sizevars, dynamic_values, pdl, cuda,
                               fixed_sizes)

    def start(i, generated):
        name, source, writer = generated
        itemsize = min((b.dtype.itemsize for b in writer.buffers.values()), default=4)
        kernel = launcher.TritonKernel(name, source, writer.mode, mode == "max-autotune", itemsize, pdl)
        tensors, scalars, sizes = writer.launch_signature()
        launch = ([writer.buffers[n].dtype for n in tensors], [0 if a == "seed" else a for a in scalars], sizes)
        made[i] = kernel, writer, _kernel_info(name, source, writer), launch
        kernel_jobs = _compile_jobs([kernel], [launch], device)
        launcher.start_compiles(kernel_jobs)
        jobs.extend(kernel_jobs)

    dividing = {}
    for i in range(len(fused)):
        generated = write(i)
        if generated[2].divided_by:
            dividing[i] = generated
        else:
            start(i, generated)
    fixed = fixed_divisors(dividing)
    for i, generated in dividing.items():
        start(i, write(i, fixed[i]) if i in fixed else generated)
    kernels = {id(step): (kernel, writer) for step, (kernel, writer, _, _) in zip(fused, made)}
    args = [(k.name, k.source, k.mode, k.max_autotune, k.itemsize, k.pdl) for k, _, _, _ in made]
    return kernels, [info for _, _, info, _ in made], [launch for _, _, _, launch in made], jobs, args


def _cpp_kernels(fused, lowered, device, mode, dynamic_values, first_kernel_index):
    """As _triton_kernels, for C++ kernels: one library of them all, building from now on."""
    generated = [generate_cpp_kernel(step, first_kernel_index + i, lowered.sizevars, dynamic_values,
                                     torch.get_num_threads()) for i, step in enumerate(fused)]
    args = [(name, source, *map(len, writer.launch_signature()[:2])) for name, source, writer in generated]
    kernels = dict(zip((id(step) for step in fused), zip(_cpp_objects(args), (w for _, _, w in generated))))
    launches = [writer.launch_signature()[2] for _, _, writer in generated]
    return kernels, [_kernel_info(*g) for g in generated], launches, [], args


def _cpp_objects(args) -> list:
    """The CppKernels of (name, source, tensors, scalars), in one library (started building)."""
    library = cpp_build.CppLibrary.of("".join("\n" + source for _, source, _, _ in args))
    return [cpp_build.CppKernel(name, source, library, tensors, scalars) for name, source, tensors, scalars in args]


def _layout(v):
    if not isinstance(v, View) or not all(isinstance(n, (int, sympy.Integer)) for n in (*v.shape, *v.stride)):
        return None
    return tuple(int(n) for n in v.shape), tuple(int(n) for n in v.stride)


def load_program(made_from: dict) -> Program:
    """A program made again from what build_program generated (`Program.made_from`): no graph work."""
    device = made_from["device"]
    if made_from["cpp"]:
        kernels = _cpp_objects(made_from["kernels"])
        for kernel, sizes in zip(kernels, made_from["launches"]):
            kernel.call_sizes = tuple(sizes)
        jobs = []
    else:
        kernels = [launcher.TritonKernel(*args) for args in made_from["kernels"]]
        for kernel, (_, _, sizes) in zip(kernels, made_from["launches"]):
            kernel.call_sizes = tuple(sizes)  # as the wrapper's generation set them: its launches take the fast path
        jobs = _compile_jobs(kernels, made_from["launches"], device)
    call = load_wrapper(made_from["code"], kernels, made_from["consts"], device, made_from["source"])
    return Program(call, made_from["infos"], made_from["source"], made_from["has_seed"], jobs, made_from,
                   made_from["boxed"])


def _compile_jobs(kernels, launches, device):
    jobs = []
    for kernel, (dtypes, scalars, sizes) in zip(kernels, launches):
        try:
            jobs += kernel.compile_jobs(dtypes, scalars, sizes, torch.device(device))
        except Exception as e:  # a prediction only: the launch compiles what it needs anyway
            logging.getLogger("fuselens.codegen").debug("%s: no compile ahead (%s)", kernel.name, e)
    return jobs


def _bytes_moved(buffers) -> int | None:
    """Bytes of the tensors a kernel takes (each read or written once): the traffic the
    bandwidth figure divides by. None where a size is symbolic (a dynamic dim)."""
    total = 0
    for b in buffers:
        try:
            n = int(b.numel())
        except TypeError:  # a symbolic size
            return None
        total += n * b.dtype.itemsize
    return total


def runs_kernels(inputs) -> bool:
    """Whether a graph on these inputs runs as generated kernels (else as plain PyTorch)."""
    devices = {t.device.type for t in inputs if isinstance(t, torch.Tensor)}
    if devices == {"cuda"}:
        return True
    if devices == {"cpu"} or not devices:
        return kernel_target("cpu") is not None
    return False


def graph_device(gm: fx.GraphModule, inputs):
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "device" in node.meta:
            return node.meta["device"]
    return torch.device("cpu")


def _key(inputs):
    return (torch.is_grad_enabled(),) + tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else
        ("value", t) for t in inputs)


@dataclass
class _Specialization:
    run: object  # callable(*inputs) -> tuple
    kernels: list = field(default_factory=list)
    wrapper_source: str = ""
    first_run: object = None  # callable(*inputs): `run` until a call succeeds, checking the backward too
    verified: bool = False  # ran once without error
    eager: bool = False  # the backend failed for these inputs: `run` is the graph run eagerly
    failure: Exception | None = None  # why, until the first call warns of it (errors.fall_back)
    cache_entry: tuple | None = None  # (program-cache key, what it stores): stored once a call ran it
    stored: bool = False

    def ran_new_backward(self):
        """A backward program for a new layout ran: stored with the rest, for the next process."""
        if self.cache_entry and self.verified:
            program_cache.store(*self.cache_entry)


class CompiledGraph:
    def __init__(self, gm: fx.GraphModule, example_inputs, mode="default", dynamic_dims=None, guarded=False,
                 name="a graph"):
        self.mode, self.dynamic_dims, self.name = mode, dynamic_dims, name
        # with dynamic dims, capture keeps ops whose results are unused for their shape checks
        # (capture/graph.py): checked on meta tensors at each new size, left out of the kernels
        pruned = _without_unused(gm) if any(dynamic_dims or ()) else None
        self.gm = pruned if pruned is not None else gm
        self._checked = gm if pruned is not None else None
        # guarded: the caller's guards fix every input's shape, stride, dtype, device and
        # requires_grad, and the grad mode (no dynamic dims); after one verified call the
        # specialization lookup is skipped
        self.guarded = guarded and not any(dynamic_dims or ())
        self._eager_run = eager_run(gm)
        self._fast = None
        self._specializations: dict = {}
        self.kernels: list[KernelInfo] = []
        self.wrapper_source = ""
        self._specialize(list(example_inputs))

    @property
    def uses_random(self) -> bool:
        """Whether a program draws a seed per call (random ops): not replayable from a CUDA graph."""
        return any(getattr(s.run, "has_seed", False) or getattr(s.run, "uses_random", False)
                   for s in self._specializations.values())

    def _eager(self, *inputs):
        # the graph is functional: where eager wrote a tensor in place (meta["writes"]), its
        # version is bumped, so that autograd refuses the backward eager refuses
        out = self._eager_run(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _dynamic_values(self, inputs):
        values, fixed = set(), set()
        for t, dims in zip(inputs, self.dynamic_dims or []):
            if isinstance(t, torch.Tensor):
                values.update(t.shape[d] for d in dims or ())
                fixed.update(n for d, n in enumerate(t.shape) if d not in (dims or ()))
        values = {v for v in values if v > 1}
        return DynamicValues(values, static=frozenset(fixed - values))

    def _specialize(self, inputs):
        key = _key(inputs)
        spec = self._specializations.get(key)
        if spec is not None:
            return spec
        try:
            with stats.gc_paused():
                spec = self._build(inputs)
        except Exception as e:  # any backend failure costs speed, never correctness
            spec = self._eager_spec()
            spec.failure = e
        if len(self._specializations) >= SPECIALIZATION_LIMIT:
            self._specializations.pop(next(iter(self._specializations)))
        self._specializations[key] = spec
        self.kernels, self.wrapper_source = spec.kernels, spec.wrapper_source
        return spec

    def _build(self, inputs):
        if self._checked is not None:
            check_shapes(self._checked, inputs)
        device = graph_device(self.gm, inputs)
        dynamic = self._dynamic_values(inputs)
        needs_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        if settings.INTERPRET and kernel_target(device) == "triton":
            launcher.check_interpreter()
        start = time.perf_counter()
        key = program_cache.key(self.gm, inputs, self.mode, self.dynamic_dims)
        cached = program_cache.load(key, Compiled if needs_grad else Program) if key else None
        if needs_grad:
            graphs = TrainingGraphs if self.mode == "reduce-overhead" and device.type == "cuda" and \
                not settings.INTERPRET else None
            run, first_run, programs, made = compile_training(self.gm, inputs, device, self.mode, dynamic, build_program,
                                                          graphs, cached, lambda: spec.ran_new_backward())
            spec = _Specialization(run, [k for p in programs for k in p.kernels],
                                   "\n".join(f"# {label}\n{p.wrapper_source}"
                                             for label, p in zip(("forward", "backward"), programs)),
                                   # (an entry of the cache is a program that ran its check, and then a
                                   # step, in the process that stored it: not again in this one)
                                   first_run if cached is None else None)
        else:
            made = cached if cached is not None else \
                build_program(values_only(to_primitive_graph(self.gm, inputs, device)), device, self.mode, dynamic)
            programs = [made]
            spec = _Specialization(made, made.kernels, made.wrapper_source)
        spec.cache_entry, spec.stored = (key, made) if key else None, cached is not None
        if cached is not None:
            stats.backend["cache_hits"] += 1
            stats.backend["cache_load_seconds"] += time.perf_counter() - start
        else:
            stats.backend["compiles"] += 1
            stats.backend["seconds"] += time.perf_counter() - start
        compile_ahead(programs)  # the first call's forward and backward kernels together
        return spec

    def __call__(self, *inputs):
        if self._fast is not None:
            try:
                return self._fast(*inputs)
            except Exception as e:
                cause = e
        else:
            if not runs_kernels(inputs):
                return self._eager(*inputs)
            spec = self._specialize(list(inputs))
            if spec.eager:
                if spec.failure is None:
                    return self._eager(*inputs)
                # the graph's eager run raising too (a shape check at sizes a dynamic dim took)
                # is the user's error, raised as is: only a failure of the backend's own is warned of
                cause, spec.failure = spec.failure, None
                return fall_back("the backend", self.name, cause, lambda: self._eager(*inputs))
            try:
                return self._run(spec, inputs)
            except Exception as e:  # e.g. a kernel that Triton fails to compile
                cause = e
        # the graph is pure and its outputs not yet used: its eager run is the only one whose
        # results count, and tells a user's error (raised as is) from ours (warned about once)
        out = fall_back("the backend", self.name, cause, lambda: self._eager(*inputs))
        self._fast = None
        self._specializations[_key(list(inputs))] = self._eager_spec()
        return out

    def _run(self, spec, inputs):
        if spec.verified:
            if self.guarded and len(self._specializations) == 1:
                run = spec.run
                # a program that draws no seed: its generated wrapper itself
                self._fast = run.call if isinstance(run, Program) and not run.has_seed else run
            return spec.run(*inputs)
        out = (spec.first_run or spec.run)(*inputs)
        spec.verified = True
        if spec.cache_entry and not spec.stored:  # what compiled and ran, for the next process
            program_cache.store(*spec.cache_entry)
            spec.stored = True
        return out

    def _eager_spec(self):
        return _Specialization(self._eager, verified=True, eager=True)


def copy_graph(gm: fx.GraphModule) -> tuple[fx.Graph, dict]:
    """A copy of `gm`'s graph and the map of its nodes to their copies; metadata naming a node
    (`writes`) names its copy."""
    graph, copies = fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for n in graph.nodes:
        if n.meta.get("writes") is not None:
            n.meta["writes"] = copies[n.meta["writes"]]
    return graph, copies


def _without_unused(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of `gm` without the ops whose results nothing uses (writes and random ops stay), or
    None where it has none."""
    graph, _ = copy_graph(gm)
    if not graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or "writes" in n.meta):
        return None
    return fx.GraphModule(gm, graph)


def eager_run(gm: fx.GraphModule):
    """What runs `gm` eagerly: EagerRun where it writes, else its generated code, called without
    GraphModule.__call__, which prints its own traceback to stderr when the code raises (eager
    prints nothing)."""
    if any("writes" in n.meta or "input_value" in n.meta for n in gm.graph.nodes):
        return lambda *inputs: EagerRun(gm).run(*inputs)

    def run(*inputs):  # (a lazy module's code is made at its first run, not before)
        if isinstance(gm, _LazyGraphModule):
            gm.real_recompile()
        return gm.forward(*inputs)
    return run


class EagerRun(fx.Interpreter):
    """A graph that writes run eagerly: where eager wrote a tensor in place (`meta["writes"]`), its
    version moves on, so that autograd refuses the backward eager refuses. Where the run raises
    (the user's error: a shape check at sizes a dynamic dim took), the exception carries
    `fl_input_values`, the values the inputs were given so far ({source: tensor}, from the nodes'
    `meta["input_value"]`): eager's writes before its error happened, and the runtime makes them."""

    def __init__(self, gm):
        super().__init__(gm)
        self.extra_traceback = False  # the user's error as eager words it, no node appended
        self.input_values: dict = {}
        # a written value is kept until the node that writes it has run (its version moves on there)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last_use = {v: user for user, used in self.user_to_last_uses.items() for v in used}
        for n in gm.graph.nodes:
            written = n.meta.get("writes")
            if written in last_use and order[last_use[written]] < order[n]:
                self.user_to_last_uses[last_use[written]].remove(written)
                self.user_to_last_uses.setdefault(n, []).append(written)
                last_use[written] = n

    def run(self, *args):
        try:
            return super().run(*args)
        except Exception as e:
            if self.input_values:
                e.fl_input_values = self.input_values
            raise

    def run_node(self, n):  # with eager's autograd for what it writes in place
        out = eager_value(n, lambda: super(EagerRun, self).run_node(n), self.fetch_args_kwargs_from_env)
        written = self.env.get(n.meta.get("writes"))
        if isinstance(written, torch.Tensor):
            torch.autograd.graph.increment_version(written)
        source = n.meta.get("input_value")
        if source is not None:
            self.input_values[source] = out
        return out


def compile_graph(gm: fx.GraphModule, example_inputs, *, mode="default", dynamic_dims=None,
                  guarded=False, name="a graph") -> CompiledGraph:
    """`guarded=True`: the caller checks every input's layout and the grad mode before each call
    (capture's guards do), so one specialization serves every call (a faster call path). `name`:
    how a warning names the graph. Never raises: where the backend fails, the graph runs eagerly."""
    return CompiledGraph(gm, example_inputs, mode, dynamic_dims, guarded, name)
