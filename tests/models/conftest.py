"""Fixtures of the model-zoo tests (transformers' models, tiny configs)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT / "compiler", ROOT / "tests", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from fuselens import FuselensWarning  # noqa: E402


@pytest.fixture(autouse=True)
def _strict_fuselens_warnings():
    """A fallback to eager (a FuselensWarning) fails the test: the zoo must compile."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        yield


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
