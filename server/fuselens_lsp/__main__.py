import time

STARTED = time.perf_counter()  # the server's log says how long its first diagnostics took from here

import argparse  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m fuselens_lsp", description="fuselens language server (stdio)")
    p.add_argument("--stdio", action="store_true", help="talk LSP over stdin/stdout (the default)")
    p.add_argument("--version", action="store_true")
    a = p.parse_args()
    from . import __version__
    if a.version:
        print(__version__)
        return 0
    # find_spec, not import: importing torch takes seconds, and `initialize` must not wait for it
    # (the first analysis imports it, in the analysis thread)
    from importlib.util import find_spec
    missing = [mod for mod in ("pygls", "lsprotocol", "libcst", "torch", "fuselens") if find_spec(mod) is None]
    if missing:
        print(f"fuselens_lsp: {sys.executable} lacks {', '.join(missing)}; install them "
              "(pip install 'pygls>=2,<3' lsprotocol libcst torch, and fuselens) or point the "
              "fuselens.pythonPath setting at an interpreter that has them.", file=sys.stderr)
        return 3
    from .initialize_cache import answer_from_cache
    stdin, stdout = answer_from_cache(sys.stdin.buffer, sys.stdout.buffer)
    from .server import start
    start(stdin, stdout, STARTED)
    return 0


sys.exit(main())
