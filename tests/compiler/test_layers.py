"""The compiler's packages are layers, bottom to top, and no module imports from a layer above its
own: no cycle between packages, and no import of the package face (`fuselens/__init__.py`) from
inside the compiler. Imports inside functions count. docs/architecture.md ("Layers") states the
same order. Read from the source with `ast`: nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

COMPILER = Path(__file__).resolve().parents[2] / "compiler"

# bottom to top, each a set of the names under fuselens/ (a package, or a top-level module):
# a module may import from its own layer and the layers below it
LAYERS = [
    {"settings", "errors", "stats", "log"},
    {"ops"},
    {"autograd"},
    {"lower"},
    {"schedule"},
    {"codegen"},
    {"backend"},  # the backend driver: program building, training, CUDA graphs, program cache
    {"capture"},
    {"runtime"},  # the per-function cache and guards
    {"__init__", "explain", "inspect", "demo"},  # the public face
]


def _unit(module: str) -> str:
    """The layer-listed name a module belongs to: `fuselens.codegen.launcher` -> `codegen`,
    `fuselens.settings` -> `settings`, `fuselens` (the package face) -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(tree: ast.Module, module: str, is_package: bool, root: Path):
    """(line, module imported) for every import of a fuselens module in `tree` (anywhere in it).
    `from P import name` imports module P.name where that is a module, else P itself."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fuselens":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + \
                (node.module.split(".") if node.module else [])
            if not base or base[0] != "fuselens":
                continue
            for alias in node.names:
                sub = root.joinpath(*base, alias.name)
                is_module = sub.is_dir() or sub.with_suffix(".py").is_file()
                yield node.lineno, ".".join(base + [alias.name]) if is_module else ".".join(base)


def back_edges(root: Path = COMPILER) -> list[str]:
    """Every import under root/fuselens of a module in a layer above the importer's (or in none)."""
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    out = []
    for path in sorted((root / "fuselens").rglob("*.py")):
        rel = path.relative_to(root)
        is_package = path.name == "__init__.py"
        module = ".".join(rel.parent.parts if is_package else rel.with_suffix("").parts)
        unit = _unit(module)
        if unit not in layer:
            out.append(f"{rel}: fuselens/{unit} is in no layer of LAYERS (tests/compiler/test_layers.py)")
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, target in dict.fromkeys(_imported(tree, module, is_package, root)):
            to = _unit(target)
            if layer.get(to, len(LAYERS)) > layer[unit]:
                face = " (the package face)" if target == "fuselens" else ""
                out.append(f"{rel}:{line}: {unit} imports {target}{face}, a layer above it")
    return out


def test_no_import_points_up():
    edges = back_edges()
    assert not edges, "imports pointing up a layer:\n" + "\n".join(edges)


def test_a_back_edge_is_found(tmp_path):
    """An import inside a function from a lower layer to a higher one, and one of the face."""
    pkg = tmp_path / "fuselens"
    for name in ("ops", "codegen"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .ops import simplify\n")
    (pkg / "codegen" / "launcher.py").write_text("from ..ops import simplify\n")
    (pkg / "ops" / "simplify.py").write_text("def f():\n    from ..codegen import launcher\n\n\n"
                                             "def g():\n    from .. import compile\n")
    assert back_edges(tmp_path) == [
        "fuselens/ops/simplify.py:2: ops imports fuselens.codegen.launcher, a layer above it",
        "fuselens/ops/simplify.py:6: ops imports fuselens (the package face), a layer above it",
    ]
