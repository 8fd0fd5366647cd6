"""The fuselens language server (pygls 2).

- Diagnostics: graph breaks from the compiler's abstract-domain analysis, on open and on every
  edit (debounced), computed in a thread so the server keeps answering; results for an older
  document version are dropped, never published.
- Code lens: graph/break counts and "Compile & benchmark" above each analysed function.
- Code actions: verified libcst rewrites (see fixes.py) and a suppression comment.
- Command `fuselens.compileAndBenchmark`: runs a worker process (see jobs.py), only in a trusted
  workspace, with work-done progress, a time limit and cancel.
- Custom requests for the side panel: `fuselens/functions`, `fuselens/kernel`,
  `fuselens/transformedSource`; notification `fuselens/didChange` when they change.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import gc
import logging
import os
import re
import sys
import time
import traceback
import uuid

from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path

from . import __version__
from .analysis import (PositionCodec, Result, Settings, analyze, break_json, function_at, plain_text,
                       split_lines)
from .compile_sites import CompileSites
from .documents import LspLinesWorkspace
from .incremental import IncrementalAnalyzer
from .jobs import run_worker

log = logging.getLogger("fuselens_lsp")

CMD_COMPILE = "fuselens.server.compileAndBenchmark"
REQ_FUNCTIONS = "fuselens/functions"
REQ_KERNEL = "fuselens/kernel"
REQ_TRANSFORMED = "fuselens/transformedSource"
REQ_GRAPH = "fuselens/graph"
NOTIFY_CHANGED = "fuselens/didChange"
NOTIFY_TRUST = "fuselens/setTrusted"

DEBOUNCE_S = 0.05
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".tox", "build", "dist", ".mypy_cache"}


def _get(obj, key, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


class FuselensServer(LanguageServer):
    def __init__(self):
        super().__init__("fuselens", __version__, max_workers=2)
        self.settings = Settings()
        self.trusted = False
        self.results: dict[str, Result] = {}
        self.good: dict[str, Result] = {}       # the last result without a syntax error, per uri
        self.caches: dict[str, IncrementalAnalyzer] = {}  # per uri: per-function analysis results
        self.sites = CompileSites()  # which classes of which files the workspace compiles
        # uri -> the breaks a Compile & benchmark run met in that file, as diagnostics; dropped
        # when the file changes (an edit, or a new modification time on disk)
        self.seen: dict[str, dict] = {}
        self.pending: dict[str, asyncio.Task] = {}
        self.runs: dict[tuple[str, str], dict] = {}       # (uri, qualname) -> worker result / error
        self.running: dict[tuple[str, str], asyncio.Event] = {}
        self.analysis_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-analysis")
        self.fix_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-fixes")
        self.fix_cache: dict[tuple, list] = {}
        self.last_latency_ms: float | None = None
        self.frozen = False
        self.started: float | None = None  # perf_counter() at the process' start, until the first publish

    # ------------------------------------------------------------ analysis

    def filename(self, uri: str) -> str:
        return to_fs_path(uri) or uri

    def schedule(self, uri: str, delay: float) -> None:
        old = self.pending.get(uri)
        if old is not None and not old.done():
            old.cancel()
        self.pending[uri] = asyncio.ensure_future(self._analyze_later(uri, delay, time.perf_counter()))

    async def _analyze_later(self, uri: str, delay: float, t_edit: float) -> Result | None:
        if delay:
            await asyncio.sleep(delay)
        doc = self.workspace.get_text_document(uri)
        version, text = doc.version, doc.source
        loop = asyncio.get_running_loop()
        affected: set[str] = set()
        try:
            cache = self.caches.setdefault(uri, IncrementalAnalyzer())
            res, affected = await loop.run_in_executor(self.analysis_pool, self._analyze_document, text, uri,
                                                       version, cache)
        except Exception as e:
            log.exception("analysis failed")
            self.window_log_message(lsp.LogMessageParams(
                type=lsp.MessageType.Error,
                message=f"fuselens: analysis of {uri} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            res = Result(version, [], [], None, False, text)
        if not self.frozen:
            # torch, the compiler and the first file's analysis are long-lived: out of the
            # collector's reach, a full collection no longer walks them (~100 ms per keystroke
            # that triggers one, on a 3,000-line file)
            gc.freeze()
            atexit.register(gc.unfreeze)  # collectable again at exit (nanobind reports leaks otherwise)
            self.frozen = True
        current = self.workspace.text_documents.get(uri)
        if current is None or current.version != version:
            return None  # stale: a newer edit has its own analysis scheduled
        if res.syntax_error is None:
            self.good[uri] = res
        elif uri in self.good:
            res = res.with_last_good(self.good[uri])
        self.results[uri] = res
        self.publish(uri)
        self.last_latency_ms = (time.perf_counter() - t_edit) * 1000
        if self.started is not None:  # where start-up time goes (the log tells a slow start)
            self.window_log_message(lsp.LogMessageParams(type=lsp.MessageType.Info, message=(
                f"fuselens: first diagnostics {time.perf_counter() - self.started:.2f} s after the server started "
                f"({self.last_latency_ms / 1000:.2f} s after its file opened; CPU {time.process_time():.2f} s)")))
            self.started = None
        self.protocol.notify(NOTIFY_CHANGED, {"uri": uri})
        self.reanalyze_files(affected - {os.path.realpath(self.filename(uri))})
        return res

    def _analyze_document(self, text: str, uri: str, version, cache) -> tuple[Result, set[str]]:
        """In the analysis thread: the workspace's compile sites brought up to date with this
        text, then the file analysed with the classes other files compile. Also returns the
        files whose compiled classes this text changed."""
        path = self.filename(uri)
        affected = self.sites.scan(self.workspace_roots(), SKIP_DIRS)
        affected |= self.sites.update(path, text)
        res = analyze(text, uri, path, version, self.settings, cache, self.sites.compiled_in(path))
        return res, affected

    def reanalyze_files(self, paths: set[str]) -> None:
        """Re-analyses the open documents of `paths` (another file now compiles their classes, or
        no longer does)."""
        if not paths:
            return
        for u in list(self.workspace.text_documents):
            if os.path.realpath(self.filename(u)) in paths and (u in self.results or u in self.pending):
                self.schedule(u, 0)

    def publish(self, uri: str) -> None:
        """The analysis' diagnostics and the breaks seen at run time (which win where both are)."""
        res = self.results.get(uri)
        seen = self.seen.get(uri)
        if seen is not None and not _unchanged(seen, self.workspace.text_documents.get(uri)):
            self.seen.pop(uri)
            seen = None
        diags = list(seen["diagnostics"]) if seen else []
        have = {_diag_key(d) for d in diags}
        ran = seen.get("ran", {}) if seen else {}
        for d in (res.diagnostics if res else []):
            if _diag_key(d) in have:
                continue
            q = (d.data or {}).get("qualname")
            if q in ran:  # a run of `q` on this text did not break here: a hint, out of Problems
                d = lsp.Diagnostic(range=d.range, severity=lsp.DiagnosticSeverity.Hint, code=d.code,
                                   code_description=d.code_description, source=d.source,
                                   related_information=d.related_information, data={**d.data, "notSeenAtRunTime": True},
                                   message=d.message + f"\n(not seen when Compile & benchmark ran '{q}' on its "
                                                       "example inputs: another input may still break here)")
            diags.append(d)
        diags.sort(key=lambda d: (d.range.start.line, d.range.start.character))
        self.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(
            uri=uri, version=res.version if res else None, diagnostics=diags))

    def record_run_breaks(self, qualname: str, breaks: list[dict], run_uri: str, result: dict) -> None:
        """Publishes the breaks a run's concrete capture found, on every workspace file they occur
        in: at the break, and at each call on the way to it that is in another workspace file.
        In the run's own file, the run replaces the analysis' guesses about `qualname` (its
        counts, and its diagnostics the run did not meet) until the file changes."""
        from .seen import seen_diagnostics
        roots = [os.path.realpath(r) for r in self.workspace_roots()]
        docs = {os.path.realpath(self.filename(u)): d for u, d in self.workspace.text_documents.items()}
        found = seen_diagnostics(qualname, breaks, roots, docs)
        run_path = os.path.realpath(self.filename(run_uri))
        if run_path not in found:
            doc = self.workspace.text_documents.get(run_uri)
            found[run_path] = ([], doc, _mtime(run_path))
        for path, (diags, doc, mtime) in found.items():
            uri = doc.uri if doc is not None else _path_uri(path)
            entry = {"diagnostics": diags, "version": doc.version if doc is not None else None,
                     "path": path, "mtime": mtime, "ran": {}}
            old = self.seen.get(uri)
            if old is not None and _unchanged(old, doc):  # other functions' runs on this text stay
                entry["diagnostics"] = [d for d in old["diagnostics"] if (d.data or {}).get("qualname") != qualname] + diags
                entry["ran"] = {q: r for q, r in old.get("ran", {}).items() if q != qualname}
            if path == run_path:
                entry["ran"][qualname] = {"graphCount": result.get("graphCount"),
                                          "breaks": [b for b in breaks if b.get("filename") and
                                                     os.path.realpath(b["filename"]) == run_path]}
            self.seen[uri] = entry
            if entry["diagnostics"] or old is not None or uri in self.results:  # (else nothing to show, nor to clear)
                self.publish(uri)
        self.refresh_code_lenses()

    def refresh_code_lenses(self) -> None:
        """Asks the client for the code lenses again (their counts are the run's now)."""
        caps = self.client_capabilities
        ws = caps.workspace if caps else None
        if ws and ws.code_lens and ws.code_lens.refresh_support:
            self.workspace_code_lens_refresh(None)

    def run_counts(self, uri: str, qualname: str) -> dict | None:
        """{graphCount, breaks} of the run of `qualname` on this text of the document, if any."""
        seen = self.seen.get(uri)
        if seen is None or not _unchanged(seen, self.workspace.text_documents.get(uri)):
            return None
        return seen.get("ran", {}).get(qualname)

    async def current(self, uri: str) -> Result | None:
        """The analysis of the document's current version, waiting for a pending one."""
        task = self.pending.get(uri)
        if task is not None and not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                pass
            task = self.pending.get(uri)
            if task is not None and not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except (asyncio.CancelledError, asyncio.TimeoutError):
                    pass
        res = self.results.get(uri)
        doc = self.workspace.text_documents.get(uri)
        if res is None or doc is None or res.version != doc.version:
            return None
        return res

    def reanalyze_all(self) -> None:
        for uri in list(self.workspace.text_documents):
            if uri in self.results or uri in self.pending:
                self.schedule(uri, 0)

    # ------------------------------------------------------------ benchmark runs

    def workspace_roots(self) -> list[str]:
        roots = []
        for f in (self.workspace.folders or {}).values():
            p = to_fs_path(f.uri)
            if p:
                roots.append(p)
        if not roots and self.workspace.root_path:
            roots.append(self.workspace.root_path)
        return roots

    def find_tests(self, name: str, limit_files: int = 2000) -> list[tuple[str, list[str]]]:
        """Test files in the workspace with test functions that mention `name(` (read, not run)."""
        pat = re.compile(r"\b" + re.escape(name) + r"\s*\(")
        out, seen = [], 0
        for root in self.workspace_roots():
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
                for fn in filenames:
                    if not (fn.endswith(".py") and (fn.startswith("test_") or fn.endswith("_test.py"))):
                        continue
                    seen += 1
                    if seen > limit_files:
                        return out
                    path = os.path.join(dirpath, fn)
                    try:
                        text = open(path, encoding="utf-8").read()
                    except OSError:
                        continue
                    if not pat.search(text):
                        continue
                    tests = []
                    for m in re.finditer(r"^def (test\w*)\s*\(\s*\)\s*(?:->[^:]*)?:(.*?)(?=^\S|\Z)", text, re.M | re.S):
                        if pat.search(m.group(2)):
                            tests.append(m.group(1))
                    if tests:
                        out.append((path, tests))
        return out


server = FuselensServer()


# ---------------------------------------------------------------- lifecycle

@server.feature(lsp.INITIALIZE)
def on_initialize(ls: FuselensServer, params: lsp.InitializeParams):
    # pygls made its workspace just before this handler; no document is open yet
    ls.protocol._workspace = LspLinesWorkspace.like(ls.workspace)
    opts = params.initialization_options or {}
    ls.settings = Settings.from_dict(_get(opts, "settings"))
    ls.trusted = bool(_get(opts, "trusted", False))
    # the last runs of a window before it reloaded (the client keeps them, `stale` where their
    # file changed since): the panel, kernels and transformed code show them again
    for run in _get(opts, "runs") or []:
        if isinstance(run, dict) and isinstance(run.get("uri"), str) and isinstance(run.get("qualname"), str) \
                and run.get("status"):
            ls.runs[(run["uri"], run["qualname"])] = {**run, "restored": True, "stale": bool(run.get("stale"))}


@server.feature(lsp.INITIALIZED)
def on_initialized(ls: FuselensServer, params: lsp.InitializedParams):
    # `initialize` is answered without torch; import it now, in the analysis thread, so that it
    # is (mostly) there when the first file opens
    ls.analysis_pool.submit(_warm_up)
    try:
        CLIENT_LOG.loop = asyncio.get_running_loop()
    except RuntimeError:  # not on the loop's thread: warnings stay on stderr
        pass
    # a restored run on an unchanged file: its graphs and breaks are the "as run" ones again (in
    # the lens, the panel and Problems), held for its text on disk (see did_open)
    for (uri, qualname), run in list(ls.runs.items()):
        if run.get("restored") and not run["stale"] and run["status"] == "ok" and run.get("result") \
                and os.path.isfile(ls.filename(uri)):
            ls.record_run_breaks(qualname, run["result"].get("breaks", []), uri, run["result"])


def _warm_up():
    try:
        import fuselens.capture.analyze  # noqa: F401  (torch, the compiler)
    except Exception:  # reported by the first analysis, with its file
        log.debug("warm-up import failed", exc_info=True)


@server.feature(NOTIFY_TRUST)
def on_set_trusted(ls: FuselensServer, params):
    ls.trusted = bool(_get(params, "trusted", False))


@server.feature(lsp.WORKSPACE_DID_CHANGE_CONFIGURATION)
def on_config(ls: FuselensServer, params: lsp.DidChangeConfigurationParams):
    settings = params.settings
    fl = _get(settings, "fuselens", settings)
    if fl:
        ls.settings = Settings.from_dict(fl if isinstance(fl, dict) else None)
        ls.reanalyze_all()


# ---------------------------------------------------------------- documents

@server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: FuselensServer, params: lsp.DidOpenTextDocumentParams):
    uri = params.text_document.uri
    seen = ls.seen.get(uri)
    if seen is not None and seen["version"] is None:
        # what a run saw in the file while closed (or before a window reload) holds for this
        # open text if it is the text on disk (an editor restored with unsaved edits is not)
        if _unchanged(seen, None) and _disk_text(seen["path"]) == params.text_document.text:
            seen["version"] = params.text_document.version
        else:
            ls.seen.pop(uri)
    if params.text_document.language_id in ("python", "") or uri.endswith(".py"):
        ls.schedule(params.text_document.uri, 0)


@server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: FuselensServer, params: lsp.DidChangeTextDocumentParams):
    uri = params.text_document.uri
    if ls.seen.pop(uri, None) is not None and uri not in ls.results:
        ls.publish(uri)
    if uri in ls.results or uri in ls.pending:
        ls.schedule(uri, DEBOUNCE_S)


@server.feature(lsp.TEXT_DOCUMENT_DID_SAVE)
def did_save(ls: FuselensServer, params: lsp.DidSaveTextDocumentParams):
    # the analysis of one file may read another's source (a callee in the workspace, a class
    # compiled in another file): the other files' cached results and compile sites may no
    # longer hold
    for uri in list(ls.caches):
        if uri != params.text_document.uri:
            ls.caches.pop(uri)
    ls.sites.invalidate()


@server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: FuselensServer, params: lsp.DidCloseTextDocumentParams):
    uri = params.text_document.uri
    task = ls.pending.pop(uri, None)
    if task is not None:
        task.cancel()
    ls.results.pop(uri, None)
    ls.good.pop(uri, None)
    ls.caches.pop(uri, None)
    ls.publish(uri)  # what a run saw stays (Problems lists closed files too)
    ls.protocol.notify(NOTIFY_CHANGED, {"uri": uri})
    # its compile sites are its text on disk again (an unsaved edit is gone)
    asyncio.ensure_future(_reread_sites(ls, ls.filename(uri)))


async def _reread_sites(ls: FuselensServer, path: str) -> None:
    loop = asyncio.get_running_loop()
    ls.reanalyze_files(await loop.run_in_executor(ls.analysis_pool, ls.sites.reread, path))


# ---------------------------------------------------------------- code lens

def _diag_key(d: lsp.Diagnostic) -> tuple:
    return (d.code, d.range.start.line, d.range.start.character, d.range.end.line, d.range.end.character)


def _unchanged(seen: dict, doc) -> bool:
    if seen["version"] is not None:  # open when the run ended: any edit since drops it
        return doc is not None and doc.version == seen["version"]
    return _mtime(seen["path"]) == seen["mtime"]  # closed when the run ended: its file on disk


def _disk_text(path) -> str | None:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeError):
        return None


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _path_uri(path: str) -> str:
    from pygls.uris import from_fs_path
    return from_fs_path(path) or path


def _plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


@server.feature(lsp.TEXT_DOCUMENT_CODE_LENS)
async def code_lens(ls: FuselensServer, params: lsp.CodeLensParams):
    uri = params.text_document.uri
    res = await ls.current(uri)
    if res is None:
        return []
    codec, old = PositionCodec(res.source), PositionCodec(res.stale_source)
    lenses = []
    for f in res.functions:
        if f.quiet:
            continue
        stale = f.qualname in res.stale
        rng = (old if stale else codec).range(f.line, f.col, f.line, f.col)
        kind = "compiled" if f.compiled else "not compiled"
        ran = None if stale else ls.run_counts(uri, f.qualname)
        if ran is not None:
            title = f"fuselens: {_plural(ran['graphCount'], 'graph')}, {_plural(len(ran['breaks']), 'graph break')} (as run)"
        else:
            title = f"fuselens: {_plural(f.graph_count, 'graph')}, {_plural(len(f.breaks), 'graph break')} ({kind})"
        if stale:
            lines = len(codec.lines)
            if rng.start.line >= lines:
                continue
            title += f" · stale: line {res.syntax_error[0]} has a syntax error"
        run = ls.runs.get((uri, f.qualname))
        if run is not None and run.get("status") == "ok" and (run.get("result") or {}).get("speedup"):
            title += f" · {run['result']['speedup']:.2f}× vs eager"
        lenses.append(lsp.CodeLens(range=rng, command=lsp.Command(
            title=title, command="fuselens.revealFunction", arguments=[uri, f.qualname])))
        lenses.append(lsp.CodeLens(range=rng, command=lsp.Command(
            title="Compile & benchmark", command="fuselens.compileAndBenchmark", arguments=[uri, f.qualname])))
    return lenses


# ---------------------------------------------------------------- code actions

def _overlaps(a: lsp.Range, b: lsp.Range) -> bool:
    return not ((a.end.line, a.end.character) < (b.start.line, b.start.character)
                or (b.end.line, b.end.character) < (a.start.line, a.start.character))


@server.feature(lsp.TEXT_DOCUMENT_CODE_ACTION,
                lsp.CodeActionOptions(code_action_kinds=[lsp.CodeActionKind.QuickFix], resolve_provider=False))
async def code_action(ls: FuselensServer, params: lsp.CodeActionParams):
    uri = params.text_document.uri
    res = await ls.current(uri)
    if res is None:
        return []
    only = params.context.only
    if only and not any(k == lsp.CodeActionKind.QuickFix or str(k).startswith("quickfix") for k in only):
        return []
    # the diagnostics we published that overlap the range (the client sends them in context;
    # we use our own, which are current)
    # a stale diagnostic's fixes would be computed on a text that is gone
    targets = [d for d in res.diagnostics if _overlaps(d.range, params.range) and not (d.data or {}).get("stale")]
    if not targets:
        return []
    from .fixes import fixes_for_break, minimal_edit  # libcst: imported on first use, not at start
    filename = ls.filename(uri)
    doc = ls.workspace.get_text_document(uri)
    before = None
    if res.raw is not None and res.syntax_error is None:
        before = {f.qualname: len(f.breaks) for f in res.raw.functions}
    actions = []
    loop = asyncio.get_running_loop()
    for d in targets:
        data = d.data or {}
        qualname = _get(data, "qualname")
        brk = next((b for f in res.functions if f.qualname == qualname for b in f.breaks
                    if b.code == d.code and _same_start(b, d, res)), None)
        if brk is None:
            continue
        bj = break_json(brk)
        key = (uri, res.version, d.code, bj["line"], bj["col"], bj["endLine"], bj["endCol"])
        fixes = ls.fix_cache.get(key)
        if fixes is None:
            if res.repaired:
                before_counts = None  # the file does not parse: only the suppression is offered
                fixes = await loop.run_in_executor(ls.fix_pool, _suppression_only, res.source, filename, bj, qualname)
            else:
                before_counts = before
                fixes = await loop.run_in_executor(ls.fix_pool, fixes_for_break, res.source, filename, bj,
                                                   qualname, before_counts)
            if len(ls.fix_cache) > 256:
                ls.fix_cache.clear()
            ls.fix_cache[key] = fixes
        if doc.version != res.version:
            return []
        for fx in fixes:
            if fx.new_source is not None:
                a, b, text = minimal_edit(res.source, fx.new_source)
                edit = lsp.TextEdit(range=lsp.Range(start=lsp.Position(line=a, character=0),
                                                    end=lsp.Position(line=b, character=0)), new_text=text)
                title = f"{fx.title} ({fx.breaks_before} → {fx.breaks_after} breaks in `{qualname}`)"
            else:
                l0, c0, l1, c1, text = fx.edit
                codec = PositionCodec(res.source)
                s = codec.to_lsp(l0 + 1, len(codec.lines[l0][:c0].encode()))
                e = codec.to_lsp(l1 + 1, len(codec.lines[l1][:c1].encode()))
                edit = lsp.TextEdit(range=lsp.Range(start=s, end=e), new_text=text)
                title = fx.title
            actions.append(lsp.CodeAction(
                title=plain_text(title), kind=lsp.CodeActionKind.QuickFix, diagnostics=[d],
                is_preferred=fx.preferred,
                edit=lsp.WorkspaceEdit(document_changes=[lsp.TextDocumentEdit(
                    text_document=lsp.OptionalVersionedTextDocumentIdentifier(uri=uri, version=res.version),
                    edits=[edit])])))
    return actions


def _suppression_only(source, filename, bj, qualname):
    from .fixes import Fix, NoFix, suppression_edit
    try:
        edit = suppression_edit(split_lines(source), bj["line"] + 1, bj["code"])
    except NoFix:
        return []
    return [Fix(f"fuselens: Suppress {bj['code']} on this line (`# fuselens: ignore[{bj['code']}]`)",
                bj["code"], None, False, edit=edit)]


def _same_start(b, d: lsp.Diagnostic, res: Result) -> bool:
    codec = PositionCodec(res.source)
    p = codec.to_lsp(b.line, b.col)
    return (p.line, p.character) == (d.range.start.line, d.range.start.character)


# ---------------------------------------------------------------- compile & benchmark

def _function_for(res: Result, target):
    if isinstance(target, str):
        return next((f for f in res.functions if f.qualname == target), None)
    line = _get(target, "line")
    if line is None:
        return None
    return function_at(res.functions, int(line))


@server.command(CMD_COMPILE)
async def compile_and_benchmark(ls: FuselensServer, *args):
    """Arguments: uri, then a qualname or a position {line, character} (0-based), then options:
    {runMain: true} when the user picked running the file's `__main__` block to find inputs (it
    runs their script, so it is never done unasked); {progressToken: t} to report progress on
    the client's token t (cancelled by window/workDoneProgress/cancel on it)."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = tuple(args[0])
    if len(args) < 2:
        return {"ok": False, "error": "Compile & benchmark needs a file and a function."}
    uri, target = args[0], args[1]
    run_main = bool(len(args) > 2 and isinstance(args[2], dict) and args[2].get("runMain"))
    if not ls.trusted:
        msg = ("Compile & benchmark runs your code, so it needs a trusted workspace. "
               "Diagnostics and fixes work in restricted mode.")
        ls.window_show_message(lsp.ShowMessageParams(type=lsp.MessageType.Warning, message=msg))
        return {"ok": False, "error": msg, "status": "untrusted"}
    if uri not in ls.workspace.text_documents:
        return {"ok": False, "error": f"{uri} is not open."}
    res = await ls.current(uri)
    if res is None:
        return {"ok": False, "error": "The file is still being analysed; try again."}
    fn = _function_for(res, target)
    if fn is None:
        msg = ("No analysed function here: put the cursor inside a function that uses torch."
               if not isinstance(target, str) else f"No function `{target}` that uses torch in this file.")
        ls.window_show_message(lsp.ShowMessageParams(type=lsp.MessageType.Warning, message=msg))
        return {"ok": False, "error": msg}
    if fn.qualname in res.stale:
        msg = f"`{fn.qualname}` does not parse now (line {res.syntax_error[0]}: {res.syntax_error[2]})."
        ls.window_show_message(lsp.ShowMessageParams(type=lsp.MessageType.Warning, message=msg))
        return {"ok": False, "error": msg}
    key = (uri, fn.qualname)
    if key in ls.running:
        return {"ok": False, "error": f"`{fn.qualname}` is already being compiled."}
    path = ls.filename(uri)
    discovery = ["main"] if run_main else [w for w in ls.settings.discovery if w != "main"]
    # the file's `__main__` block could give inputs, but running it runs the user's script: asked
    main_offered = not run_main and "main" in ls.settings.discovery and MAIN_BLOCK_RE.search(res.source) is not None
    job = {"path": path, "source": res.source, "qualname": fn.qualname, "def_line": fn.line,
           "discovery": discovery, "roots": ls.workspace_roots(),
           "tests": ls.find_tests(fn.name) if "pytest" in discovery else []}
    cancel = asyncio.Event()
    ls.running[key] = cancel
    # a token of the client's (its own progress notification, with a Cancel button from the
    # start) or one the server creates (VS Code shows that in the status bar only)
    given = args[2].get("progressToken") if len(args) > 2 and isinstance(args[2], dict) else None
    token = given if isinstance(given, (str, int)) and not isinstance(given, bool) else str(uuid.uuid4())
    progress_ok = token is given
    loop = asyncio.get_running_loop()
    caps = ls.client_capabilities
    if not progress_ok and caps and caps.window and caps.window.work_done_progress:
        try:
            await asyncio.wait_for(ls.work_done_progress.create_async(token), 5)
            progress_ok = True
        except Exception:
            progress_ok = False
    if progress_ok:
        ls.work_done_progress.begin(token, lsp.WorkDoneProgressBegin(
            title=f"fuselens: Compile & benchmark `{fn.qualname}`", cancellable=True,
            message="starting the worker", percentage=0))
        # window/workDoneProgress/cancel cancels the token's future (begin registers a given one)
        fut = ls.work_done_progress.tokens.get(token)
        if fut is not None:
            fut.add_done_callback(lambda f: loop.call_soon_threadsafe(cancel.set) if f.cancelled() else None)

    def on_progress(message, percentage):
        if progress_ok:
            ls.work_done_progress.report(token, lsp.WorkDoneProgressReport(message=message, percentage=percentage))

    ls.protocol.notify(NOTIFY_CHANGED, {"uri": uri})
    try:
        outcome = await run_worker(job, time_limit=ls.settings.time_limit_s, cancel=cancel,
                                   on_progress=on_progress, cwd=(ls.workspace_roots() or [os.path.dirname(path)])[0])
    except asyncio.CancelledError:
        cancel.set()
        raise
    finally:
        ls.running.pop(key, None)
        if progress_ok:
            ls.work_done_progress.end(token, lsp.WorkDoneProgressEnd(message="done"))
            ls.work_done_progress.tokens.pop(token, None)
    summary = {"ok": outcome.status == "ok", "status": outcome.status, "qualname": fn.qualname,
               "uri": uri, "message": outcome.message, "stderr": outcome.stderr_tail[-4000:]}
    if outcome.result is not None:
        summary["result"] = outcome.result
    if outcome.status == "ok":
        ls.record_run_breaks(fn.qualname, outcome.result["breaks"], uri, outcome.result)
    if outcome.status == "ok":
        summary["message"] = _summary_message(fn.qualname, outcome.result)
        ls.runs[key] = summary
        ls.window_show_message(lsp.ShowMessageParams(type=lsp.MessageType.Info, message=summary["message"]))
    elif main_offered and (outcome.result or {}).get("noInputs"):
        # the client asks whether to run the `__main__` block (fuselens.compileAndBenchmark)
        summary["canRunMain"] = True
        summary["message"] += ("\nThe file's `if __name__ == \"__main__\":` block was not run: running it "
                               "runs your script (its training steps, prints and writes).")
        ls.runs[key] = summary
    else:
        ls.runs[key] = summary
        prefix = f"fuselens: Compile & benchmark `{fn.qualname}`: "
        mtype = lsp.MessageType.Warning if outcome.status in ("cancelled",) or (outcome.result or {}).get("userError") \
            else lsp.MessageType.Error
        ls.window_show_message(lsp.ShowMessageParams(type=mtype, message=prefix + outcome.message))
        ls.window_log_message(lsp.LogMessageParams(type=lsp.MessageType.Log, message=prefix + outcome.message
                                                   + "\n" + outcome.stderr_tail[-4000:]))
    ls.protocol.notify(NOTIFY_CHANGED, {"uri": uri})
    return _jsonable(summary)


MAIN_BLOCK_RE = re.compile(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", re.M)


def _summary_message(qualname, r: dict) -> str:
    kernels = sum(len(g["kernels"]) for g in r.get("graphs", []))
    check = r.get("check", {})
    head = f"fuselens: `{qualname}`: {_plural(r.get('graphCount', len(r.get('graphs', []))), 'graph')}, " \
           f"{_plural(kernels, 'kernel')}; "
    if check.get("ok"):
        parts = [head + f"output {check.get('message', 'not checked')}"]
    elif check.get("randomOps"):  # not a compiler error: the message says why they differ
        parts = [head + f"output {check.get('message')}"]
    else:
        parts = [f"fuselens: `{qualname}`: OUTPUT DIFFERS FROM EAGER: {check.get('message')}"]
    t = r.get("timings") or {}
    if t.get("eager") and t.get("fuselens"):
        cpu = t.get("cpu")
        how = "C++ kernels" if t.get("cpuKernels") == "cpp" else "graphs as plain PyTorch"
        s = (f"CPU times: eager {t['eager']:.3f} ms, fuselens's {how} {t['fuselens']:.3f} ms"
             if cpu else f"eager {t['eager']:.3f} ms, fuselens {t['fuselens']:.3f} ms")
        s += f" ({t['eager'] / t['fuselens']:.2f}×)"
        if t.get("torchCompile"):
            s += f", torch.compile{' (CPU)' if cpu else ''} {t['torchCompile']:.3f} ms ({t['eager'] / t['torchCompile']:.2f}×)"
        elif t.get("torchCompileError"):
            s += f", torch.compile failed ({t['torchCompileError']})"
        parts.append(s)
    if r.get("timingNote"):
        parts.append(r["timingNote"])
    if r.get("recompiles"):
        parts.append(f"recompiled {len(r['recompiles'])}× during the run (guard {r['recompiles'][-1]['because']} failed)"
                     + ("; " + r["recompileLimit"] if r.get("recompileLimit") else ""))
    parts.append(f"inputs: {r.get('inputs')}")
    return ". ".join(p.rstrip(". ") for p in parts)


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


# ---------------------------------------------------------------- side panel requests

def _run_view(run: dict | None) -> dict | None:
    if run is None:
        return None
    r = run.get("result") or {}
    graphs = []
    for g in r.get("graphs", []):
        graphs.append({"index": g["index"], "nodeCount": g.get("nodeCount"),
                       "kernels": [{"name": k["name"], "timeMs": k.get("timeMs"), "share": k.get("share"),
                                    "bandwidthGBs": k.get("bandwidthGBs"), "lines": len(k["source"].split("\n")),
                                    "language": k.get("language", "triton")}
                                   for k in g["kernels"]]})
    return {"status": run["status"], "message": run["message"], "graphs": graphs,
            "timings": r.get("timings"), "speedup": r.get("speedup"), "timingNote": r.get("timingNote"),
            "check": r.get("check"), "inputs": r.get("inputs"), "device": r.get("device"), "gpu": r.get("gpu"),
            "recompiles": r.get("recompiles") or [], "recompileLimit": r.get("recompileLimit"),
            "hasTransformedSource": bool(r.get("transformedSource")), "restored": bool(run.get("restored")),
            "stale": bool(run.get("stale"))}


def _break_path_functions(ls: FuselensServer) -> set[tuple[str, str]]:
    """(file, qualname) of every function a compiled function's break lies in or is reached
    through: the callees with breaks, which the side panel lists with the compiled functions."""
    out = set()
    for res in list(ls.results.values()):
        for f in res.functions:
            if not f.compiled:
                continue
            for b in f.breaks:
                if b.filename and b.function:
                    out.add((os.path.realpath(b.filename), b.function))
                out.update((os.path.realpath(fr.filename), fr.function) for fr in b.stack if fr.filename)
    return out


@server.feature(REQ_FUNCTIONS)
async def req_functions(ls: FuselensServer, params):
    """{uri?} → {documents: [{uri, functions: [... + run, running, relevant]}]}; `relevant`: compiled,
    run, or a callee a compiled function's break lies in (the side panel lists the rest apart)."""
    want = _get(params, "uri")
    on_path = _break_path_functions(ls)
    docs = []
    for uri in list(ls.workspace.text_documents):
        if want and uri != want:
            continue
        res = ls.results.get(uri)
        if res is None:
            continue
        path = os.path.realpath(ls.filename(uri))
        fns = []
        for f in res.functions:
            j = f.to_json(stale=f.qualname in res.stale)
            j["run"] = _run_view(ls.runs.get((uri, f.qualname)))
            ran = None if j["stale"] else ls.run_counts(uri, f.qualname)
            if ran is not None:  # the run's graphs and breaks, not the analysis' guess
                j.update(graphCount=ran["graphCount"], breakCount=len(ran["breaks"]), asRun=True,
                         breaks=[{k: b[k] for k in ("code", "title", "line", "col", "endLine", "endCol", "explanation",
                                                    "hint", "docUrl", "torchCode", "function")} for b in ran["breaks"]])
            j["running"] = (uri, f.qualname) in ls.running
            j["relevant"] = bool(f.compiled or j["run"] or j["running"] or (path, f.qualname) in on_path)
            fns.append(j)
        # what matters first: compiled (and run) functions, then callees with breaks, then the rest
        fns.sort(key=lambda j: (not j["relevant"], not j["compiled"], j["line"]))
        docs.append({"uri": uri, "version": res.version,
                     "syntaxError": list(res.syntax_error) if res.syntax_error else None,
                     "repaired": res.repaired, "stale": res.stale, "functions": fns})
    docs.sort(key=lambda d: not any(f["relevant"] for f in d["functions"]))
    return {"documents": docs, "trusted": ls.trusted}


def _run_result(ls, params):
    uri, qualname = _get(params, "uri"), _get(params, "qualname")
    run = ls.runs.get((uri, qualname))
    if run is None or run.get("result") is None:
        return None
    return run["result"]


@server.feature(REQ_KERNEL)
def req_kernel(ls: FuselensServer, params):
    """{uri, qualname, graph, kernel (name or index)} → {name, source, provenance, ...}"""
    r = _run_result(ls, params)
    if r is None:
        return None
    gi, kid = _get(params, "graph", 0), _get(params, "kernel")
    graphs = r.get("graphs", [])
    if not (0 <= int(gi) < len(graphs)):
        return None
    for i, k in enumerate(graphs[int(gi)]["kernels"]):
        if k["name"] == kid or i == kid:
            return _jsonable({**k, "uri": _get(params, "uri"), "qualname": _get(params, "qualname"), "graph": gi})
    return None


@server.feature(REQ_GRAPH)
def req_graph(ls: FuselensServer, params):
    r = _run_result(ls, params)
    if r is None:
        return None
    gi = int(_get(params, "graph", 0))
    graphs = r.get("graphs", [])
    if not (0 <= gi < len(graphs)):
        return None
    return {"ir": graphs[gi].get("ir", ""), "wrapper": graphs[gi].get("wrapper")}


@server.feature(REQ_TRANSFORMED)
def req_transformed(ls: FuselensServer, params):
    r = _run_result(ls, params)
    if r is None:
        return None
    from .transformed_view import explained
    return {"source": explained(r.get("transformedSource", ""), _get(params, "qualname")),
            "explanation": r.get("explanation", "")}


class _ClientLog(logging.Handler):
    """Log records (and Python warnings, e.g. torch's UserWarnings) go to the client's log at
    their own level: on stderr the client logs every line as an error."""

    loop = None  # the server's event loop, once the client is initialized (stderr until then)

    def emit(self, record):
        if self.loop is None:
            sys.stderr.write(self.format(record) + "\n")
            return
        mtype = lsp.MessageType.Error if record.levelno >= logging.ERROR else lsp.MessageType.Warning
        params = lsp.LogMessageParams(type=mtype, message=self.format(record))
        try:
            self.loop.call_soon_threadsafe(server.window_log_message, params)
        except RuntimeError:  # the loop has stopped: the server is exiting
            pass


CLIENT_LOG = _ClientLog(logging.WARNING)


def start(stdin=None, stdout=None, started: float | None = None) -> None:
    server.started = started
    CLIENT_LOG.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[CLIENT_LOG])
    logging.captureWarnings(True)
    server.start_io(stdin, stdout)
