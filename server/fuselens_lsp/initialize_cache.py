"""`initialize` answered before pygls is imported.

Importing pygls takes most of the 0.3-0.4 s before a server can answer (lsprotocol.types alone
makes ~550 classes). pygls's answer depends only on the server's code, pygls's version and the
client's capabilities (position encodings), so it is kept on disk under a key of those: a later
start with the same client answers from it at once, then hands the `initialize` request to pygls
as well (its handler sets the server's state) and drops pygls's second answer. The first start
with a client or after a change of the server answers through pygls and keeps its answer.
Nothing here imports more than a few modules of the standard library."""
from __future__ import annotations

import hashlib
import json
import os
import re
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

_LENGTH = re.compile(rb"Content-Length: (\d+)\r\n")


def answer_from_cache(stdin, stdout):
    """(stdin, stdout) for pygls: stdin with the first message read here put back in front,
    stdout that drops pygls's answer to an `initialize` answered here (or keeps it for later
    starts where it was not)."""
    raw, message = _read_message(stdin)
    replayed = _Replayed(raw, stdin)
    if not isinstance(message, dict) or message.get("method") != "initialize" or "id" not in message:
        return replayed, stdout
    path = _cache_path(message.get("params") or {})
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        result = None
    if result is not None:
        _write(stdout, {"jsonrpc": "2.0", "id": message["id"], "result": result})
    return replayed, _InitializeAnswer(stdout, message["id"], path, answered=result is not None)


def _read_message(stream):
    """(its bytes, the decoded message or None) of the next LSP message on `stream`."""
    raw, length = b"", None
    while True:
        line = stream.readline()
        raw += line
        if not line:
            return raw, None
        if line == b"\r\n":
            break
        m = _LENGTH.fullmatch(line)
        if m:
            length = int(m.group(1))
    if length is None:
        return raw, None
    body = stream.read(length)
    raw += body
    try:
        return raw, json.loads(body)
    except ValueError:
        return raw, None


def _write(stdout, message) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    stdout.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    stdout.flush()


def _cache_path(params) -> Path:
    root = Path(_compiler_settings().cache_dir(create=False))
    key = json.dumps({"client": params.get("capabilities"), "server": _code_stamp()}, sort_keys=True)
    return root / "lsp" / f"initialize-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _compiler_settings():
    """The compiler's fuselens/settings.py (the cache directory's rule), run on its own: importing
    it as fuselens.settings would run fuselens/__init__.py first, which imports torch."""
    package = find_spec("fuselens")  # (__main__ checked that there is one)
    spec = spec_from_file_location("fuselens_settings", Path(package.submodule_search_locations[0]) / "settings.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_stamp() -> list:
    """What pygls's answer is made from, besides the client: this package's files and the
    installed pygls and lsprotocol (their dist-info names carry the versions)."""
    here = Path(__file__).parent
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(here.glob("*.py"))]
    for name in ("pygls", "lsprotocol"):
        spec = find_spec(name)
        where = Path(spec.origin).parent if spec and spec.origin else None
        stamp.append((name, str(where), sorted(p.name for p in where.parent.glob(f"{name}-*.dist-info"))
                      if where else []))
    return stamp


class _Replayed:
    """`stream` with `prefix` (whole lines: complete messages) read first."""

    def __init__(self, prefix: bytes, stream):
        self.prefix, self.stream = prefix, stream

    def readline(self, *args):
        if self.prefix:
            end = self.prefix.find(b"\n") + 1 or len(self.prefix)
            line, self.prefix = self.prefix[:end], self.prefix[end:]
            return line
        return self.stream.readline(*args)

    def read(self, n=-1):
        if self.prefix:
            part, self.prefix = self.prefix[:n], self.prefix[n:]
            return part + (self.stream.read(n - len(part)) if len(part) < n else b"")
        return self.stream.read(n)


class _InitializeAnswer:
    """stdout for pygls: its answer to `initialize` request `id` dropped where it was answered
    already, else passed on and kept at `path`."""

    def __init__(self, stdout, id, path: Path, answered: bool):
        self.stdout, self.id, self.path, self.answered = stdout, id, path, answered
        self.done = False

    def write(self, data: bytes) -> None:
        if not self.done:
            head, _, body = data.partition(b"\r\n\r\n")
            try:
                message = json.loads(body)
            except ValueError:
                message = None
            if isinstance(message, dict) and message.get("id") == self.id and "method" not in message:
                self.done = True
                if self.answered:
                    return
                if "result" in message:
                    self._keep(message["result"])
        self.stdout.write(data)
        self.stdout.flush()

    def _keep(self, result) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, self.path)  # whole or not at all: another server may read it now
        except OSError:
            pass  # a read-only home: every start answers through pygls

    def flush(self) -> None:
        self.stdout.flush()

    def close(self) -> None:
        self.stdout.close()
