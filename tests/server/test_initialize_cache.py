"""`initialize` answered from the answer pygls gave an earlier start (server/fuselens_lsp/
initialize_cache.py): the same answer, once, and the server goes on as after pygls's own."""
from __future__ import annotations

import json
import subprocess

from conftest import SERVER, SERVER_ENV

VS_CODE = {"general": {"positionEncodings": ["utf-16"]}, "textDocument": {"publishDiagnostics": {}}}
UTF8_FIRST = {"general": {"positionEncodings": ["utf-8", "utf-16"]}}


def _frame(message) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _session(cache_dir, capabilities) -> list[dict]:
    """Every message a server sends for initialize, initialized, shutdown, exit."""
    requests = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
                 "params": {"processId": None, "rootUri": None, "capabilities": capabilities,
                            "initializationOptions": {"trusted": False}}},
                {"jsonrpc": "2.0", "method": "initialized", "params": {}},
                {"jsonrpc": "2.0", "id": 2, "method": "shutdown"},
                {"jsonrpc": "2.0", "method": "exit"}]
    out = subprocess.run(SERVER, input=b"".join(map(_frame, requests)), capture_output=True, timeout=120,
                         env={**SERVER_ENV, "FUSELENS_CACHE_DIR": str(cache_dir)}).stdout
    messages = []
    while out:
        head, _, rest = out.partition(b"\r\n\r\n")
        n = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        messages.append(json.loads(rest[:n]))
        out = rest[n:]
    return [m for m in messages if "id" in m and "method" not in m]  # the answers


def test_a_later_start_answers_initialize_as_pygls_did(tmp_path):
    first = _session(tmp_path, VS_CODE)
    assert [m["id"] for m in first] == [1, 2]
    assert len(list((tmp_path / "lsp").glob("initialize-*.json"))) == 1
    second = _session(tmp_path, VS_CODE)
    assert second == first  # the same answer, once; shutdown answered after it


def test_another_client_gets_pygls_answer_for_it(tmp_path):
    """The client's capabilities are part of the key: a client offering UTF-8 positions is
    answered by pygls (which picks UTF-8), not with the UTF-16 answer kept for another client."""
    utf16 = _session(tmp_path, VS_CODE)[0]["result"]
    utf8 = _session(tmp_path, UTF8_FIRST)[0]["result"]
    assert utf16["capabilities"]["positionEncoding"] == "utf-16"
    assert utf8["capabilities"]["positionEncoding"] == "utf-8"
    assert _session(tmp_path, UTF8_FIRST)[0]["result"] == utf8
    assert len(list((tmp_path / "lsp").glob("initialize-*.json"))) == 2
