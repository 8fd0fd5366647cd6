"""Backend tests run kernels in Triton's interpreter unless FUSELENS_INTERPRET is set otherwise
(e.g. empty on a GPU machine). Helpers live in fl_backend_testing.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Triton picks interpreted vs compiled for its library functions when first imported
os.environ.setdefault("FUSELENS_INTERPRET", "1")
if os.environ["FUSELENS_INTERPRET"] == "1":
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "compiler") not in sys.path:
    sys.path.insert(0, str(ROOT / "compiler"))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's random inputs are the same whichever tests ran before it in its worker: a
    tolerance a sum of thousands of products misses on some draws fails every run or never."""
    torch.manual_seed(0)
