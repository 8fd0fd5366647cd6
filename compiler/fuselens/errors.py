"""fuselens's warning and error types, and the one boundary where an internal error of fuselens
(in capture or the backend) becomes an eager run. A leaf module: it imports nothing of fuselens,
so every stage can use it.

"Nothing runs twice": `fall_back` is called only where nothing of the failed compiled attempt is
visible yet: before any of the call's user statements ran (a function's capture) or before a
graph's results were used or written back (a graph is pure until then). The eager run it makes
is then the call's only run of that code, and it also tells the two kinds of error apart: if eager
raises too, the error was the user's, and eager's exception is what the caller sees (no warning,
nothing disabled); if eager returns, the error was fuselens's: one FuselensWarning names it."""
from __future__ import annotations

import traceback
import warnings


class FuselensWarning(UserWarning):
    """fuselens runs something eagerly that it meant to compile (results stay eager's)."""


class InternalError(RuntimeError):
    """An error of fuselens itself where no eager run can take the compiled code's place."""


def warn(msg: str, stacklevel: int = 3) -> None:
    warnings.warn(f"fuselens: {msg}", FuselensWarning, stacklevel=stacklevel)


def raised_at(cause: BaseException) -> str:
    """Where in a generated wrapper `cause` was raised (` at <fuselens wrapper HASH> line N:
    the launch or call`), or "": the kernel a fault came from (its source is in linecache)."""
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if f.filename.startswith("<fuselens wrapper")]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename} line {f.lineno}: {(f.line or '').strip()[:200]}"


def fallback_message(stage: str, subject: str, cause: BaseException) -> str:
    """The one text of an internal error that became an eager run."""
    return (f"internal error in {stage} of {subject} ({type(cause).__name__}: {cause}{raised_at(cause)}); "
            f"running {subject} eagerly from now on")


def fall_back(stage: str, subject: str, cause: BaseException, eager=None):
    """`cause`, raised by fuselens's `stage` (capture, the backend) for `subject` (a function, a
    graph), becomes `eager()`'s result, with a FuselensWarning naming it. `eager()` raising means
    the error was the user's program's: its exception propagates as is, unwarned, so the caller
    must commit to running `subject` eagerly from now on only once this returns. Without `eager`
    (a failure before anything was to run, e.g. compiling kernels), it only warns."""
    try:
        out = eager() if eager is not None else None
    except BaseException as e:
        # the user's error as eager raises it, but where fuselens's run left the device broken (a
        # kernel's fault: CUDA reports it at a later call) eager's error is only its echo
        e.add_note(f"(fuselens's compiled run of {subject} had raised first: {type(cause).__name__}: {cause}"
                   f"{raised_at(cause)})")
        raise
    warn(fallback_message(stage, subject, cause), stacklevel=3)
    return out
