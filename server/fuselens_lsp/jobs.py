"""Runs the worker process for one "Compile & benchmark" job: time limit, cancel, crash reports.

The server never runs user code itself: it starts `python -m fuselens_lsp.worker` in its own
process group, sends the job on stdin, relays progress lines, and kills the whole group when the
time limit passes or the user cancels. A worker that dies without answering is reported with
its exit status and the last lines it wrote to stderr.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass

import fuselens_lsp

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fuselens_lsp.__file__)))


@dataclass
class WorkerOutcome:
    status: str            # "ok" | "error" | "timeout" | "cancelled" | "crashed"
    result: dict | None
    message: str
    stderr_tail: str = ""
    returncode: int | None = None


def _env() -> dict:
    env = dict(os.environ)
    paths = [_PKG_ROOT]
    try:
        import fuselens
        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(fuselens.__file__))))
    except Exception:
        pass
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    env["PYTHONUNBUFFERED"] = "1"
    # `-m` would put the working folder first on sys.path; the worker adds the user's folders
    # itself, after its own packages, so a workspace file cannot shadow torch or fuselens_lsp
    env["PYTHONSAFEPATH"] = "1"
    return env


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


async def run_worker(job: dict, *, time_limit: float, cancel: asyncio.Event | None = None,
                     on_progress=None, cwd: str | None = None, python: str | None = None) -> WorkerOutcome:
    proc = await asyncio.create_subprocess_exec(
        python or sys.executable, "-m", "fuselens_lsp.worker",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=cwd, env=_env(), start_new_session=True,
        limit=64 * 1024 * 1024)
    stderr_tail: deque[str] = deque(maxlen=40)
    result: dict | None = None

    async def read_stdout():
        nonlocal result
        while True:
            line = await proc.stdout.readline()
            if not line:
                return
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("type") == "progress" and on_progress is not None:
                try:
                    on_progress(msg.get("message", ""), msg.get("percentage"))
                except Exception:
                    pass
            elif msg.get("type") == "result":
                msg.pop("type")
                result = msg

    async def read_stderr():
        while True:
            line = await proc.stderr.readline()
            if not line:
                return
            stderr_tail.append(line.decode("utf-8", "replace").rstrip("\n"))

    proc.stdin.write(json.dumps(job).encode())
    await proc.stdin.drain()
    proc.stdin.close()

    readers = asyncio.gather(read_stdout(), read_stderr())
    waiter = asyncio.ensure_future(proc.wait())
    cancel_task = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    status = None
    try:
        done, _ = await asyncio.wait([waiter] + ([cancel_task] if cancel_task else []),
                                     timeout=time_limit, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            status = "cancelled" if cancel_task is not None and cancel_task in done else "timeout"
            _kill_group(proc)
            await proc.wait()
        else:
            # the worker may leave children (e.g. compiler subprocesses) behind: end the group
            _kill_group(proc)
    except asyncio.CancelledError:
        _kill_group(proc)
        await proc.wait()
        raise
    finally:
        if cancel_task is not None:
            cancel_task.cancel()
        try:
            await asyncio.wait_for(readers, 5)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass
    tail = "\n".join(stderr_tail)
    rc = proc.returncode
    if status == "timeout":
        return WorkerOutcome("timeout", None, f"The worker was stopped after the time limit of "
                             f"{time_limit:g} s (setting fuselens.worker.timeLimitSeconds).", tail, rc)
    if status == "cancelled":
        return WorkerOutcome("cancelled", None, "Cancelled: the worker was stopped.", tail, rc)
    if result is None:
        how = f"killed by {_signal_name(rc)}" if rc is not None and rc < 0 else f"exit status {rc}"
        last = [ln for ln in stderr_tail if ln.strip()][-5:]
        msg = f"The worker process crashed ({how}) before it finished."
        if last:
            msg += " Its last output:\n" + "\n".join(last)
        return WorkerOutcome("crashed", None, msg, tail, rc)
    if not result.get("ok"):
        return WorkerOutcome("error", result, result.get("error", "failed"), tail, rc)
    return WorkerOutcome("ok", result, "ok", tail, rc)
