"""Ahead-of-time autograd: joint graph from VJP rules (joint.py), min-cut partition (partition.py),
eager autograd's facts about a graph (facts.py). The torch.autograd.Function that runs both
halves as compiled programs is the backend driver's: backend/training.py."""
from .joint import build_joint
from .partition import partition

__all__ = ["build_joint", "partition"]
