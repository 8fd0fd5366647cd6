"""The loop IR's ops-handler interface (lower/ir.py `OpsHandler`) is declared once, and each code
that runs loop bodies implements all of it: the Triton kernel writer, the fusion analysis's read
recorder, the kernel writer's tree of a body (online softmax's match)."""
import inspect

import pytest

from fuselens.codegen.triton import KernelWriter
from fuselens.codegen.triton_reductions import _Tree
from fuselens.lower.ir import OpsHandler
from fuselens.schedule.fusion import ReadRecorder

OPERATIONS = sorted(name for name, _ in inspect.getmembers(OpsHandler, inspect.isfunction) if not name.startswith("_"))


def test_the_interface_names_what_loop_bodies_call():
    assert OPERATIONS == ["at", "constant", "index_value", "indirect", "load", "masked", "pointwise", "random",
                          "to_dtype"]


@pytest.mark.parametrize("handler", [KernelWriter, ReadRecorder, _Tree], ids=lambda h: h.__name__)
def test_each_handler_implements_every_operation(handler):
    assert OpsHandler in handler.__mro__  # declared, not only duck-typed
    assert [name for name in OPERATIONS if getattr(handler, name) is getattr(OpsHandler, name)] == []
