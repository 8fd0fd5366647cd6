"""Every op of PyTorch's OpInfo database through fuselens.compile, compared with eager (see
fl_opinfo.py). FUSELENS_OPINFO=full runs every sample; the default, the first of each op,
variant and dtype. A test fails on a mismatch; fallbacks to eager are counted, not failed."""
from __future__ import annotations

import dataclasses

import pytest

from fl_opinfo import OPS, dtypes, op_id, run_op

CASES = [pytest.param(op, dtype, id=f"{op_id(op)}-{str(dtype)[6:]}") for op in OPS for dtype in dtypes(op)]


@pytest.mark.parametrize("op, dtype", CASES)
def test_op(op, dtype, record_property):
    results = run_op(op, dtype)
    for where, outcome in results:
        record_property("fl_opinfo", dict(where=where, **dataclasses.asdict(outcome)))
    mismatches = [outcome.label(where) for where, outcome in results if outcome.kind == "mismatch"]
    assert not mismatches, "\n".join(mismatches)
