"""Fixtures of the capture tests; their helpers live in fl_capture_testing.py (a module of its
own name: `from conftest import` would pick another folder's conftest in a whole-suite run)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "compiler", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import fuselens  # noqa: E402
from fuselens import FuselensWarning  # noqa: E402
from fl_fx_backend import use_fx_backend  # noqa: E402


@pytest.fixture(autouse=True)
def _strict_fuselens_warnings():
    """An unexpected FuselensWarning (an eager fallback) fails the test; tests that expect
    one use pytest.warns, which overrides this filter inside its block."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        yield


@pytest.fixture(autouse=True)
def _eager_backend(monkeypatch):
    """These are capture tests: graphs run as their FX modules so that a backend change can't
    make them slow or fail them (tests of the backend live with the backend)."""
    use_fx_backend(monkeypatch)
