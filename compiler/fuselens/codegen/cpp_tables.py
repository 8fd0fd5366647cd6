"""Functions of one bf16 value as tables, in C++ kernels.

Eager rounds each op's result of a bf16 tensor to bf16, and the kernels keep those roundings
(results equal to eager's). A value computed from a single bf16 value through pure operations (a
GeLU of its input, the exp of a softmax's rounded difference) is then a function of 16 bits: the
kernel looks it up in a table of its 65536 values (a vector gather from 256 KB) instead of computing
it (erf's or exp's tens of instructions and the roundings between them). The table is filled when
the library loads, by the very lines the kernel had (its `closure`), run on every bf16 bit pattern:
each entry is what the kernel computed, bit for bit, NaN payloads included.

A value qualifies where its closure calls a heavy routine other than exp (TABLE_WORTHY); only its
outermost such value is looked up (the inner ones then go unused, `drop_unused_temporaries`). Tables are named by
the hash of their closure, so kernels of one library computing the same function (a GeLU in every
layer) share one.
"""
from __future__ import annotations

import hashlib
import re

from .cpp_expressions import CALLS, HEAVY_CALLS, TEMPORARY

DEFINITION = re.compile(r"^float (tmp\d+) = (.*?);(  //.*)?$")
# calls worth a table's gather: not exp, inline and vectorised, which computes as fast as a gather
# loads (bf16 exp 1.81 ms computed, 1.84 looked up on 2048x4096; a softmax's sum loop 2.7 ms
# computing it, 3.35 looking it up), where tanh's SLEEF call takes 6.5 ms against 1.6
TABLE_WORTHY = HEAVY_CALLS - {"fl_exp"}
NUMBER = re.compile(r"\b0x[0-9a-fA-F.]+p[+-]?\d+\b|\b\d+(?:\.\d*)?(?:[eE][+-]?\d+)?[fFuUlL]*\b")
NAME = re.compile(r"[A-Za-z_][\w:]*")
# names an expression of only temporaries and literals may hold besides its calls
LITERAL_WORDS = frozenset({"float", "double", "int32_t", "uint32_t", "int64_t", "std::numeric_limits", "true",
                           "false"})


def is_pure(expr: str) -> bool:
    """Whether `expr` computes from its temporaries and literals alone (no load, loop variable,
    accumulator or kernel argument)."""
    text = NUMBER.sub(" ", TEMPORARY.sub(" ", expr))
    for m in NAME.finditer(text):
        if m.group(0) not in LITERAL_WORDS and not text[m.end():].lstrip().startswith("("):
            return False
    return True


def tabulate(lines: list, bf16_values: set) -> tuple[list, list]:
    """(the kernel's lines with the outermost function of each bf16 value looked up in a table,
    the tables' definitions: C++ blocks to put before the kernel). `lines`: (indent, text);
    `bf16_values`: the temporaries holding bf16 values (loaded or rounded)."""
    defs = {}  # temporary -> (line index, expression, comment)
    for i, (_, text) in enumerate(lines):
        m = DEFINITION.match(text)
        if m:
            defs[m.group(1)] = (i, m.group(2), m.group(3) or "")
    source = {}  # temporary -> the bf16 value it is a function of
    for name, (_, expr, _) in defs.items():
        operands = TEMPORARY.findall(expr)
        if operands and is_pure(expr):
            of = {source.get(t) for t in operands}
            if len(of) == 1 and None not in of:
                source[name] = of.pop()
        if name not in source and name in bf16_values:
            source[name] = name
    tables, lines = [], list(lines)
    chosen = set()
    for name in sorted((n for n in source if source[n] != n and n in bf16_values), key=lambda n: -defs[n][0]):
        closure = _closure(name, source[name], defs)
        calls = {c for t in closure for c in CALLS.findall(defs[t][1])}
        if not calls & TABLE_WORTHY or any(name in _closure(c, source[c], defs) for c in chosen):
            continue  # (cheap, or within a value already looked up)
        chosen.add(name)
        table, block = _table(name, source[name], closure, defs)
        tables.append(block)
        i, _, comment = defs[name]
        indent = lines[i][0]
        lines[i] = (indent, f"float {name} = {table}[fl_bits({source[name]}) >> 16];{comment}")
    return lines, tables


def _closure(name, leaf, defs) -> list:
    """The temporaries computing `name` from `leaf` (not `leaf` itself), in line order."""
    seen, todo = set(), [name]
    while todo:
        t = todo.pop()
        if t in seen or t == leaf:
            continue
        seen.add(t)
        todo += TEMPORARY.findall(defs[t][1])
    return sorted(seen, key=lambda t: defs[t][0])


def _table(name, leaf, closure, defs) -> tuple[str, str]:
    """(the table's name, its definition and the function filling it) for `name` of `leaf`."""
    renamed = {leaf: "v"} | {t: f"v{k}" for k, t in enumerate(closure)}

    def body(t):
        return TEMPORARY.sub(lambda m: renamed[m.group(0)], defs[t][1])
    key = hashlib.sha1(";".join(body(t) for t in closure).encode()).hexdigest()[:16]
    table = f"fl_table_{key}"
    comment = defs[name][2].strip()
    lines = [f"#ifndef {table.upper()}", f"#define {table.upper()}",
             f"// {comment[3:] if comment else name}: a function of one bf16 value (codegen/cpp_tables.py)",
             f"static float {table}[65536];",
             f"__attribute__((constructor)) static void {table}_fill() {{",
             "    #pragma omp simd",
             "    for (int64_t i = 0; i < 65536; i++) {",
             "        float v = fl_float(uint32_t(i) << 16);"]
    lines += [f"        float {renamed[t]} = {body(t)};" for t in closure]
    lines += [f"        {table}[i] = {renamed[name]};", "    }", "}", "#endif"]
    return table, "\n".join(lines) + "\n"
