"""Graphs run as their FX modules: for tests about capture (the capture, model-zoo and editor
corpus tests), so that a backend change can't make them slow or fail them; the backend's own
tests live with the backend."""
from __future__ import annotations

from fuselens.backend import driver


class _FX:
    kernels: list = []
    wrapper_source = None

    def __init__(self, gm):
        self.gm = gm
        self.run = driver.eager_run(gm)  # (as the backend runs a graph eagerly: writes and errors)

    def __call__(self, *inputs):
        return self.run(*inputs)


def use_fx_backend(monkeypatch) -> None:
    monkeypatch.setattr(driver, "compile_graph", lambda gm, inputs, **kw: _FX(gm))
