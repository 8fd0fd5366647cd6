"""End-to-end fixtures: a real `python -m fuselens_lsp` process driven by pytest-lsp."""
from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import pytest
import pytest_lsp
from lsprotocol import types as lsp
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

SERVER = [sys.executable, "-m", "fuselens_lsp"]
REPO = Path(__file__).resolve().parents[2]
# pytest-lsp gives the server exactly this environment: without PYTHONPATH it would import the
# fuselens_lsp and fuselens installed in the venv (another checkout's), not this one's
# (torch.compile's CPU compile in each Compile & benchmark would cost tens of seconds a test)
SERVER_ENV = {**os.environ, "FUSELENS_INTERPRET": "1", "TRITON_INTERPRET": "1", "FUSELENS_BENCH_TORCH_COMPILE": "0",
              "PYTHONPATH": os.pathsep.join([str(REPO / "server"), str(REPO / "compiler")])}


@pytest_lsp.fixture(config=ClientServerConfig(server_command=SERVER, server_env=SERVER_ENV))
async def client(lsp_client: LanguageClient):
    lsp_client.lens_refreshes = 0

    @lsp_client.feature(lsp.WORKSPACE_CODE_LENS_REFRESH)
    def _lens_refresh(params):  # the server asks after a run (its counts are the run's)
        lsp_client.lens_refreshes += 1

    yield lsp_client
    await lsp_client.shutdown_session()


class Session:
    def __init__(self, client: LanguageClient, root: Path):
        self.client = client
        self.root = root
        self.versions: dict[str, int] = {}

    async def init(self, *, trusted=True, settings=None, runs=None):
        await self.client.initialize_session(lsp.InitializeParams(
            capabilities=client_capabilities("visual-studio-code"),
            root_uri=self.root.as_uri(),
            workspace_folders=[lsp.WorkspaceFolder(uri=self.root.as_uri(), name="ws")],
            initialization_options={"trusted": trusted, "settings": settings or {}, "runs": runs or []}))
        return self

    def uri(self, name: str) -> str:
        return (self.root / name).as_uri()

    async def open(self, name: str, text: str, *, save=True) -> str:
        text = textwrap.dedent(text)
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if save:
            path.write_text(text)
        uri = path.as_uri()
        self.versions[uri] = 1
        self.client.diagnostics.pop(uri, None)
        self.client.text_document_did_open(lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
        await self.diagnostics(uri)
        return uri

    async def change(self, uri: str, text: str) -> None:
        self.versions[uri] += 1
        self.client.diagnostics.pop(uri, None)
        self.client.text_document_did_change(lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=self.versions[uri]),
            content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=textwrap.dedent(text))]))
        await self.diagnostics(uri)

    async def diagnostics(self, uri: str, timeout: float = 60.0):
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while uri not in self.client.diagnostics:
            if loop.time() > end:
                raise TimeoutError(f"no diagnostics for {uri}")
            await asyncio.sleep(0.02)
        return list(self.client.diagnostics[uri])

    async def command(self, *args):
        return await self.client.workspace_execute_command_async(lsp.ExecuteCommandParams(
            command="fuselens.server.compileAndBenchmark", arguments=list(args)))

    async def request(self, method: str, params: dict):
        return await self.client.protocol.send_request_async(method, params)


@pytest.fixture
def session(client, tmp_path):
    return Session(client, tmp_path)


