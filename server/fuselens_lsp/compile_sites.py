"""Which classes the workspace compiles, across files (issue 17, "Across files").

`torch.compile(Net())` in train.py makes `Net.forward` in model.py compiled code: model.py's
analysis needs to know what the other files compile. This index holds, per workspace file, the
(file, class) pairs it compiles from other files, from the open document's text or, for a file
not open, its text on disk (read and parsed, never executed). Pure and synchronous: the server
calls it from its analysis thread.
"""
from __future__ import annotations

import os
import re

_IMPORT_OR_COMPILE = re.compile(r"\b(?:import|compile)\b")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _key(text: str) -> tuple:
    """The lines a file's compile sites can depend on: its imports and compile calls, and the
    assignments to the names those calls use (`net = Net()` before `torch.compile(net)`). An
    edit elsewhere (most keystrokes) keeps the key, and the file is not parsed again."""
    hits, last = [], -1
    for m in _IMPORT_OR_COMPILE.finditer(text):  # the lines these words are on, once each
        a = text.rfind("\n", 0, m.start()) + 1
        if a != last:
            b = text.find("\n", m.end())
            hits.append(text[a:b if b >= 0 else len(text)])
            last = a
    names = {n for ln in hits if "compile" in ln for n in _NAME.findall(ln)}
    if not names:
        return tuple(hits), ()
    assigned = re.findall(r"^[ \t]*(?:" + "|".join(sorted(names)) + r")[ \t]*=(?!=).*$", text, re.M)
    return tuple(hits), tuple(assigned)


class CompileSites:
    """Per workspace file: the (file, class name) pairs whose instances it compiles."""

    def __init__(self, limit_files: int = 2000):
        self.by_file: dict[str, frozenset] = {}
        self.keys: dict[str, tuple] = {}
        self.scanned = False
        self.limit_files = limit_files

    def scan(self, roots: list[str], skip_dirs: set[str]) -> set[str]:
        """Reads the workspace's Python files that mention `compile`, once (again after
        `invalidate`); returns the files whose compiled classes changed."""
        affected: set[str] = set()
        if self.scanned:
            return affected
        self.scanned = True
        seen = 0
        for root in roots:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
                for fn in filenames:
                    if not fn.endswith(".py"):
                        continue
                    seen += 1
                    if seen > self.limit_files:
                        return affected
                    path = os.path.realpath(os.path.join(dirpath, fn))
                    if path in self.keys:
                        continue  # (open: its document's text is already in)
                    try:
                        with open(path, encoding="utf-8") as f:
                            text = f.read()
                    except (OSError, UnicodeError):
                        continue
                    if "compile" in text or path in self.by_file:
                        affected |= self.update(path, text)
        return affected

    def invalidate(self) -> None:
        """A file was saved: what the others compile may resolve differently (a class renamed,
        moved): every file is read again at the next scan."""
        self.keys.clear()
        self.scanned = False

    def update(self, path: str, text: str) -> set[str]:
        """`path`'s compile sites from `text`; returns the files whose compiled classes changed."""
        path = os.path.realpath(path)
        key = _key(text)
        if self.keys.get(path) == key:
            return set()
        self.keys[path] = key
        from fuselens.capture.analyze import compiled_elsewhere  # imports torch: in the analysis thread
        try:
            new = frozenset(compiled_elsewhere(text, path))
        except Exception:  # noqa: BLE001 (half-typed code: no compile sites known from it)
            new = frozenset()
        old = self.by_file.get(path, frozenset())
        self.by_file[path] = new
        return {f for f, _ in old ^ new}

    def reread(self, path: str) -> set[str]:
        """`path` from disk (its document was closed)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeError):
            text = ""
        return self.update(path, text)

    def compiled_in(self, path: str) -> frozenset:
        """Names of `path`'s classes that some other workspace file compiles."""
        path = os.path.realpath(path)
        return frozenset(c for sites in self.by_file.values() for f, c in sites if f == path)
