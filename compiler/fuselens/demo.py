"""`make demo`: every file in examples/ through the compiler, with a report per function.

Each example file names its compiled functions and how to make inputs for them in
`EXAMPLE_INPUTS = {"name" or "Class.method": lambda: (args...)}`."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

import fuselens
from fuselens.runtime.compiled import CompiledFunction


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"fuselens_example_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _resolve(mod, key, args):
    """(compiled callable, eager callable, what to explain, its args) for an EXAMPLE_INPUTS key."""
    if "." not in key:
        fn = getattr(mod, key)
        return fn, fn.original, fn, args
    cls_name, meth = key.split(".")
    obj = args[0]
    attr = getattr(getattr(mod, cls_name), meth)
    if isinstance(attr, CompiledFunction):  # a decorated method
        return (lambda *a: attr(obj, *a)), (lambda *a: attr.original(obj, *a)), attr, args
    return obj, (lambda *a: attr(obj, *a)), obj, args[1:]


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _to(v, device):
    if isinstance(v, (torch.Tensor, torch.nn.Module)):
        return v.to(device)
    if isinstance(v, (tuple, list)):
        return type(v)(_to(x, device) for x in v)
    return v


def run(folder: str, device: str = "cpu") -> int:
    failures = 0
    for path in sorted(pathlib.Path(folder).glob("*.py")):
        print(f"\n{'=' * 78}\n{path}\n{'=' * 78}")
        mod = _load(path)
        for key, make in getattr(mod, "EXAMPLE_INPUTS", {}).items():
            torch.manual_seed(0)
            compiled, eager, explained, args = _resolve(mod, key, _to(make(), device))
            print(f"\n--- {key}")
            print(fuselens.explain(explained, *args))
            if explained is not compiled:
                args = args[1:]
            torch.manual_seed(1)
            got = compiled(*args)
            torch.manual_seed(1)
            want = eager(*args)
            ok = _close(got, want)
            failures += not ok
            print(f"result vs eager: {'OK (equal)' if ok else 'MISMATCH'}")
    print(f"\n{'all examples match eager' if not failures else f'{failures} mismatch(es)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default="examples")
    ap.add_argument("--device", default="cpu", help="run the examples' inputs on this device (cuda on a GPU)")
    a = ap.parse_args()
    sys.exit(run(a.folder, a.device))
