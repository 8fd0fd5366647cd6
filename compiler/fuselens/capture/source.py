"""Where the evaluator's code comes from: a user function's source, or a generated resume
function. Locations always refer to the real file: `ast` nodes are shifted to the file's
line numbers and the columns of the (possibly indented) original text."""
from __future__ import annotations

import ast
import copy
import inspect
import itertools
import linecache
import os
import sysconfig
import textwrap
import types
from dataclasses import dataclass, field


class NoSourceError(ValueError):
    """The function has no Python source that fuselens can read."""


@dataclass
class FunctionSource:
    name: str
    qualname: str
    filename: str
    node: ast.FunctionDef | ast.Lambda  # locations are the file's real lines/cols
    globals: dict
    closure: dict = field(default_factory=dict)   # free variable name -> value
    defaults: dict = field(default_factory=dict)  # parameter name -> default value
    cells: dict = field(default_factory=dict)     # free variable name -> cell (guards read it)
    generated: bool = False  # a resume function fuselens wrote
    resume_depth: int = 0  # the resumes that led to it, each a nested call (statements._loop_break)
    compile_disabled: bool = False  # the editor's: decorated with `torch.compiler.disable`
    source_text: str = ""    # for `inspect`: the function's (transformed) source

    @property
    def params(self) -> ast.arguments:
        return self.node.args


# code object -> (its source, dedented; its definition's AST node, at the file's positions): each
# inlined call asked again (the lines, their dedent, the parse, the search of the file's tree for
# the definition: ~1 ms a function the first time)
_PARSED: dict = {}


def _parse_at(text: str, start: int) -> ast.Module:
    """`text`, the file's lines from line `start` on, parsed at the file's own lines and columns: an
    indented definition (a method) under an `if 1:` on the line before it (columns kept as they
    are, where a dedent would need every node shifted back: ~1 ms a function)."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first[:1] not in (" ", "\t"):
        return ast.parse("\n" * (start - 1) + text)
    if start > 1:
        return ast.parse("\n" * (start - 2) + "if 1:\n" + text)
    return ast.increment_lineno(ast.parse("if 1:\n" + text), -1)  # (indented at line 1: a cell's text)


def _parse_source(code, fn, lines, start):
    text = "".join(lines)
    try:
        tree = _parse_at(text, start)
    except SyntaxError:
        rest = linecache.getlines(code.co_filename)[start - 1:]
        block = inspect.getblock(rest) if rest[:len(lines)] == lines else lines
        if len(block) > len(lines):  # cut in a statement's middle (_ends_at): read as inspect does
            return _parse_source(code, fn, block, start)
        # a lambda in the middle of an expression: parse the whole file instead
        try:
            tree = ast.parse("".join(linecache.getlines(code.co_filename)))
        except SyntaxError as e:
            raise NoSourceError(f"cannot parse the source of {fn.__qualname__}: {e}") from None
    return textwrap.dedent(text), tree


def _find_def(tree: ast.AST, code: types.CodeType):
    best, lambdas = None, []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == code.co_name:
            first = n.decorator_list[0].lineno if n.decorator_list else n.lineno
            if first <= code.co_firstlineno <= n.lineno or n.lineno == code.co_firstlineno:
                return n
            best = best or n
        elif isinstance(n, ast.Lambda) and code.co_name == "<lambda>" and n.lineno == code.co_firstlineno:
            lambdas.append(n)
    return _which_lambda(lambdas, code) if lambdas else best


def _which_lambda(lambdas, code: types.CodeType):
    """The lambda `code` was compiled from, among those starting on its line (`lambda: lambda x: x`,
    `(lambda x: x + 1), (lambda x: x * 2)`): the innermost one with its parameter names whose
    body spans the column of the code's first body instruction (the prologue and return sit at
    column 0)."""
    names = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    same = [n for n in lambdas if [a.arg for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs] == names]
    cols = [col for line, _, col, _ in code.co_positions() if line == code.co_firstlineno and col]
    holds = lambda n, col: n.body.lineno == code.co_firstlineno and n.body.col_offset <= col and (
        n.body.end_lineno > code.co_firstlineno or col < n.body.end_col_offset)
    inside = [n for n in same if cols and holds(n, min(cols))]
    return max(inside, key=lambda n: n.body.col_offset, default=(same or lambdas)[0])


def function_source(fn) -> FunctionSource:
    """Source and AST of a Python function, with locations in its file. Raises NoSourceError."""
    code = getattr(fn, "__code__", None)
    if code is None:
        raise NoSourceError(f"{fn!r} is not a Python function (no __code__)")
    gen = getattr(fn, "__fl_source__", None)  # resume functions carry their own AST
    if isinstance(gen, FunctionSource):
        return gen
    found = _PARSED.get(code)
    if found is None:
        try:
            lines, start = _source_lines(code, getattr(fn, "__globals__", None))
        except (OSError, TypeError) as e:
            raise NoSourceError(f"no source for {getattr(fn, '__qualname__', fn)!r}: {e}") from None
        dedented, tree = _parse_source(code, fn, lines, start)
        node = _find_def(tree, code)
        if node is None:
            raise NoSourceError(f"cannot find the definition of {fn.__qualname__} in its source")
        if isinstance(node, ast.Lambda):  # `lambda args: expr` is `def f(args): return expr`
            node = ast.copy_location(ast.FunctionDef(
                name="__fl_lambda", args=node.args, body=[ast.copy_location(ast.Return(value=node.body), node.body)],
                decorator_list=[], returns=None, type_comment=None, type_params=[]), node)
            node.end_lineno, node.end_col_offset = node.body[0].end_lineno, node.body[0].end_col_offset
        found = _PARSED[code] = (dedented, node)
    dedented, node = found
    closure, cells = {}, {}
    if fn.__closure__:
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                closure[name] = cell.cell_contents
                cells[name] = cell
            except ValueError:  # empty cell: not yet assigned
                pass
    defaults = _defaults(node.args, fn)
    name = fn.__name__ if fn.__name__.isidentifier() else "__fl_lambda"  # `def <lambda>` is no syntax
    return FunctionSource(name, fn.__qualname__, code.co_filename, node, fn.__globals__, closure,
                          defaults, cells, source_text=dedented)


def _source_lines(code: types.CodeType, module_globals) -> tuple[list[str], int]:
    """inspect.getsourcelines(code) (the function itself, not what it wraps), without its search of
    sys.modules for the module that holds the file (inspect.getmodule: a scan of every loaded
    module per file, ~2 ms each with transformers loaded): the function's globals are that module's,
    and give linecache the loader of a file that is not on disk."""
    filename = _frozen_source(code.co_filename) or code.co_filename
    linecache.checkcache(filename)  # (a file edited since it was read: as inspect does)
    lines = linecache.getlines(filename, module_globals)
    if not lines:
        # `<frozen ...>` not in the standard library's folder, `<string>` (a dataclass's __init__):
        # no source, which inspect finds after its scan
        if filename.startswith("<"):
            raise OSError("could not get source code")
        return inspect.getsourcelines(code)
    start = code.co_firstlineno - 1  # the first decorator's line, or the `def`
    if start >= len(lines):
        raise OSError("lineno is out of bounds")
    end = _last_line(code)
    if end > start and _ends_at(lines, start, end):  # (inspect.getblock tokenizes the rest of the
        return lines[start:end], start + 1          # file to find the end: ~4 ms a function)
    return inspect.getblock(lines[start:]), start + 1


def _frozen_source(filename: str) -> str | None:
    """The standard library's file of a module Python runs frozen (`<frozen _collections_abc>`:
    Mapping's `get`, `__contains__`... that a user's mapping inherits), compiled from that very
    file: its methods are code like any other, evaluated on the user's objects."""
    if not filename.startswith("<frozen ") or not filename.endswith(">"):
        return None
    path = os.path.join(sysconfig.get_paths()["stdlib"], *filename[8:-1].split(".")) + ".py"
    return path if os.path.isfile(path) else None


def _last_line(code: types.CodeType) -> int:
    """The last line of the code's instructions and those of the code it defines (0 where Python
    keeps no positions)."""
    end = max((e for _, e, _, _ in code.co_positions() if e), default=0)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            end = max(end, _last_line(c))
    return end


def _ends_at(lines, start: int, end: int) -> bool:
    """Whether the definition on line `start` ends on line `end`: the next line of code is not
    indented deeper than its first (statements that compile to nothing, an unreachable `yield`
    that makes it a generator, come after its last instruction). A block cut in the middle of a
    statement does not parse, and is read again by inspect (_parse_source)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    for line in lines[end:]:
        text = line.strip()
        if text and not text.startswith("#"):
            return len(line) - len(line.lstrip()) <= indent
    return True


def _defaults(args: ast.arguments, fn) -> dict:
    out = {}
    pos = [a.arg for a in args.posonlyargs + args.args]
    if fn.__defaults__:
        for name, v in zip(pos[len(pos) - len(fn.__defaults__):], fn.__defaults__):
            out[name] = v
    if fn.__kwdefaults__:
        out.update(fn.__kwdefaults__)
    return out


def build_function(source: str, name: str, globals_: dict, consts: dict, code=None):
    """Compile generated source into a function whose globals are `globals_` (the user's
    module, untouched) and whose extra names come from `consts` through a closure. `code`: what
    factory_code made of these arguments (in this process or, marshalled, in another)."""
    code = code or factory_code(source, name, consts)
    return types.FunctionType(code, globals_)(*[consts[n] for n in sorted(consts)])


def function_with_source(source: str, name: str, globals_: dict, label: str):
    """The function `source` defines (`name`), compiled under a file name of its own whose lines
    linecache holds: capture reads its source as any function's (a local function made again
    from its source at a break, which its resume then inlines)."""
    filename = f"<fuselens {label} {next(_SOURCES)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), globals_, namespace)
    return namespace[name]


_SOURCES = itertools.count()


def factory_code(source: str, name: str, consts) -> types.CodeType:
    """The code of a function of `consts`' names that returns the function `source` defines."""
    names = sorted(consts)
    inner = "\n".join("    " + l for l in source.splitlines())
    factory = f"def __fl_factory({', '.join(names)}):\n{inner}\n    return {name}"
    code = compile(factory, f"<fuselens transformed {name}>", "exec")
    return next(c for c in code.co_consts if isinstance(c, types.CodeType))


def copy_ast(node):
    """A deep copy of `node` (the user's own nodes are not changed) whose carried values
    (`_fl_value`, a loop's remaining `_fl_items`: tensors, a graph's values among them) stay
    themselves: copied, they would be other objects, or a non-leaf tensor that cannot be."""
    keep = {id(v): v for n in ast.walk(node) for k in ("_fl_value", "_fl_items") if hasattr(n, k)
            for v in [getattr(n, k)]}
    return copy.deepcopy(node, keep)
