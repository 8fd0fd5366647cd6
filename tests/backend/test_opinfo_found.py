"""Classes of bugs the OpInfo full matrix (tests/conformance, FUSELENS_OPINFO=full) found in the
whole pipeline, kernels included: compiled results equal eager's and nothing falls back."""
from __future__ import annotations

import warnings

import pytest
import torch

import fuselens
from fuselens import FuselensWarning


def _same_as_eager(fn, *args):
    """fn compiled == eager on copies of args (results and what was written), with no fallback."""
    e_args = [a.clone() for a in args]
    c_args = [a.clone() for a in args]
    want = fn(*e_args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = fuselens.compile(fn)(*c_args)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(c_args, e_args, equal_nan=True)


# out= of a call whose meta run returns other tensors than `out` (a composite below the
# dispatcher): torch returns the out tensors themselves
def _matrix_rank_out(a, out):
    return torch.linalg.matrix_rank(a, out=out)


@pytest.mark.parametrize("fn, args", [
    (_matrix_rank_out, (torch.randn(3, 3), torch.zeros((), dtype=torch.int64))),
    (_matrix_rank_out, (torch.randn(2, 3, 3), torch.zeros(2, dtype=torch.int64))),
], ids=["0-d", "batched"])
def test_out_returns_the_out_tensors(fn, args):
    _same_as_eager(fn, *args)
