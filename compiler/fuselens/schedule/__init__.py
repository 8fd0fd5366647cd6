"""Fusion of computed buffers into kernels, and which buffers still need memory (fusion.py)."""
from .fusion import FusedKernel, Schedule, schedule

__all__ = ["FusedKernel", "Schedule", "schedule"]
