"""The process's environment read by compiled code (capture/environ.py): each read is guarded by
value, so a call after the environment changed computes what eager computes now (in another
process too: test_capture_cache.py), and a change to the environment made by compiled code
happens once, in Python."""
from __future__ import annotations

import os
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
    return x + len(dict(os.environ).get(VAR, "")) + len(os.environ.copy().get(VAR, ""))


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
