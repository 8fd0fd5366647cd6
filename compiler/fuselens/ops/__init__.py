"""Primitive ops: one registry (primitives.py, with the pointwise primitives' VJP rules), the other
VJP rules (vjp.py) and torch-level decompositions."""
from . import primitives, vjp  # noqa: F401  (vjp registers rules onto the primitives)
from .primitives import PRIMITIVES, Primitive
from .trace import merge_common_subexpressions, to_primitive_graph, values_only

__all__ = ["PRIMITIVES", "Primitive", "merge_common_subexpressions", "to_primitive_graph", "values_only"]
