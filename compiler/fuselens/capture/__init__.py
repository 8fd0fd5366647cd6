"""Capture: the TorchDynamo analog (see docs/architecture.md)."""
from .analyze import analyze_source
from .breaks import GraphBreak, GraphBreakError
from .source import NoSourceError

__all__ = ["GraphBreak", "GraphBreakError", "NoSourceError", "analyze_source"]
