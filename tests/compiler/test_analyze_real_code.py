"""The abstract domain on the idioms of real model code (issue 17): for each, the editor's
diagnostics are the breaks the concrete capture finds when the code runs (`fuselens.explain`),
no more (precision: `raise`, super(), static methods, module lists are no breaks) and no fewer
(recall: a break inside each layer of a module list, behind super(), **kwargs, or a library's
logger read from the package's source)."""
import importlib
import sys
import textwrap

import pytest
import torch

import fuselens
from fuselens.capture import analyze_source

HEAD = "import torch\nimport torch.nn as nn\n"
TAIL = "\ncompiled = torch.compile(M())\n"  # what makes M.forward compiled code for the editor

CASES = {
    "raise_in_validation": '''
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x, mask=None):
                if mask is not None and mask.dim() != 2:
                    raise ValueError("mask must be 2-d")
                if x.dim() == 1:
                    raise ValueError(f"got {x}")
                return self.fc(x)
    ''',
    "super_method": '''
        class Base(nn.Module):
            def scale(self, x):
                return x * 2
        class M(Base):
            def __init__(self):
                super().__init__()
            def scale(self, x):
                return super().scale(x) + 1
            def forward(self, x):
                return self.scale(x)
    ''',
    "super_reaches_a_break": '''
        class Base(nn.Module):
            def scale(self, x):
                print("scaling")
                return x * 2
        class M(Base):
            def __init__(self):
                super().__init__()
            def forward(self, x):
                return super().scale(x) + 1
    ''',
    "static_and_class_methods_through_self": '''
        class M(nn.Module):
            def __init__(self):
                super().__init__()
            @staticmethod
            def bucket(x, bidirectional=True, n=4):
                return x * n if bidirectional else x
            @classmethod
            def twice(cls, x):
                return x * 2
            def forward(self, x):
                return self.bucket(x, bidirectional=False) + self.twice(x)
    ''',
    "data_dependent_if_in_each_layer_of_a_module_list": '''
        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                if x.sum() > 0:
                    x = x * 2
                return self.fc(x)
        class M(nn.Module):
            def __init__(self, n=2):
                super().__init__()
                self.layers = nn.ModuleList([Layer() for _ in range(n)])
            def forward(self, x):
                for i, layer in enumerate(self.layers[:2]):
                    x = layer(x)
                return x
    ''',
    "kwargs_passed_on": '''
        class Layer(nn.Module):
            def forward(self, x, **kwargs):
                x = x + 1
                return x.tolist()
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = Layer()
            def forward(self, x, **kwargs):
                return self.layer(x, **kwargs)
    ''',
    # modules and parameters made in forward from values the editor does not know: a module whose
    # __init__ makes parameters on every path breaks (a new one on each call), one that makes none
    # (ReLU, LayerNorm without affine) does not, nn.Parameter(...) does
    "new_modules_and_parameters_from_unknown_sizes": '''
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                self.fc = nn.Linear(x.shape[-1], 4)
                self.act = nn.ReLU()
                self.norm = nn.LayerNorm(x.shape[-1], elementwise_affine=False)
                self.fc.weight = nn.Parameter(self.fc.weight.clone())
                return self.act(self.fc(x))
    ''',
    # NumPy on values computed from the input, its result made into a tensor: capture breaks at
    # each NumPy call it cannot see into (DistilBERT's sinusoidal tables)
    "numpy_data_reaching_torch": '''
        import numpy as np
        class M(nn.Module):
            def forward(self, x):
                n = x.shape[-1]
                table = np.arange(n) / 2.0
                y = x * torch.FloatTensor(np.sin(table))
                return y + np.cos(table)
    ''',
}


def _located(breaks, filename):
    """(code, line) of each break, at its innermost line in `filename`."""
    out = set()
    for b in breaks:
        frames = [(f.filename, f.line) for f in b.stack] + [(b.filename, b.line)]
        line = next(ln for fn, ln in reversed(frames) if fn == filename)
        out.add((b.code, line))
    return out


def _abstract(path):
    a = analyze_source(path.read_text(), str(path))
    fa = next(f for f in a.functions if f.qualname == "M.forward")
    return _located(fa.breaks, str(path))


def _concrete(module):
    ex = fuselens.explain(module.M(), torch.randn(2, 4))
    return _located(ex.graph_breaks, module.__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_abstract_equals_concrete(name, tmp_path, monkeypatch):
    path = tmp_path / f"fl_case_{name}.py"
    path.write_text(HEAD + textwrap.dedent(CASES[name]) + TAIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(path.stem)
    assert _abstract(path) == _concrete(module)


def _package(tmp_path, helper_body):
    """pkg/utils/logging.py adds `warning_once` to every logger (as transformers' does);
    pkg/models/model.py compiles M, which logs through it and calls pkg/utils/checks.py."""
    root = tmp_path / "flpkg"
    (root / "utils").mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    (root / "__init__.py").write_text("")
    (root / "utils" / "__init__.py").write_text("")
    (root / "models" / "__init__.py").write_text("")
    (root / "utils" / "logging.py").write_text(textwrap.dedent('''
        import logging

        def get_logger(name=None):
            return logging.getLogger(name)

        def warning_once(self, *args):
            self.warning(*args)

        logging.Logger.warning_once = warning_once
    '''))
    (root / "utils" / "checks.py").write_text(textwrap.dedent(helper_body))
    model = root / "models" / "model.py"
    model.write_text(textwrap.dedent('''
        import torch
        import torch.nn as nn
        from ..utils import logging
        from ..utils.checks import check

        logger = logging.get_logger(__name__)

        class M(nn.Module):
            def forward(self, x, use_cache=None):
                check(x, use_cache)
                if x.dim() == 1:
                    logger.warning_once("a vector")
                logger.warning_once("compiled")
                return x * 2

        compiled = torch.compile(M())
    '''))
    return model


def test_library_logger_from_package_source(tmp_path, monkeypatch):
    """`logger = logging.get_logger(__name__)` from the package's own `utils/logging.py`: read,
    not imported; every call on a logger breaks (torch.compile: GB0291), `warning_once` too."""
    model = _package(tmp_path, '''
        def check(x, flag):
            return x
    ''')
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("flpkg.models.model")
    got = _abstract(model)
    # the branch on x.dim() is known when it runs, unknown to the editor: reported in this file
    assert got == _concrete(module) | {("FL101", 13)}
    assert ("FL101", 14) in got
    assert "flpkg" not in sys.modules or sys.modules["flpkg"].__file__  # (imported by the test only)


def test_unknown_branch_in_another_file_is_not_claimed(tmp_path):
    """A break in a library's code on a branch the editor cannot decide (a config's flag) is not
    reported in the user's file; one on a path that always runs is, at the call."""
    model = _package(tmp_path, '''
        import logging
        log = logging.getLogger(__name__)

        def check(x, flag):
            if flag:
                log.warning("use_cache is ignored")
            return x
    ''')
    assert ("FL101", 11) not in _abstract(model)
    model = _package(tmp_path, '''
        import logging
        log = logging.getLogger(__name__)

        def check(x, flag):
            log.warning("checking")
            return x
    ''')
    assert ("FL101", 11) in _abstract(model)


def test_property_with_a_setter_reads_its_getter(tmp_path):
    """`@name.setter` defines a second `def name`: reading `self.name` still runs the getter (a
    logging call there breaks under torch.compile: GB0291)."""
    path = tmp_path / "fl_property.py"
    path.write_text(HEAD + "import logging\nlog = logging.getLogger(__name__)\n" + textwrap.dedent('''
        class M(nn.Module):
            @property
            def scale(self):
                log.warning("reading scale")
                return 2
            @scale.setter
            def scale(self, v):
                pass
            def forward(self, x):
                return x * self.scale
    ''') + TAIL)
    assert _abstract(path) == {("FL101", 9)}


def test_numpy_work_of_its_own_is_not_claimed(tmp_path):
    """NumPy whose result never reaches torch (a preprocessing helper: Whisper's
    `_compute_mask_indices`) is no tensor code: torch.compile traces it; the editor claims
    nothing there, though capture would break on its calls."""
    path = tmp_path / "fl_numpy_own.py"
    path.write_text(HEAD + "import numpy as np\n" + textwrap.dedent('''
        def spans(n):
            idx = np.arange(n) * 2
            return np.concatenate([idx, idx])
        class M(nn.Module):
            def forward(self, x):
                self.spans = spans(x.shape[0])
                return x * 2
    ''') + TAIL)
    assert _abstract(path) == set()


@pytest.mark.parametrize("module", ["transformers.models.gpt2.modeling_gpt2", "transformers"])
def test_class_of_an_installed_library_compiled_in_a_script(tmp_path, module):
    """`torch.compile(GPT2ForSequenceClassification(...))` in a script names the class in the
    installed transformers' modeling file (found on sys.path and read, not imported), also where
    the script imports it from the package's top level: transformers exports it lazily, as its
    `if TYPE_CHECKING:` imports and `import *` chain say."""
    transformers = pytest.importorskip("transformers")
    from fuselens.capture.analyze import compiled_elsewhere
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f'''
        import torch
        from {module} import GPT2ForSequenceClassification
        model = GPT2ForSequenceClassification(config)
        fast = torch.compile(model)
    '''))
    import os
    path = os.path.realpath(os.path.join(os.path.dirname(transformers.__file__), "models", "gpt2", "modeling_gpt2.py"))
    assert compiled_elsewhere(script.read_text(), str(script)) == {(path, "GPT2ForSequenceClassification")}
