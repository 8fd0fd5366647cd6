"""For every test: the program cache (backend/program_cache.py) off, so that each test's graphs
go through the backend it tests (a test that breaks a backend stage, or counts its calls, would
otherwise load another test's or an earlier run's programs). tests/backend/test_program_cache.py
turns it on in the processes it starts.

The stage contracts are checked at every hand-over (FUSELENS_VERIFY=1, ops/contract.py): a broken
one makes that graph run eagerly with a warning, so each test also fails where one broke."""
import os
import sys

import pytest

os.environ.setdefault("FUSELENS_PROGRAM_CACHE", "0")
os.environ.setdefault("FUSELENS_VERIFY", "1")


@pytest.fixture(autouse=True)
def _stage_contracts_hold():
    yield
    contract = sys.modules.get("fuselens.ops.contract")  # (not imported: nothing was compiled here)
    broken = contract.VIOLATIONS[:] if contract is not None else []
    if broken:
        del contract.VIOLATIONS[:]
        pytest.fail("stage contracts broken:\n" + "\n".join(broken))
