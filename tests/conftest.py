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


# (written by pytest-xdist's controller, which sees every worker's reports)
_OUTCOME_LOG = os.environ.get("FUSELENS_TEST_LOG") if "PYTEST_XDIST_WORKER" not in os.environ else None


def pytest_runtest_logreport(report):
    """With FUSELENS_TEST_LOG=PATH each test's outcome and time is appended to PATH as it ends
    (scripts/test-gpu.sh: a run stopped by the device's time limit still names what failed and
    what was slow; pytest's own summary comes only at the end)."""
    if _OUTCOME_LOG and (report.when == "call" or report.outcome != "passed"):
        with open(_OUTCOME_LOG, "a") as log:
            log.write(f"{report.outcome}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\n")
