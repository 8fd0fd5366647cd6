"""Helpers for the server tests (importable because pytest puts this folder on sys.path)."""
from __future__ import annotations

from lsprotocol import types as lsp


def text_of(source: str, rng: lsp.Range) -> str:
    lines = source.split("\n")
    if rng.start.line == rng.end.line:
        return lines[rng.start.line][rng.start.character:rng.end.character]
    parts = [lines[rng.start.line][rng.start.character:]]
    parts += lines[rng.start.line + 1:rng.end.line]
    parts.append(lines[rng.end.line][:rng.end.character])
    return "\n".join(parts)


def apply_edits(source: str, edits) -> str:
    """Applies LSP TextEdits (non-overlapping) to a source string."""
    from fuselens_lsp.analysis import PositionCodec
    codec = PositionCodec(source)
    spans = sorted(((codec.offset(e.range.start), codec.offset(e.range.end), e.new_text) for e in edits),
                   reverse=True)
    for a, b, t in spans:
        source = source[:a] + t + source[b:]
    return source


def as_dict(v):
    """Custom-request results as plain dicts, whatever object type the client decoded them to."""
    if isinstance(v, dict):
        return {k: as_dict(x) for k, x in v.items()}
    if hasattr(v, "_asdict"):  # pygls decodes custom results to namedtuples
        return as_dict(v._asdict())
    if isinstance(v, (list, tuple)):
        return [as_dict(x) for x in v]
    if hasattr(v, "__dict__") and not isinstance(v, type):
        return as_dict(vars(v))
    return v
