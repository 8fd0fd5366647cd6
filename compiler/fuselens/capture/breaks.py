"""Graph breaks as values, and the registry of break codes.

A `GraphBreak` is produced by the capture evaluator in both domains (concrete and abstract),
so the runtime, `fuselens.explain` and the language server report the same thing for the same
code. Each code has one section in docs/graph-breaks.md (anchor = the code in lower case).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DOCS_URL = "https://github.com/fuselens/fuselens/blob/main/docs/graph-breaks.md"


@dataclass(frozen=True)
class BreakKind:
    code: str
    title: str
    explanation: str
    hint: str
    torch_code: str | None  # the matching torch.compile graph-break registry id


_KINDS: dict[str, BreakKind] = {}


def _kind(code, title, explanation, hint, torch_code=None) -> BreakKind:
    k = BreakKind(code, title, explanation, hint, torch_code)
    _KINDS[code] = k
    return k


PRINT = _kind(
    "FL100", "print() in a compiled function",
    "print() writes to the terminal, a side effect a graph cannot hold; the graph ends before it "
    "and Python runs the call.",
    "Guard it with `if not torch.compiler.is_compiling():`, or move it outside the compiled function.",
    "GB0007")
LOGGING = _kind(
    "FL101", "logging/warnings call in a compiled function",
    "A logging or warnings call is a side effect a graph cannot hold; the graph ends before it and "
    "Python runs the call.",
    "Guard it with `if not torch.compiler.is_compiling():`, or log outside the compiled function.",
    "GB0291")
ITEM = _kind(
    "FL110", "Tensor.item() reads a tensor value into Python",
    "`.item()` turns a tensor element into a Python number, which needs the data: the graph ends, "
    "the value is read, and the rest of the function runs in a new graph.",
    "Keep the 0-d tensor (drop `.item()`) when it is only used in tensor arithmetic.",
    "GB0124")
TOLIST = _kind(
    "FL111", "Tensor.tolist() reads tensor values into Python",
    "`.tolist()` copies tensor data into Python lists, which needs the data: the graph ends here.",
    "Keep the values as a tensor; index it instead of converting it to a list.",
    "GB0109")
NUMPY = _kind(
    "FL112", "Tensor.numpy() leaves PyTorch",
    "`.numpy()` hands tensor data to NumPy, which a graph cannot hold: the graph ends here.",
    "Use the torch equivalent of the NumPy code, or convert outside the compiled function.",
    "GB0105")
TENSOR_TO_PY = _kind(
    "FL113", "Tensor converted to a Python scalar",
    "`int(t)`, `float(t)`, `bool(t)` or `len()` of a data-dependent value needs the tensor's data: "
    "the graph ends here.",
    "Keep the value as a tensor (e.g. `t.to(torch.float32)`), or pass the number in as an argument.",
    "GB0124")
DATA_IF = _kind(
    "FL120", "Data-dependent if",
    "The condition depends on tensor values, which are only known when the graph runs: the graph "
    "computes the condition, Python branches, and each branch continues in its own graph.",
    "Compute both branches and select with `torch.where(cond, a, b)` when both are cheap.",
    "GB0170")
DATA_WHILE = _kind(
    "FL121", "Data-dependent while loop",
    "The loop condition depends on tensor values: the loop runs in Python, its body in graphs of "
    "its own on each iteration.",
    "Use a fixed number of iterations, or move the loop outside the compiled function.",
    "GB0170")
DATA_ASSERT = _kind(
    "FL122", "Data-dependent assert",
    "The asserted condition depends on tensor values: the graph computes it and Python checks it.",
    "Use `torch._assert_async(cond)` or check outside the compiled function.",
    "GB0034")
DYNAMIC_SHAPE = _kind(
    "FL130", "Output shape depends on tensor data",
    "The operation's output size depends on the values in its input (e.g. `nonzero`, boolean-mask "
    "indexing): it runs in Python between graphs.",
    "Use a fixed-size form: `torch.where(mask, x, 0)` instead of `x[mask]`, or reduce with a mask.",
    "GB0036")
UNKNOWN_CALL = _kind(
    "FL140", "Call to a function fuselens cannot see into",
    "The function has no Python source and no known semantics (a C extension or builtin), so it "
    "cannot be captured: Python calls it between graphs.",
    "Use a torch operation instead, or move the call outside the compiled function.",
    "GB0147")
COMPILE_DISABLED = _kind(
    "FL141", "Call to a function marked torch.compiler.disable",
    "`@torch.compiler.disable` (or `torch._dynamo.disable`) keeps a function out of graphs: the "
    "graph ends before the call, Python runs the function eagerly, and the rest continues in a "
    "new graph, as under torch.compile.",
    "Remove the decorator if the function can be compiled; otherwise keep the call where a break "
    "costs least (outside loops).",
    "GB0098")
AUTOGRAD_FUNCTION = _kind(
    "FL142", "Custom autograd.Function that cannot be captured with its gradient",
    "A `torch.autograd.Function`'s `apply`, where autograd records it (an argument requires grad). "
    "Its forward is captured and its `backward`, traced into the graph, gives the gradient; here "
    "one of them cannot be: the forward returns several tensors that can have a gradient, marks "
    "one dirty or breaks the graph itself, or the backward is not straight-line torch code (Python "
    "decides on a tensor's value). Python runs the call eagerly between graphs (its forward and "
    "backward run once each, as in eager).",
    "Return one tensor with a gradient from the forward (others marked non-differentiable, or a "
    "Function of their own), and keep Python decisions on tensor values out of the backward "
    "(`torch.where` instead of `if`).",
    None)
UNSUPPORTED_STMT = _kind(
    "FL150", "Statement not supported in a graph",
    "This statement (e.g. del, global, a generator, a context manager of C code) cannot be "
    "captured: it runs in Python between graphs.",
    "Move it outside the compiled function, or rewrite it with supported constructs.",
    "GB0142")
UNSUPPORTED_EXPR = _kind(
    "FL151", "Expression not supported in a graph",
    "fuselens does not know how to capture this expression: it runs in Python between graphs.",
    "Rewrite it with tensor operations, or move it outside the compiled function.",
    "GB0147")
BACKWARD = _kind(
    "FL152", "backward() in a compiled function",
    "`backward()` runs the autograd engine, which a graph cannot hold: the graph ends, Python runs "
    "the backward pass (not compiled), and the rest of the function continues in a new graph.",
    "Compile the forward and the loss only, and call `loss.backward()` (and the optimizer step) "
    "outside the compiled function: its backward pass is then compiled too.",
    None)
UNROLLABLE_LOOP = _kind(
    "FL160", "Loop that cannot be unrolled",
    "The loop iterates over something not known at compile time (a tensor, an iterator), or the "
    "statement at a graph break in its body is a break/continue of it: the loop runs in Python.",
    "Iterate over a range, list, tuple or nn.ModuleList of fixed length.",
    "GB0147")
INLINE_DEPTH = _kind(
    "FL170", "Call nested too deep to inline",
    "Inlining stopped at the depth limit (recursion or a very deep call chain): the call runs in Python.",
    "Flatten the recursion into a loop over a fixed range.",
    "GB0065")
UNSUPPORTED_OP = _kind(
    "FL180", "Tensor operation could not be captured",
    "The operation failed during shape evaluation or has no known semantics: it runs in Python.",
    "Check the call's arguments; if they are valid in eager mode, please report it.",
    "GB0087")
INPLACE_VIEW = _kind(
    "FL181", "In-place operation through a view fuselens cannot write back",
    "In-place writes through indexing, reshapes and transposes are captured (the base tensor "
    "and its other views are updated); through this kind of view (`diagonal()`, a piece of "
    "`split()`, a view of a view) the statement runs in Python.",
    "Compute the new values out of place and write them with an item assignment, e.g. "
    "`x.copy_(torch.diagonal_scatter(x, x.diagonal() * 2))`.",
    None)


def kinds() -> list[BreakKind]:
    return list(_KINDS.values())


def kind(code: str) -> BreakKind:
    return _KINDS[code]


@dataclass(frozen=True)
class Frame:
    """One frame of the inlined-call stack: where a call was made (the call expression)."""
    function: str
    filename: str
    line: int
    col: int
    end_line: int
    end_col: int


@dataclass(frozen=True)
class GraphBreak:
    code: str
    title: str
    explanation: str
    hint: str
    filename: str
    line: int          # 1-based, real line in the file
    col: int           # 0-based column, as in `ast`
    end_line: int
    end_col: int
    stack: tuple[Frame, ...] = ()  # inlined calls, outermost first (empty at top level)
    torch_code: str | None = None
    detail: str = ""   # what exactly was found, e.g. "call to numpy.sum"
    function: str = ""  # the function whose code breaks (innermost frame)

    @property
    def doc_url(self) -> str:
        return f"{DOCS_URL}#{self.code.lower()}"

    def location(self) -> str:
        return f"{self.filename}:{self.line}:{self.col + 1}"

    def replace(self, **kw) -> "GraphBreak":
        return dataclasses.replace(self, **kw)


def make_break(k: BreakKind, loc, *, detail: str = "", stack=(), function: str = "",
               explanation: str | None = None) -> GraphBreak:
    """`loc` is (filename, line, col, end_line, end_col)."""
    filename, line, col, end_line, end_col = loc
    expl = explanation or k.explanation
    if detail:
        expl = f"{detail}. {expl}"
    return GraphBreak(k.code, k.title, expl, k.hint, filename, line, col, end_line, end_col,
                      tuple(stack), k.torch_code, detail, function)


class GraphBreakError(RuntimeError):
    """Raised by `fuselens.compile(..., fullgraph=True)` at the first graph break."""

    def __init__(self, brk: GraphBreak):
        self.graph_break = brk
        super().__init__(f"{brk.location()}: {brk.code} {brk.title}: {brk.explanation}\n"
                         f"hint: {brk.hint}")
