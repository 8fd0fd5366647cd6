"""The process's state read by compiled code. The environment (capture/environ.py): each read is
guarded by value, so a call after the environment changed computes what eager computes now (in
another process too: test_capture_cache.py), and a change to the environment made by compiled
code happens once, in Python. The standard library run natively (capture/process_state.py): what
it reads of the environment is guarded alike; a call that reads the file system, the working
directory, the current thread or randomness is a break, run on every call."""
from __future__ import annotations

import os
import threading
import uuid
from os import environ

import pytest
import torch

import fuselens

VAR = "FL_TEST_ENV_MODE"


def _get(x):
    return x + 1 if os.environ.get(VAR) == "a" else x - 1


def _get_default(x):
    return x * len(os.environ.get(VAR, "two"))


def _getenv(x):
    return x + 1 if os.getenv(VAR) == "a" else x - 1


def _item(x):
    try:
        mode = os.environ[VAR]
    except KeyError:
        mode = "unset"
    return x + len(mode)


def _member(x):
    return x + 1 if VAR in os.environ else x - 1


def _not_member(x):
    return x + 1 if VAR not in environ else x - 1  # (imported by name)


def _iterated(x):
    return x + sum(1 for k in os.environ if k.startswith(VAR))


def _copied(x):
    return x + len(dict(os.environ).get(VAR, "")) + len(os.environ.copy().get(VAR, "")) + \
        len(dict(os.environ, FL_EXTRA="xyz")["FL_EXTRA"])


def _length(x):
    return x + len(os.environ)


def _in_a_callee(x):
    return _get(x) * 2


READS = [_get, _get_default, _getenv, _item, _member, _not_member, _iterated, _copied, _length, _in_a_callee]


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    return monkeypatch


@pytest.mark.parametrize("fn", READS, ids=lambda f: f.__name__)
def test_a_changed_environment_variable_recompiles(fn, env):
    cf = fuselens.compile(fn)
    x = torch.zeros(2)
    for value in (None, "a", "b", "a", None):
        if value is None:
            env.delenv(VAR, raising=False)
        else:
            env.setenv(VAR, value)
        torch.testing.assert_close(cf(x), fn(x), rtol=0, atol=0)
    assert len(fuselens.inspect(cf)) <= 3  # (one entry a value: unset, "a", "b")


def test_an_unchanged_environment_keeps_one_entry(env):
    env.setenv(VAR, "a")
    cf = fuselens.compile(_get)
    for _ in range(3):
        cf(torch.zeros(2))
    entry, = fuselens.inspect(cf)
    assert any(VAR in g.reason for g in entry.guards), entry.guards


def _writes(x):
    os.environ[VAR] = os.environ.get(VAR, "") + "w"
    return x + len(os.environ[VAR])


def test_a_change_to_the_environment_is_made_once_in_python(env):
    cf = fuselens.compile(_writes)
    for want in ("w", "ww", "www"):
        assert cf(torch.zeros(1)).item() == len(want)
        assert os.environ[VAR] == want


# ---------------------------------------------------------------- the standard library, run natively
def _expanded(x):
    return x + len(os.path.expandvars("$" + VAR)) + len(os.path.expanduser("~")) + len(os.path.join("a", "b"))


def test_what_the_standard_library_reads_of_the_environment_is_guarded(env):
    cf = fuselens.compile(_expanded)
    for var, home in [("ab", "/h"), ("abcd", "/h"), ("abcd", "/home/someone")]:
        env.setenv(VAR, var)
        env.setenv("HOME", home)
        torch.testing.assert_close(cf(torch.zeros(1)), _expanded(torch.zeros(1)), rtol=0, atol=0)
    assert not fuselens.explain(_expanded, torch.zeros(1)).graph_breaks  # (computed, not a break)


def _exists(x, path):
    return x + 1 if os.path.exists(path) else x - 1


def _absolute(x):
    return x + len(os.path.abspath("a"))


def _thread_name(x):
    return x + len(threading.current_thread().name)


def _random_id(x):
    return x + uuid.uuid4().int % 1000


def test_a_standard_library_call_that_reads_other_state_runs_on_every_call(tmp_path, monkeypatch):
    path = str(tmp_path / "flag")
    cf = fuselens.compile(_exists)
    assert cf(torch.zeros(1), path).item() == -1
    open(path, "w").close()
    assert cf(torch.zeros(1), path).item() == 1
    [brk] = fuselens.explain(_exists, torch.zeros(1), path).graph_breaks
    assert "posix.stat" in brk.detail or "nt.stat" in brk.detail, brk.detail

    cf = fuselens.compile(_absolute)
    cf(torch.zeros(1))
    monkeypatch.chdir(tmp_path)
    assert cf(torch.zeros(1)).item() == len(str(tmp_path / "a"))

    cf = fuselens.compile(_thread_name)
    cf(torch.zeros(1))
    got = []
    t = threading.Thread(target=lambda: got.append(cf(torch.zeros(1)).item()), name="a-thread-of-another-name")
    t.start()
    t.join()
    assert got == [len("a-thread-of-another-name")]

    cf = fuselens.compile(_random_id)
    assert len({cf(torch.zeros(1)).item() for _ in range(4)}) > 1  # (a new id on every call, as eager's)


def test_a_guard_on_the_whole_environment_writes_no_value_out(env):
    env.setenv(VAR, "a-secret-value")
    cf = fuselens.compile(_copied)
    cf(torch.zeros(1))
    entry, = fuselens.inspect(cf)
    assert not any("a-secret-value" in g.expr for g in entry.guards)
    env.setenv(VAR, "another-secret")
    torch.testing.assert_close(cf(torch.zeros(1)), _copied(torch.zeros(1)), rtol=0, atol=0)
