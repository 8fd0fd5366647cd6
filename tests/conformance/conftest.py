"""The OpInfo conformance suite (helpers in fl_opinfo.py): kernels run in Triton's interpreter
unless FUSELENS_INTERPRET is set otherwise; the run ends with one summary line of outcomes."""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("FUSELENS_INTERPRET", "1")
if os.environ["FUSELENS_INTERPRET"] == "1":
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "compiler") not in sys.path:
    sys.path.insert(0, str(ROOT / "compiler"))

_OUTCOMES: list[dict] = []  # on the controller (xdist) or the only process


def pytest_runtest_logreport(report):
    if report.when == "call":
        _OUTCOMES.extend(v for k, v in report.user_properties if k == "fl_opinfo")


def pytest_terminal_summary(terminalreporter):
    if not _OUTCOMES:
        return
    kinds = collections.Counter(o["kind"] for o in _OUTCOMES)
    causes = collections.Counter(o["detail"] for o in _OUTCOMES if o["kind"] == "fallback")
    breaks = sum(1 for o in _OUTCOMES if o["kind"] == "equal" and o["graph_break"])
    ops = len({o["where"].split()[0] for o in _OUTCOMES})
    causes_text = "; ".join(f"{n}x {c}" for c, n in causes.most_common())
    terminalreporter.write_line(
        f"fuselens OpInfo conformance: {ops} ops, {len(_OUTCOMES)} samples, {kinds['equal']} equal "
        f"({breaks} with a graph break), {kinds['fallback']} fell back to eager"
        f"{f' ({causes_text})' if causes else ''}, {kinds['xfail']} expected failures, "
        f"{kinds['mismatch']} mismatches")
    if os.environ.get("FUSELENS_OPINFO_JSON"):  # every outcome, for a report
        with open(os.environ["FUSELENS_OPINFO_JSON"], "w") as f:
            for o in _OUTCOMES:
                f.write(json.dumps(o) + "\n")
