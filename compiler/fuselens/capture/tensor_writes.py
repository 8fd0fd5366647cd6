"""What the in-place writes captured so far have done (tensors.py functionalizes them into graph
ops): each input written in place, with its latest value, which the graph returns for the
runtime to write back; and each replaced TensorVar's newer value, for references outside the
frames' variables (the items of a loop, nested containers). A statement rolled back
(statements.py) returns to a mark."""
from __future__ import annotations

from .values import TensorVar


class TensorWrites:
    def __init__(self):
        self.inputs: dict[str, TensorVar] = {}  # input source -> its latest value
        self._newer: dict[int, tuple] = {}  # id(TensorVar) -> (it, its value after an in-place op)

    def replaced(self, old: TensorVar, new: TensorVar) -> None:
        """`new` is what was `old` from now on (the frames' variables are the caller's to update)."""
        if old.source is not None:
            new.source = None
            self.inputs[old.source] = new
        for k, v in list(self.inputs.items()):
            if v is old:
                self.inputs[k] = new
            if self.inputs[k] is new and new.node is not None:
                # where a run of the graph that raises has got to in writing input k (backend/driver.py)
                new.node.meta["input_value"] = k
        self._newer[id(old)] = (old, new)

    def latest(self, v):
        """A tensor's value after the in-place ops on it: references outside the frames'
        variables (the items of a loop, nested containers) still hold the old TensorVar."""
        while isinstance(v, TensorVar) and id(v) in self._newer:
            v = self._newer[id(v)][1]
        return v

    def mark(self) -> tuple:
        return dict(self.inputs), dict(self._newer)

    def rollback(self, mark: tuple) -> None:
        inputs, self._newer = mark
        self.inputs.clear()
        self.inputs.update(inputs)
