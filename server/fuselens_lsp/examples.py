"""Example inputs for "Compile & benchmark", given in the source as a comment.

Write a comment directly above the function (above its decorators too):

    # fuselens: example(x=float32[1024, 512], w=float32[512], eps=1e-5)
    @torch.compile
    def norm(x, w, eps): ...

Each argument is either a tensor spec `DTYPE[d0, d1, ...]` (random values: normal for
floating dtypes, integers in [0, 16) for integer dtypes, coin flips for bool; seeded) or a
Python literal (number, string, bool, None, tuple/list of those). Arguments may be positional
or by keyword. Tensors go on the GPU when one is present. Parsing never evaluates the comment.
"""
from __future__ import annotations

import ast
import re

EXAMPLE_RE = re.compile(r"^\s*#\s*fuselens:\s*example\s*(\(.*\))\s*$")

DTYPES = {
    "float32": "float32", "float": "float32", "f32": "float32",
    "float16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64", "f64": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool",
}

HOW_TO = (
    "Give example inputs in one of these ways:\n"
    "  1. a comment directly above the function, e.g.\n"
    "       # fuselens: example(x=float32[1024, 512], eps=1e-5)\n"
    "  2. a call to the function in the file's `if __name__ == \"__main__\":` block\n"
    "     (fuselens runs the block in a worker and records the first call's arguments)\n"
    "  3. a pytest test in the workspace that calls the function (recorded the same way)."
)


class ExampleSyntaxError(ValueError):
    pass


def _spec(node: ast.AST):
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        dt = DTYPES.get(node.value.id)
        if dt is None:
            raise ExampleSyntaxError(
                f"unknown dtype `{node.value.id}` (known: {', '.join(sorted(set(DTYPES)))})")
        sl = node.slice
        dims = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        shape = []
        for d in dims:
            try:
                v = _literal(d)
            except ExampleSyntaxError:
                v = None
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ExampleSyntaxError(f"tensor sizes must be non-negative ints, got `{ast.unparse(d)}`")
            shape.append(v)
        if isinstance(sl, ast.Tuple) and not sl.elts:
            shape = []
        return {"kind": "tensor", "dtype": dt, "shape": shape}
    if isinstance(node, (ast.Tuple, ast.List)):
        return {"kind": "tuple" if isinstance(node, ast.Tuple) else "list",
                "items": [_spec(e) for e in node.elts]}
    return {"kind": "value", "value": _literal(node)}


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        raise ExampleSyntaxError(
            f"`{ast.unparse(node)}` is neither a tensor spec like float32[4, 8] nor a literal") from None


def parse_example(text: str) -> dict:
    """Parses the parenthesised part of a `# fuselens: example(...)` comment."""
    try:
        call = ast.parse("_" + text, mode="eval").body
    except SyntaxError as e:
        raise ExampleSyntaxError(f"cannot parse example inputs: {e.msg}") from None
    if not isinstance(call, ast.Call):
        raise ExampleSyntaxError("expected `example(...)`")
    args = [_spec(a) for a in call.args]
    kwargs = {}
    for kw in call.keywords:
        if kw.arg is None:
            raise ExampleSyntaxError("`**` is not allowed in example inputs")
        kwargs[kw.arg] = _spec(kw.value)
    return {"args": args, "kwargs": kwargs, "text": "example" + text}


def find_example_comment(source: str, def_line: int) -> tuple[int, str] | None:
    """The `# fuselens: example(...)` comment above the function whose `def` is on 1-based
    `def_line` (decorators and other comments may sit in between). Returns (line, text)."""
    lines = source.split("\n")
    i = def_line - 2
    while i >= 0:
        t = lines[i].strip()
        if t.startswith("@") or t.startswith("#") or (t.endswith(")") and i > 0 and lines[i - 1].strip().startswith("@")):
            m = EXAMPLE_RE.match(lines[i])
            if m:
                return i + 1, m.group(1)
            i -= 1
            continue
        break
    return None


def describe(spec: dict) -> str:
    def one(s):
        k = s["kind"]
        if k == "tensor":
            return f"{s['dtype']}[{', '.join(map(str, s['shape']))}]"
        if k in ("tuple", "list"):
            inner = ", ".join(one(x) for x in s["items"])
            return f"({inner})" if k == "tuple" else f"[{inner}]"
        return repr(s["value"])
    parts = [one(a) for a in spec.get("args", [])]
    parts += [f"{k}={one(v)}" for k, v in spec.get("kwargs", {}).items()]
    return ", ".join(parts)


def build(spec: dict, device: str, seed: int = 0):
    """Builds real arguments from a parsed spec (in the worker process)."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def one(s):
        k = s["kind"]
        if k == "tensor":
            dt = getattr(torch, s["dtype"])
            shape = tuple(s["shape"])
            if dt.is_floating_point:
                t = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
            elif dt == torch.bool:
                t = torch.rand(shape, generator=g) > 0.5
            else:
                t = torch.randint(0, 16, shape, generator=g, dtype=torch.int64).to(dt)
            return t.to(device)
        if k == "tuple":
            return tuple(one(x) for x in s["items"])
        if k == "list":
            return [one(x) for x in s["items"]]
        return s["value"]
    return [one(a) for a in spec.get("args", [])], {k: one(v) for k, v in spec.get("kwargs", {}).items()}
