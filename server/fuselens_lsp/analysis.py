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
    #: which of those get diagnostics: "reachable" (from something compiled or a `forward`) or "all"
    uncompiled_functions: str = "reachable"
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
        if d.get("uncompiledFunctions") in ("reachable", "all"):
            s.uncompiled_functions = d["uncompiledFunctions"]
        worker = d.get("worker") or {}
        tl = worker.get("timeLimitSeconds", d.get("worker.timeLimitSeconds"))
        if isinstance(tl, (int, float)) and tl > 0:
            s.time_limit_s = float(tl)
        ex = d.get("exampleInputs") or {}
        disc = ex.get("discovery", d.get("exampleInputs.discovery"))
        if isinstance(disc, list):
            s.discovery = tuple(x for x in disc if x in ("comment", "main", "pytest"))
        return s


#: A line and its terminator as LSP (and Python's tokenizer) count lines: only `\n`, `\r\n` and
#: `\r` end one (not `str.splitlines`' form feed, `\v`, U+0085, U+2028, ...).
_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
_EOL_RE = re.compile(r"\r\n|\r|\n")


def lines_with_ends(source: str) -> list[str]:
    """`source.splitlines(True)`, splitting only where LSP does (an empty source has no line)."""
    return _LINE_RE.findall(source)


def split_lines(source: str) -> list[str]:
    """`source.split("\\n")` for LSP line breaks: one entry per line, the last possibly empty."""
    return _EOL_RE.split(source)


class PositionCodec:
    """Converts between `ast` positions (1-based line, 0-based UTF-8 byte column) and LSP
    positions (0-based line, UTF-16 code units), for one version of a document. Both count
    lines the same way (`split_lines`)."""

    def __init__(self, source: str):
        self.source = source
        self.lines = split_lines(source)

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
        off = sum(len(t) for t in self._with_ends()[:pos.line])
        text = self.lines[pos.line] if pos.line < len(self.lines) else ""
        if text.isascii():
            return off + min(pos.character, len(text))
        units = 0
        for i, ch in enumerate(text):
            if units >= pos.character:
                return off + i
            units += 2 if ord(ch) > 0xFFFF else 1
        return off + len(text)

    def _with_ends(self) -> list[str]:
        ends = getattr(self, "_ends", None)
        if ends is None:
            ends = self._ends = lines_with_ends(self.source)
        return ends


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
    #: reached from nothing compiled and no `forward` (reachability.py): no diagnostics, no lens
    quiet: bool = False

    def to_json(self, stale: bool = False) -> dict:
        return {
            "stale": stale, "name": self.name, "qualname": self.qualname, "line": self.line - 1, "col": self.col,
            "endLine": self.end_line - 1, "endCol": self.end_col, "compiled": self.compiled,
            "usesTorch": self.uses_torch, "graphCount": self.graph_count,
            "breakCount": len(self.breaks), "suppressed": self.suppressed, "quiet": self.quiet,
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
    #: functions (and their diagnostics) carried over from the last version that parsed, because
    #: this version does not: their positions are that version's (`stale_source`)
    stale: list[str] = field(default_factory=list)
    stale_source: str = ""

    def with_last_good(self, good: "Result") -> "Result":
        """This result of a version with a syntax error, plus what the last good version found in
        the functions this one could not analyse, marked stale, so that an edit in progress does
        not wipe the file's diagnostics and lenses."""
        have = {f.qualname for f in self.functions}
        keep = [f for f in good.functions if f.qualname not in have]
        if not keep or good.syntax_error is not None:
            return self
        names = {f.qualname for f in keep}
        n_lines = len(split_lines(self.source))
        line = self.syntax_error[0]
        note = (f"\n(stale: from the last version that parsed; line {line} has a syntax error: "
                f"{self.syntax_error[2]})")
        old = [lsp.Diagnostic(range=d.range, message=d.message + note, severity=d.severity, code=d.code,
                              code_description=d.code_description, source=d.source,
                              related_information=d.related_information,
                              data={**(d.data or {}), "stale": True})
               for d in good.diagnostics if (d.data or {}).get("qualname") in names
               and d.range.start.line < n_lines]  # past the end of the text now: gone
        diags = sorted(self.diagnostics + old, key=lambda d: (d.range.start.line, d.range.start.character))
        return Result(self.version, self.functions + keep, diags, self.syntax_error, self.repaired,
                      self.source, self.raw, sorted(names), good.source)


#: What parsing or analysing a file that Python cannot compile may raise besides SyntaxError: a
#: lone surrogate (UnicodeError), a NUL byte (ValueError), nesting or an expression too deep for
#: the parser or for the analysis' recursion (RecursionError, MemoryError).
UNPARSEABLE = (SyntaxError, ValueError, UnicodeError, RecursionError, MemoryError)


def _analyze_source(source: str, filename: str, cache=None, compiled_classes=frozenset()):
    """The compiler's abstract-domain analysis (with `cache`, an incremental.IncrementalAnalyzer,
    only of what changed); None and the reason when the text is unparseable.
    `compiled_classes`: the file's classes that other workspace files compile."""
    import functools
    from fuselens.capture.analyze import analyze_source  # imports torch: on the first analysis
    if "\r" in source:  # `ast` reads a string's lone `\r` as no line break at all
        source = _EOL_RE.sub("\n", source)
    run = functools.partial(analyze_source, compiled_classes=compiled_classes)
    try:
        if cache is None:
            res = run(source, filename)
        else:
            res = cache.analyze(source, filename, run, key=",".join(sorted(compiled_classes)))
    except UNPARSEABLE as e:
        return None, _unparseable(source, e)
    return res, res.syntax_error


def _unparseable(source: str, e: BaseException) -> tuple[int, int, str]:
    if isinstance(e, SyntaxError):
        return (e.lineno or 1, max((e.offset or 1) - 1, 0), e.msg)
    if isinstance(e, UnicodeError):
        # a lone surrogate: point at it
        for i, line in enumerate(split_lines(source)):
            for j, ch in enumerate(line):
                if 0xD800 <= ord(ch) <= 0xDFFF:
                    return (i + 1, len(line[:j].encode("utf-8", "surrogatepass")), "lone surrogate in the text")
        return (1, 0, f"not valid Unicode ({e.reason})")
    if isinstance(e, ValueError):
        i = source.find("\0")
        if i >= 0:
            return (source.count("\n", 0, i) + 1, 0, "NUL character in the text")
        return (1, 0, str(e))
    return (1, 0, "nesting too deep to analyse" if isinstance(e, RecursionError) else "file too large to analyse")


def _blank_broken_block(source: str, line: int) -> str | None:
    """Blanks the top-level statement containing `line` (1-based), keeping line numbers, so that
    the rest of a file with a half-typed function can still be analysed."""
    lines = lines_with_ends(source)
    if not lines:
        return None
    i = min(max(line - 1, 0), len(lines) - 1)

    def top_level(j):
        t = lines[j].rstrip("\r\n")
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
    blank = [t[len(t.rstrip("\r\n")):] for t in lines[start:end]]  # keep only the line breaks
    return "".join(lines[:start] + blank + lines[end:])


def run_analysis(source: str, filename: str, cache=None, compiled_classes=frozenset()):
    """Runs the abstract-domain analysis; on a syntax error, re-runs it with the broken top-level
    statement blanked out (up to 3 times). Returns (analysis, syntax_error, repaired)."""
    res, err = _analyze_source(source, filename, cache, compiled_classes)
    if err is None:
        return res, None, False
    text, at = source, err
    for _ in range(3):
        fixed = _blank_broken_block(text, at[0])
        if fixed is None or fixed == text:
            break
        text = fixed
        res, at = _analyze_source(text, filename, cache, compiled_classes)
        if at is None:
            return res, err, True
    return None, err, False


def _severity(fn, settings: Settings) -> lsp.DiagnosticSeverity | None:
    if fn.compiled:
        return lsp.DiagnosticSeverity.Warning
    if settings.information_severity == "off":
        return None
    return SEVERITIES[settings.information_severity]


_CODE_SPAN = re.compile(r"`([^`\n]+)`")


def plain_text(text: str) -> str:
    """Markdown code spans as quoted text: the editor shows a diagnostic's message as plain
    text (hovers, Problems), where backticks would show as they are."""
    return _CODE_SPAN.sub(r"'\1'", text)


def _message(b) -> str:
    msg = f"{b.title}: {b.explanation}"
    if b.hint:
        msg += f"\nHint: {b.hint}"
    if b.torch_code:
        msg += f"\n(torch.compile: {b.torch_code})"
    return plain_text(msg)


def analyze(source: str, uri: str, filename: str, version: int | None,
            settings: Settings, cache=None, compiled_classes=frozenset()) -> Result:
    analysis, err, repaired = run_analysis(source, filename, cache, compiled_classes)
    if analysis is None:
        return Result(version, [], [], err, False, source)
    codec = PositionCodec(source)
    lines = codec.lines
    functions: list[FunctionInfo] = []
    # (code, range) -> diagnostic; a break inside a helper inlined into several functions is
    # reported once, with the strongest severity and every call chain as related information.
    by_key: dict[tuple, lsp.Diagnostic] = {}
    # a helper a compiled function's break lies in (or passes through) is listed even when it
    # does not use torch itself: the side panel shows it with the compiled functions
    here = lambda fn: not fn or fn == filename  # noqa: E731
    on_path = {q for fa in analysis.functions if fa.compiled for b in fa.breaks
               for q in ([b.function] if here(b.filename) else []) + [fr.function for fr in b.stack if here(fr.filename)]}
    # a function whose analysis came from the cache unchanged (incremental.py) has the same
    # FunctionAnalysis object, at the same place in an unchanged text: its ranges are reused
    memo = cache.memo if cache is not None else {}
    fresh = {}
    reached = None
    if settings.uncompiled_functions == "reachable":
        from .reachability import reachable
        reached = reachable(source, {fa.qualname for fa in analysis.functions if fa.compiled})
    for fa in analysis.functions:
        if not (fa.compiled or fa.uses_torch or fa.qualname in on_path):
            continue
        # never captured (an `__init__` helper, a script's function): no claim made, no lens; it
        # is still listed, for Compile & benchmark
        quiet = not (fa.compiled or fa.qualname in on_path or reached is None or fa.qualname in reached)
        sev = None if quiet else _severity(fa, settings)
        got = memo.get(id(fa))
        if got is None or got[0] is not fa or got[1] != (sev, quiet):
            kept = [] if quiet else [b for b in fa.breaks if not is_suppressed(lines, b)]
            got = (fa, (sev, quiet), kept, _entries(fa, kept, codec, uri, filename) if sev is not None else [])
        fresh[id(fa)] = got
        kept = got[2]
        functions.append(FunctionInfo(fa.name, fa.qualname, fa.line, fa.col, fa.end_line, fa.end_col,
                                      fa.compiled, fa.uses_torch, fa.graph_count, kept,
                                      0 if quiet else len(fa.breaks) - len(kept), quiet))
        for key, rng, b, related in got[3]:
            d = by_key.get(key)
            if d is None:
                d = lsp.Diagnostic(
                    range=rng, message=_message(b), severity=sev, code=b.code,
                    code_description=lsp.CodeDescription(href=b.doc_url), source=SOURCE,
                    related_information=list(related) or None,
                    data={"qualname": fa.qualname, "code": b.code})
                by_key[key] = d
            else:
                if sev < d.severity:  # lower value = more severe
                    d.severity = sev
                    d.data = {"qualname": fa.qualname, "code": b.code}
                if related:
                    d.related_information = (d.related_information or []) + list(related)
    if cache is not None:
        cache.memo = fresh
    diags = sorted(by_key.values(), key=lambda d: (d.range.start.line, d.range.start.character))
    return Result(version, functions, diags, err, repaired, source, analysis)


def _entries(fa, kept, codec: PositionCodec, uri: str, filename: str) -> list[tuple]:
    """(key, range, break, related information) of each of `fa`'s kept breaks."""
    out = []
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
        for i, fr in enumerate(b.stack):
            if fr.filename and fr.filename != filename:
                continue
            related.append(lsp.DiagnosticRelatedInformation(
                location=lsp.Location(uri=uri, range=codec.range(fr.line, fr.col, fr.end_line, fr.end_col)),
                message=call_message(b, i, fa.qualname)))
        if b.stack and not same_file:
            related.append(lsp.DiagnosticRelatedInformation(
                location=lsp.Location(uri=_path_uri(b.filename),
                                      range=lsp.Range(start=lsp.Position(line=b.line - 1, character=b.col),
                                                      end=lsp.Position(line=(b.end_line or b.line) - 1,
                                                                       character=b.end_col))),
                message=f"the break itself: {b.title}"))
        key = (b.code, rng.start.line, rng.start.character, rng.end.line, rng.end.character)
        out.append((key, rng, b, tuple(related)))
    return out


def call_message(b, i: int, compiled: str) -> str:
    """Related information for frame `i` of a break's stack: the frame is a call made in
    `stack[i].function`; what it calls is the next frame's function, or the innermost one."""
    callee = b.stack[i + 1].function if i + 1 < len(b.stack) else b.function
    caller = b.stack[i].function
    msg = f"`{caller}` calls `{callee}` here" if caller else f"call to `{callee}`"
    if caller != compiled:
        msg += f" (inlined into `{compiled}`)"
    if callee != b.function:
        msg += f"; the break is in `{b.function}`"
    return msg


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


__all__ = ["Settings", "PositionCodec", "split_lines", "lines_with_ends", "call_message", "FunctionInfo", "Result", "analyze", "run_analysis",
           "suppressed_codes", "is_suppressed", "function_at", "count_breaks"]
