"""Capture: the TorchDynamo analog (see docs/architecture.md)."""
from .breaks import GraphBreak, GraphBreakError
from .source import NoSourceError

__all__ = ["GraphBreak", "GraphBreakError", "NoSourceError", "analyze_source"]


def analyze_source(source: str, filename: str, compiled_classes=frozenset()):
    """Abstract-domain analysis of a file's functions for the editor (executes no user code)."""
    from .analyze import analyze_source as _analyze
    return _analyze(source, filename, compiled_classes)
