"""The values the evaluator computes with.

Constants are plain Python values (ints, modules, dtypes, functions, ...). Only what is not
known at capture time is wrapped: a `TensorVar` (an FX node plus its meta tensor), a `SymInt`
(a size of a dynamic dimension), and, in the abstract domain, `Unknown`."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import torch

try:  # (NumPy is optional to torch, and so to capture)
    import numpy as _np
    NUMPY_SCALARS, NUMPY_DTYPE = (_np.bool_, _np.number), _np.dtype
except ImportError:  # pragma: no cover
    NUMPY_SCALARS, NUMPY_DTYPE = (), ()


def is_array_type(t: type) -> bool:
    """NumPy's arrays and other array data (what has `__array__`), but tensors and NumPy's
    scalars (values, guarded by value)."""
    return hasattr(t, "__array__") and not issubclass(t, (torch.Tensor, TensorVar, *NUMPY_SCALARS))


def torch_number(v):
    """The Python number torch's argument parser reads the NumPy scalar `v` as (`scalar_slow` in
    torch/csrc/utils/python_arg_parser.cpp), so that a graph holds what eager computes with: an
    integer as an int, a complex128 (a subclass of Python's complex) as a complex, anything else
    as a float: a float16 or float32 by its exact value, np.bool_ as 0.0 or 1.0 (eager's
    `bool_tensor * np.True_` is float32; a bool parameter refuses it), a complex64 by its real
    part (eager warns that it drops the imaginary one)."""
    if isinstance(v, _np.integer):
        return int(v)
    if isinstance(v, complex):
        return complex(v)
    return float(v.real)


class TensorVar:
    """A tensor inside the graph being built. `meta` is a tensor on device 'meta' with the
    shape, stride and dtype (None in the abstract domain: shape unknown). `version` counts the
    in-place updates of the storage it belongs to; `base` is the TensorVar it is a view of."""
    __slots__ = ("node", "meta", "device", "source", "abstract_bool", "assumed", "view_of", "bounds", "known",
                 "number")

    def __init__(self, node, meta, device, source=None):
        self.node = node
        self.meta = meta
        self.device = device
        self.source = source  # guard/source expression if this is a graph input
        self.abstract_bool = False  # abstract domain: known to hold booleans (a comparison)
        # abstract domain: taken for a tensor for want of evidence (an un-annotated parameter, the
        # result of an unknown call, Python operators on such values only): it may as well be a
        # number, so no break is claimed on its value
        self.assumed = False
        # a view of another TensorVar, as (parent, fn, args, kwargs, item): `fn(parent, *args,
        # **kwargs)` (then `[item]` when fn returns a tuple of views, item not None)
        self.view_of = None
        self.bounds = None  # capture/bounds.py Bounds: every element lies within them
        self.known = None  # a comparison the bounds decide: every element's value (True or False)
        # the value of a one-element tensor a torch function made of Python numbers alone
        # (`torch.div(n, 2, rounding_mode="trunc")`): what Python reads of it where a size needs it
        self.number = None

    @staticmethod
    def only_assumed(values) -> bool:
        """The tensors among `values` (one at least) are all assumed ones: what Python does with
        them, it may be doing with numbers (no break to claim)."""
        tensors = [v for v in values if isinstance(v, TensorVar)]
        return bool(tensors) and all(v.assumed for v in tensors)

    @property
    def is_bool(self) -> bool:
        return self.meta.dtype == torch.bool if self.meta is not None else self.abstract_bool

    @property
    def shape(self):
        return None if self.meta is None else self.meta.shape

    def __repr__(self):
        return f"TensorVar({self.node}, {tuple(self.shape) if self.meta is not None else '?'})"


@dataclass(eq=False)
class SymInt:
    """A size that may change between calls (a dynamic dimension) or derived from one.
    `hint` is its value for the example inputs; `expr` a Python expression over the guard
    function's parameters (None where none spells it: an intermediate's size, capture/symbolic.py);
    `build` makes (and caches) the graph node that computes it."""
    hint: int
    expr: str | None
    build: object  # () -> fx.Node
    _node: object = None

    def node(self):
        # (made again where a rolled-back statement erased it: the statement that first used it)
        if self._node is None or self._node._erased:
            self._node = self.build()
        return self._node


class SymShape(tuple):
    """`t.shape` with dynamic dims (SymInts in it): Python code gets it back as a torch.Size."""


class Unknown:
    """A non-tensor value not known in the abstract domain (e.g. an int argument)."""
    __slots__ = ("what",)

    def __init__(self, what="value"):
        self.what = what

    def __repr__(self):
        return f"Unknown({self.what})"


UNKNOWN = Unknown()
NOT_HANDLED = object()  # a known function's handler: not these arguments (builtins.KNOWN)


class ForeignData(Unknown):
    """Abstract domain: what a C function the capture cannot see into (NumPy's) returned on a
    path that certainly runs, with the breaks of the calls that made it (`breaks`). Capture
    breaks at each such call, but NumPy work of its own (a preprocessing helper) is no tensor
    code: the editor claims those breaks where the data reaches torch."""
    __slots__ = ("breaks",)

    def __init__(self, breaks=()):
        super().__init__("foreign data")
        self.breaks = tuple(breaks)

    @staticmethod
    def merge(*values, extra=()) -> "ForeignData | None":
        """The ForeignData made from `values` (None if none of them is one)."""
        found = [b for v in values if isinstance(v, ForeignData) for b in v.breaks]
        return ForeignData(found + list(extra)) if found or extra else None


@dataclass(eq=False)
class LocalFunction:
    """A `def` or `lambda` evaluated inside captured code: inlined when called."""
    node: ast.AST
    env: object          # the Scope it closes over
    defaults: dict = field(default_factory=dict)
    name: str = "<lambda>"


class GeneratorItems(tuple):
    """What a generator expression yields, computed where capture meets it (in the order its
    generator would give them): a tuple to capture's consumers (`sum`, `torch.cat`, a `for`);
    a fresh iterator over them where Python code receives it (a statement run at a break)."""


class GeneratorCall:
    """A call of a generator function, not run yet: capture runs its body when it is iterated
    (Evaluator.run_generator); anything else done with it is a break."""
    __slots__ = ("fs_scope", "items")

    def __init__(self, fs, scope):
        self.fs_scope = (fs, scope)
        self.items = None  # what it yielded, once run


@dataclass(eq=False)
class BoundUserMethod:
    fn: object
    self_value: object


def leaves(v):
    """The values inside nested lists, tuples and dicts (v itself if it is none of them)."""
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from leaves(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from leaves(x)
    else:
        yield v


def contains_tensor(v) -> bool:
    return any(isinstance(x, TensorVar) for x in leaves(v))


class ValueSources:
    """Where each object reached from outside is found (`self.config`, an argument): by
    identity, the objects kept alive (an id alone could be reused by a later object, which would
    inherit a wrong source)."""

    def __init__(self):
        self._by_id: dict[int, tuple] = {}

    def get(self, obj, default=None):
        hit = self._by_id.get(id(obj))
        return hit[1] if hit is not None and hit[0] is obj else default

    def set(self, obj, src: str) -> None:
        self._by_id[id(obj)] = (obj, src)
