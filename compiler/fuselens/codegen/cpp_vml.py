"""Eager's own routines for the float32 ops a user calls alone (`torch.erf`, `torch.tanh`,
`torch.exp`, `torch.log`, `torch.sin`, `torch.cos`), in C++ kernels.

On x86-64, eager computes such an op of a float32 tensor with MKL's vector math library (VML),
which libtorch_cpu exports (`vmsErf`, ...): called with eager's mode (high accuracy, denormals
kept, errors ignored) on any chunk of the elements, its results are eager's bit for bit, where
SLEEF's vector routines differ on 0.6-7% of them by an ulp; and it is faster (tanh of 4M floats
on one thread: 1.9 ms in calls of 1024 elements, SLEEF's 16 lanes 6.1 ms). The same math inside a
composite op (GeLU's erf, softmax's exp) is eager's vectorised ATen code, which the kernels keep:
the primitive's node says which (ops/primitives.py `cpp_alone`), and the kernel line of an op
called alone is `fl_vml_<op>(x)`, which by itself (cpp_build.py's preamble) is the composite's.

VML works on arrays, a kernel's loop on one element an iteration: `chunked` rewrites each
innermost vectorised loop that calls it into chunks of CHUNK iterations, each a loop computing
the calls' arguments into arrays, the VML calls on them, then the loop's own body reading the
arrays (a call on another's result: one more such phase first).
"""
from __future__ import annotations

import re

from .cpp_expressions import TEMPORARY

CHUNK = 1024  # elements of one VML call (a multiple of the float sums' chunk: their lanes restart there)
# torch op -> MKL's routine of float32 arrays
ROUTINES = {"erf": "vmsErf", "tanh": "vmsTanh", "exp": "vmsExp", "log": "vmsLn", "sin": "vmsSin", "cos": "vmsCos"}
# ATen's mode: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
MODE = "0x140102LL"
# the kernels' library: the routines, and each op alone as its composites compute it (a loop not
# walked in chunks)
PREAMBLE = "// float32 ops called alone: MKL's routines on chunks (codegen/cpp_vml.py), else SLEEF's\n" + "".join(
    f'extern "C" void {r}(long long n, const float* a, float* r, long long mode);\n#define fl_vml_{op}(x) fl_{op}(x)\n'
    for op, r in ROUTINES.items())

PRAGMA = re.compile(r"^#pragma omp (parallel for )?simd(.*)$")
FOR = re.compile(r"^for \(int64_t (\w+) = (.+); \1 < (.+); \1\+\+\) \{$")
DEFINITION = re.compile(r"^[\w:]+ (tmp\d+) = (.*?);(?:  //.*)?$")
CALL = re.compile(r"^float (tmp\d+) = fl_vml_(\w+)\((.*)\);((?:  //.*)?)$")
REDUCTION = re.compile(r" reduction\([^)]*\)")


def available() -> bool:
    """Whether libtorch_cpu exports MKL's routines (x86-64 builds with MKL)."""
    from .cpp_build import libtorch_exports  # (cpp_build imports this module for its preamble)
    return libtorch_exports(*ROUTINES.values())


def chunked(lines: list) -> list:
    """The kernel's lines ((indent, text)) with each innermost vectorised loop that calls an op
    alone (`fl_vml_<op>`) walked in chunks that call MKL's routine (module docstring)."""
    out, i = [], 0
    while i < len(lines):
        loop = _loop_at(lines, i)
        if loop is None:
            out.append(lines[i])
            i += 1
            continue
        end, rewritten = loop
        out += rewritten
        i = end
    return out


def _loop_at(lines, i):
    """(index after the loop, its rewritten lines) where lines[i] is the pragma of an innermost
    vectorised loop of straight-line code that calls an op alone, else None."""
    pragma = PRAGMA.match(lines[i][1])
    if pragma is None or i + 1 >= len(lines) or lines[i + 1][0] != lines[i][0]:
        return None
    header = FOR.match(lines[i + 1][1])
    if header is None:
        return None
    indent, end = lines[i][0], i + 2
    while end < len(lines) and lines[end][0] > indent:
        end += 1
    body = lines[i + 2:end]
    if end == len(lines) or lines[end] != (indent, "}") or \
            any(text.endswith("{") or text == "}" for _, text in body):
        return None
    calls = [m for _, text in body if (m := CALL.match(text)) and m.group(2) in ROUTINES]
    if not calls:
        return None
    return end + 1, _phases(indent, pragma, header, body, calls)


def _phases(indent, pragma, header, body, calls):
    v, start, stop = header.groups()
    parallel, clauses = pragma.group(1) is not None, pragma.group(2)
    reductions = "".join(REDUCTION.findall(clauses))
    k, e = f"{v}k", f"{v}e"
    buffer = {m.group(1): f"fl_vml{n}" for n, m in enumerate(calls)}
    defs = {}
    for _, text in body:
        m = DEFINITION.match(text)
        if m:
            defs[m.group(1)] = m.group(2)

    levels: dict = {}  # temporary -> the calls on its path (a call's result: its phase)
    for t, expr in defs.items():  # (in line order: operands first)
        levels[t] = max((levels[d] for d in TEMPORARY.findall(expr) if d in levels), default=0) + (t in buffer)

    def read(text):  # a call's line: its result read from its array
        m = CALL.match(text)
        return f"float {m.group(1)} = {buffer[m.group(1)]}[{v} - {k}];{m.group(4)}" if m and m.group(1) in buffer \
            else text

    def needed(roots):
        """The temporaries of the loop computing `roots` (expressions); a call's result is read."""
        seen, todo = set(), [t for r in roots for t in TEMPORARY.findall(r)]
        while todo:
            t = todo.pop()
            if t in seen or t not in defs:
                continue
            seen.add(t)
            if t not in buffer:
                todo += TEMPORARY.findall(defs[t])
        return seen

    # each call's argument: an array of its own where no other call's result holds it, one for
    # the calls of a phase on the same expression (tanh(x) and cos(x) read one copy of x)
    args = {}
    for m in calls:
        arg = m.group(3)
        if arg not in args:
            args[arg] = buffer[arg] if arg in buffer else f"fl_vml_in{len(args)}"
    out = [(indent, f"#pragma omp parallel for{clauses}")] if parallel else []
    out += [(indent, f"for (int64_t {k} = {start}; {k} < {stop}; {k} += {CHUNK}) {{"),
            (indent + 1, f"int64_t {e} = {k} + {CHUNK} < {stop} ? {k} + {CHUNK} : {stop};")]
    out += [(indent + 1, f"float {b}[{CHUNK}];") for b in dict.fromkeys([*buffer.values(), *args.values()])]
    for phase in sorted({levels[m.group(1)] for m in calls}):
        now = [m for m in calls if levels[m.group(1)] == phase]
        copied = [a for a in dict.fromkeys(m.group(3) for m in now) if a not in buffer]
        if copied:
            keep = needed(copied)
            out += [(indent + 1, "#pragma omp simd"), (indent + 1, f"for (int64_t {v} = {k}; {v} < {e}; {v}++) {{")]
            out += [(indent + 2, read(text)) for _, text in body if (d := DEFINITION.match(text)) and d.group(1) in keep]
            out += [(indent + 2, f"{args[a]}[{v} - {k}] = {a};") for a in copied]
            out.append((indent + 1, "}"))
        out += [(indent + 1, f"{ROUTINES[m.group(2)]}({e} - {k}, {args[m.group(3)]}, {buffer[m.group(1)]}, {MODE});")
                for m in now]
    out += [(indent + 1, f"#pragma omp simd{reductions}"), (indent + 1, f"for (int64_t {v} = {k}; {v} < {e}; {v}++) {{")]
    # the loop's own body, less what only the calls' arguments needed
    keep = needed([text for _, text in body if not DEFINITION.match(text)])
    out += [(indent + 2, read(text)) for _, text in body if (d := DEFINITION.match(text)) is None or d.group(1) in keep]
    return out + [(indent + 1, "}"), (indent, "}")]
