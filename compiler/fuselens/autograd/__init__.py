"""Ahead-of-time autograd: joint graph from VJP rules (joint.py), min-cut partition (partition.py),
and the torch.autograd.Function that runs both halves as compiled programs (function.py)."""
from .function import compile_training
from .joint import build_joint
from .partition import partition

__all__ = ["build_joint", "compile_training", "partition"]
