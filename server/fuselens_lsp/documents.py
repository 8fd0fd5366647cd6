"""The server's copy of each open document, with LSP's line breaks.

pygls's `TextDocument.lines` is `source.splitlines(True)`, which also ends a line at a form
feed, `\\v`, `\\x1c`-`\\x1e`, U+0085, U+2028 and U+2029; the client counts only `\\n`, `\\r\\n` and
`\\r`. With one of those characters in a file, pygls applies an incremental edit to the wrong
line and every later edit compounds it. pygls has no setting for this; its `Workspace` makes
documents in `_create_text_document`, so a subclass of each is the narrowest override.
"""
from __future__ import annotations

from pygls.workspace import TextDocument, Workspace

from .analysis import lines_with_ends


class LspLinesDocument(TextDocument):
    @property
    def lines(self):
        return tuple(lines_with_ends(self.source))


class LspLinesWorkspace(Workspace):
    @classmethod
    def like(cls, ws: Workspace) -> "LspLinesWorkspace":
        """The same (still empty) workspace, making LspLinesDocuments."""
        return cls(ws.root_uri, ws._sync_kind, list(ws.folders.values()), ws.position_encoding)

    def _create_text_document(self, doc_uri, source=None, version=None, language_id=None):
        return LspLinesDocument(doc_uri, source=source, version=version, language_id=language_id,
                                sync_kind=self._sync_kind, position_codec=self.position_codec)
