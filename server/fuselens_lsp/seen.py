"""Breaks seen at run time: what the concrete capture of a Compile & benchmark run found,
turned into diagnostics for every workspace file it occurs in.

The abstract domain guesses where a compiled function will break; a run knows. Each break is
shown at its own location (which may be in a callee's file) and, in every other workspace file
on the way to it, at the call that led there.
"""
from __future__ import annotations

import os

from lsprotocol import types as lsp
from pygls.uris import from_fs_path

from .analysis import SOURCE, PositionCodec, plain_text


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _text(path: str, doc) -> str | None:
    if doc is not None:
        return doc.source
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeError):
        return None


def _range(codec: PositionCodec, loc: dict) -> lsp.Range:
    # break JSON: 0-based lines, UTF-8 byte columns (as `ast`)
    return codec.range(loc["line"] + 1, loc["col"], loc["endLine"] + 1, loc["endCol"])


def seen_diagnostics(qualname: str, breaks: list[dict], roots: list[str], docs: dict) -> dict:
    """{path: (diagnostics, open document or None, modification time)} for the workspace files
    (under `roots`) the breaks occur in; `docs` maps real paths to open documents."""
    out: dict[str, tuple[list, object, int | None]] = {}
    codecs: dict[str, PositionCodec | None] = {}

    def add(path, loc, message, related, b):
        if not path or not _inside(path, roots):
            return
        if path not in codecs:
            text = _text(path, docs.get(path))
            codecs[path] = PositionCodec(text) if text is not None else None
        codec = codecs[path]
        if codec is None:
            return
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            mtime = None
        d = lsp.Diagnostic(range=_range(codec, loc), message=plain_text(message), severity=lsp.DiagnosticSeverity.Warning,
                           code=b["code"], code_description=lsp.CodeDescription(href=b["docUrl"]) if b.get("docUrl") else None,
                           source=SOURCE, related_information=related or None,
                           data={"qualname": qualname, "code": b["code"], "seenAtRunTime": True})
        out.setdefault(path, ([], docs.get(path), mtime))[0].append(d)

    def location(path, loc):
        codec = codecs.get(path)
        if codec is None:
            text = _text(path, docs.get(path))
            codec = codecs[path] = PositionCodec(text) if text is not None else None
        rng = _range(codec, loc) if codec else lsp.Range(start=lsp.Position(line=loc["line"], character=0),
                                                         end=lsp.Position(line=loc["endLine"], character=0))
        return lsp.Location(uri=from_fs_path(path) or path, range=rng)

    seen_note = f"\n(seen at run time: Compile & benchmark of `{qualname}` broke here)"
    for b in breaks:
        path = b.get("filename")
        stack = b.get("stack") or []
        body = f"{b['title']}: {b['explanation']}" + (f"\nHint: {b['hint']}" if b.get("hint") else "")
        related = [lsp.DiagnosticRelatedInformation(location=location(f["filename"], f),
                                                    message=f"`{f['function']}` calls `{callee}` here")
                   for f, callee in zip(stack, [x["function"] for x in stack[1:]] + [b.get("function", "")])
                   if f.get("filename")]
        add(path, b, body + seen_note, related, b)
        # the calls on the way, in other files: the break shows where that file's code leads to it
        for i, f in enumerate(stack):
            fpath = f.get("filename")
            if fpath == path or any(g.get("filename") == fpath for g in stack[i + 1:]):
                continue  # that file shows a call nearer the break (or the break itself)
            callee = stack[i + 1]["function"] if i + 1 < len(stack) else b.get("function", "")
            brk_loc = [lsp.DiagnosticRelatedInformation(location=location(path, b), message=f"the break itself: {b['title']}")] \
                if path else []
            add(fpath, f, f"{b['title']} inside `{callee}`, reached through this call: {b['explanation']}" + seen_note,
                brk_loc, b)
    return out
