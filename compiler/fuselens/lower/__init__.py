"""Loop-level IR (ir.py) and the lowering of primitive graphs into it (lowering.py, with the
rules of primitives their kind's lowering does not cover in rules.py)."""
from . import rules  # noqa: F401  (registers the lowering rules)
from .lowering import lower_graph

__all__ = ["lower_graph"]
