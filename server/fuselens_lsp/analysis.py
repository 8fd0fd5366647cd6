"""From source text to what the editor shows: diagnostics and per-function summaries.

Everything here is pure (no LSP I/O) and executes no user code: it calls the compiler's
abstract-domain evaluator, `fuselens.capture.analyze_source`, and turns its `GraphBreak`
values into LSP diagnostics. The server runs `analyze` in a worker thread.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from lsprotocol import types as lsp

SOURCE = "fuselens"

#: `# fuselens: ignore[FL100, FL120]` (or a bare `# fuselens: ignore`) on the line a break starts.
SUPPRESS_RE = re.compile(r"#\s*fuselens:\s*ignore(?:\[(?P<codes>[A-Za-z0-9_,\s]*)\])?")

SEVERITIES = {
    "error": lsp.DiagnosticSeverity.Error,
    "warning": lsp.DiagnosticSeverity.Warning,
    "information": lsp.DiagnosticSeverity.Information,
    "hint": lsp.DiagnosticSeverity.Hint,
}


@dataclass
class Settings:
    information_severity: str = "information"   # for functions that use torch but are not compiled
    time_limit_s: float = 120.0
    discovery: tuple[str, ...] = ("comment", "main", "pytest")

    @classmethod
    def from_dict(cls, d: dict | None) -> "Settings":
        s = cls()
        if not isinstance(d, dict):
            return s
        sev = d.get("informationSeverity")
        if isinstance(sev, str) and (sev in SEVERITIES or sev == "off"):
            s.information_severity = sev
        worker = d.get("worker") or {}
        tl = worker.get("timeLimitSeconds", d.get("worker.timeLimitSeconds"))
        if isinstance(tl, (int, float)) and tl > 0:
            s.time_limit_s = float(tl)
        ex = d.get("exampleInputs") or {}
        disc = ex.get("discovery", d.get("exampleInputs.discovery"))
        if isinstance(disc, list):
            s.discovery = tuple(x for x in disc if x in ("comment", "main", "pytest"))
        return s


class PositionCodec:
    """Converts between `ast` positions (1-based line, 0-based UTF-8 byte column) and LSP
    positions (0-based line, UTF-16 code units), for one version of a document."""

    def __init__(self, source: str):
        self.lines = source.split("\n")

    def to_lsp(self, line: int, col: int) -> lsp.Position:
        i = max(line - 1, 0)
        if i >= len(self.lines):
            return lsp.Position(line=len(self.lines) - 1 if self.lines else 0,
                                character=len(self.lines[-1]) if self.lines else 0)
        text = self.lines[i]
        if text.isascii():
            return lsp.Position(line=i, character=min(max(col, 0), len(text)))
        prefix = text.encode("utf-8")[:max(col, 0)].decode("utf-8", errors="ignore")
        return lsp.Position(line=i, character=len(prefix.encode("utf-16-le")) // 2)

    def range(self, line, col, end_line, end_col) -> lsp.Range:
        start = self.to_lsp(line, col)
        end = self.to_lsp(end_line or line, end_col if end_col is not None else col)
        if (end.line, end.character) < (start.line, start.character):
            end = start
        return lsp.Range(start=start, end=end)

    def offset(self, pos: lsp.Position) -> int:
        """Character offset (str index) of an LSP position."""
        off = sum(len(t) + 1 for t in self.lines[:pos.line])
        text = self.lines[pos.line] if pos.line < len(self.lines) else ""
        if text.isascii():
            return off + min(pos.character, len(text))
        units = 0
        for i, ch in enumerate(text):
            if units >= pos.character:
                return off + i
            units += 2 if ord(ch) > 0xFFFF else 1
        return off + len(text)


def suppressed_codes(line_text: str) -> set[str] | None:
    """Codes suppressed on a line: None if no suppression, {'*'} for a bare ignore."""
    m = SUPPRESS_RE.search(line_text)
    if not m:
        return None
    codes = m.group("codes")
    if codes is None or not codes.strip():
        return {"*"}
    return {c.strip().upper() for c in codes.split(",") if c.strip()}


def is_suppressed(lines: list[str], brk) -> bool:
    for ln in {brk.line, brk.end_line or brk.line}:
        if 1 <= ln <= len(lines):
            codes = suppressed_codes(lines[ln - 1])
            if codes and ("*" in codes or brk.code.upper() in codes):
                return True
    return False


@dataclass
class FunctionInfo:
    """One analysed function, as the code lens and the side panel see it: the fields of
    fuselens.capture.analyze.FunctionAnalysis plus the suppressed count. Not a subclass on
    purpose: importing fuselens (and torch) is deferred until the first analysis, so the
    server answers `initialize` at once."""
    name: str
    qualname: str
    line: int
    col: int
    end_line: int
    end_col: int
    compiled: bool
    uses_torch: bool
    graph_count: int
    breaks: list = field(default_factory=list)       # GraphBreak values (unsuppressed)
    suppressed: int = 0

    def to_json(self) -> dict:
        return {
            "name": self.name, "qualname": self.qualname, "line": self.line - 1, "col": self.col,
            "endLine": self.end_line - 1, "endCol": self.end_col, "compiled": self.compiled,
            "usesTorch": self.uses_torch, "graphCount": self.graph_count,
            "breakCount": len(self.breaks), "suppressed": self.suppressed,
            "breaks": [break_json(b) for b in self.breaks],
        }


def break_json(b) -> dict:
    return {"code": b.code, "title": b.title, "line": b.line - 1, "col": b.col,
            "endLine": (b.end_line or b.line) - 1, "endCol": b.end_col, "explanation": b.explanation,
            "hint": b.hint, "docUrl": b.doc_url, "torchCode": b.torch_code,
            "function": getattr(b, "function", "")}


@dataclass
class Result:
    """Analysis of one document version."""
    version: int | None
    functions: list[FunctionInfo]
    diagnostics: list[lsp.Diagnostic]
    syntax_error: tuple | None = None
    repaired: bool = False          # analysed with the broken statement blanked out
    source: str = ""
    raw: object = None              # the SourceAnalysis


def analyze_source(source: str, filename: str):
    from fuselens.capture import analyze_source as _analyze
    return _analyze(source, filename)


def _blank_broken_block(source: str, line: int) -> str | None:
    """Blanks the top-level statement containing `line` (1-based), keeping line numbers, so that
    the rest of a file with a half-typed function can still be analysed."""
    lines = source.split("\n")
    if not lines:
        return None
    i = min(max(line - 1, 0), len(lines) - 1)

    def top_level(j):
        t = lines[j]
        return t.strip() != "" and not t[0].isspace() and not t.lstrip().startswith("#")

    start = i
    while start > 0 and not top_level(start):
        start -= 1
    # include decorators above the statement
    while start > 0 and lines[start - 1].startswith("@"):
        start -= 1
    end = i + 1
    while end < len(lines) and not top_level(end):
        end += 1
    # A block that starts with a decorator must run through its def.
    while end < len(lines) and lines[end - 1].startswith("@"):
        end += 1
    out = lines[:start] + [""] * (end - start) + lines[end:]
    return "\n".join(out)


def run_analysis(source: str, filename: str):
    """Runs the abstract-domain analysis; on a syntax error, re-runs it with the broken top-level
    statement blanked out (up to 3 times). Returns (analysis, syntax_error, repaired)."""
    res = analyze_source(source, filename)
    err = res.syntax_error
    if err is None:
        return res, None, False
    text = source
    for _ in range(3):
        fixed = _blank_broken_block(text, res.syntax_error[0])
        if fixed is None or fixed == text:
            break
        text = fixed
        res = analyze_source(text, filename)
        if res.syntax_error is None:
            return res, err, True
    return None, err, False


def _severity(fn, settings: Settings) -> lsp.DiagnosticSeverity | None:
    if fn.compiled:
        return lsp.DiagnosticSeverity.Warning
    if settings.information_severity == "off":
        return None
    return SEVERITIES[settings.information_severity]


def _message(b) -> str:
    msg = f"{b.title}: {b.explanation}"
    if b.hint:
        msg += f"\nHint: {b.hint}"
    if b.torch_code:
        msg += f"\n(torch.compile: {b.torch_code})"
    return msg


def analyze(source: str, uri: str, filename: str, version: int | None,
            settings: Settings) -> Result:
    analysis, err, repaired = run_analysis(source, filename)
    if analysis is None:
        return Result(version, [], [], err, False, source)
    codec = PositionCodec(source)
    lines = codec.lines
    functions: list[FunctionInfo] = []
    # (code, range) -> diagnostic; a break inside a helper inlined into several functions is
    # reported once, with the strongest severity and every call chain as related information.
    by_key: dict[tuple, lsp.Diagnostic] = {}
    for fa in analysis.functions:
        if not (fa.compiled or fa.uses_torch):
            continue
        kept = [b for b in fa.breaks if not is_suppressed(lines, b)]
        info = FunctionInfo(fa.name, fa.qualname, fa.line, fa.col, fa.end_line, fa.end_col,
                            fa.compiled, fa.uses_torch, fa.graph_count, kept,
                            len(fa.breaks) - len(kept))
        functions.append(info)
        sev = _severity(fa, settings)
        if sev is None:
            continue
        for b in kept:
            same_file = not b.filename or b.filename == filename
            if same_file:
                rng = codec.range(b.line, b.col, b.end_line, b.end_col)
            elif b.stack:  # break in another file: show it on the outermost call
                f0 = b.stack[0]
                rng = codec.range(f0.line, f0.col, f0.end_line, f0.end_col)
            else:
                continue
            related = []
            for fr in b.stack:
                if fr.filename and fr.filename != filename:
                    continue
                related.append(lsp.DiagnosticRelatedInformation(
                    location=lsp.Location(uri=uri, range=codec.range(fr.line, fr.col, fr.end_line,
                                                                     fr.end_col)),
                    message=f"inlined into `{fa.qualname}` through this call to `{fr.function}`"
                    if fr.function else f"inlined into `{fa.qualname}` here"))
            if b.stack and not same_file:
                related.append(lsp.DiagnosticRelatedInformation(
                    location=lsp.Location(uri=_path_uri(b.filename),
                                          range=lsp.Range(start=lsp.Position(line=b.line - 1, character=b.col),
                                                          end=lsp.Position(line=(b.end_line or b.line) - 1,
                                                                           character=b.end_col))),
                    message=f"the break itself: {b.title}"))
            key = (b.code, rng.start.line, rng.start.character, rng.end.line, rng.end.character)
            d = by_key.get(key)
            if d is None:
                d = lsp.Diagnostic(
                    range=rng, message=_message(b), severity=sev, code=b.code,
                    code_description=lsp.CodeDescription(href=b.doc_url), source=SOURCE,
                    related_information=related or None,
                    data={"qualname": fa.qualname, "code": b.code})
                by_key[key] = d
            else:
                if sev < d.severity:  # lower value = more severe
                    d.severity = sev
                    d.data = {"qualname": fa.qualname, "code": b.code}
                if related:
                    d.related_information = (d.related_information or []) + related
    diags = sorted(by_key.values(), key=lambda d: (d.range.start.line, d.range.start.character))
    return Result(version, functions, diags, err, repaired, source, analysis)


def _path_uri(path: str) -> str:
    from pygls.uris import from_fs_path
    return from_fs_path(path) or path


def function_at(functions: list[FunctionInfo], line0: int) -> FunctionInfo | None:
    """Innermost analysed function whose def spans 0-based `line0`."""
    best = None
    for f in functions:
        if f.line - 1 <= line0 <= f.end_line - 1:
            if best is None or f.line >= best.line:
                best = f
    return best


def count_breaks(analysis) -> dict[str, int]:
    return {f.qualname: len(f.breaks) for f in analysis.functions}


__all__ = ["Settings", "PositionCodec", "FunctionInfo", "Result", "analyze", "run_analysis",
           "suppressed_codes", "is_suppressed", "function_at", "count_breaks"]
