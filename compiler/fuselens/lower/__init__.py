"""Loop-level IR (ir.py) and the lowering of primitive graphs into it (lowering.py)."""
from .lowering import lower_graph

__all__ = ["lower_graph"]
