"""Quick fixes for graph breaks: libcst rewrites (comments and formatting kept), each verified
with the abstract-domain analysis before it is offered.

A rewrite is offered only when the rewritten source parses and the function it touches captures
with fewer graph breaks, with no function gaining any. It is marked *preferred* only when it
keeps the function's semantics (the values it returns and its side effects in eager mode and
under compilation); the others are offered as plain quick fixes, like ruff's unsafe fixes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from .analysis import SUPPRESS_RE, count_breaks, lines_with_ends, run_analysis, split_lines

PRINT_CODES = {"FL100", "FL101"}
ITEM_CODE = "FL110"
IF_CODE = "FL120"

ARITH_OPS = (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo,
             cst.Power, cst.MatrixMultiply)
AUG_OPS = (cst.AddAssign, cst.SubtractAssign, cst.MultiplyAssign, cst.DivideAssign,
           cst.FloorDivideAssign, cst.ModuloAssign, cst.PowerAssign)
BOOL_METHODS = {"any", "all", "isnan", "isinf", "isfinite", "bool", "logical_and", "logical_or",
                "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "isclose", "signbit"}


@dataclass
class Fix:
    title: str
    code: str
    new_source: str | None        # None for a plain text edit (suppression)
    preferred: bool
    edit: tuple | None = None     # (line0, col, line0, col, text) for text edits
    breaks_before: int = 0
    breaks_after: int = 0


class NoFix(Exception):
    pass


def _char_col(lines: list[str], line: int, byte_col: int) -> int:
    """ast gives UTF-8 byte columns; libcst gives code points."""
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    if text.isascii():
        return byte_col
    return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


class _Tree:
    def __init__(self, source: str):
        self.source = source
        self.lines = split_lines(source)
        self.module = cst.parse_module(source)
        self.wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
        self.pos = self.wrapper.resolve(PositionProvider)
        self.parent = self.wrapper.resolve(ParentNodeProvider)

    def span(self, node):
        r = self.pos[node]
        return (r.start.line, r.start.column), (r.end.line, r.end.column)

    def nodes_covering(self, start, end, types):
        """Nodes of `types` whose span contains [start, end], innermost first."""
        out = []
        for node, r in self.pos.items():
            if isinstance(node, types):
                s, e = (r.start.line, r.start.column), (r.end.line, r.end.column)
                if s <= start and end <= e:
                    out.append((node, s, e))
        out.sort(key=lambda t: (t[1], (-t[2][0], -t[2][1])), reverse=True)
        return [n for n, _, _ in out]

    def ancestors(self, node):
        while node in self.parent:
            node = self.parent[node]
            yield node

    def enclosing_function(self, node):
        for a in self.ancestors(node):
            if isinstance(a, cst.FunctionDef):
                return a
        return None


def _torch_name(module: cst.Module) -> str | None:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for s in stmt.body:
                if isinstance(s, cst.Import):
                    for alias in s.names:
                        if cst.helpers.get_full_name_for_node(alias.name) == "torch":
                            return alias.asname.name.value if alias.asname else "torch"
    return None


def _ensure_torch_import(module: cst.Module) -> tuple[cst.Module, str]:
    name = _torch_name(module)
    if name:
        return module, name
    body = list(module.body)
    idx = 0
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and any(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
            idx = i + 1
        elif i == 0 and isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr) \
                and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
            idx = 1
    body.insert(idx, cst.parse_statement("import torch\n"))
    return module.with_changes(body=body), "torch"


class _Replace(cst.CSTTransformer):
    def __init__(self, target, replacement):
        self.target = target
        self.replacement = replacement

    def on_leave(self, original, updated):
        if original is self.target:
            return self.replacement
        return updated


def _replace(module, target, replacement) -> cst.Module:
    return module.visit(_Replace(target, replacement))


# ---------------------------------------------------------------- the rewrites

#: calls that only report (their statement may be skipped under compilation)
_REPORTING = {"print", "debug", "info", "warning", "warn", "error", "critical", "exception", "log",
              "warning_once", "info_once"}


def _reports(call: cst.Call) -> bool:
    f = call.func
    name = f.value if isinstance(f, cst.Name) else f.attr.value if isinstance(f, cst.Attribute) else None
    return name in _REPORTING


def rewrite_guard_side_effect(tree: _Tree, start, end, only_reporting: bool = False) -> str:
    """`print(...)` / `logger.info(...)` statement → guarded by `if not torch.compiler.is_compiling():`.
    `only_reporting`: the break lies in the call's arguments (`print(loss.item())`), so only a
    statement that just reports is guarded."""
    for stmt in tree.nodes_covering(start, end, cst.SimpleStatementLine):
        if len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) and isinstance(stmt.body[0].value, cst.Call) \
                and (not only_reporting or _reports(stmt.body[0].value)):
            module, torch_name = _ensure_torch_import(tree.module)
            guarded = cst.If(
                test=cst.parse_expression(f"not {torch_name}.compiler.is_compiling()"),
                body=cst.IndentedBlock(body=[stmt.with_changes(leading_lines=[])]),
                leading_lines=stmt.leading_lines)
            # _ensure_torch_import returns a new module whose unchanged statements are the same
            # objects, so the target is still found by identity.
            return _replace(module, stmt, guarded).code
    raise NoFix("the call is not a statement of its own" + (" that prints or logs" if only_reporting else ""))


def rewrite_guard_reporting(tree: _Tree, start, end) -> str:
    """A break in the arguments of a print or logging call (`print(loss.item())`): the call,
    guarded."""
    return rewrite_guard_side_effect(tree, start, end, only_reporting=True)


def _is_item_call(node) -> bool:
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "item" and not node.args)


def _arith_use(tree: _Tree, name_node) -> bool:
    p = tree.parent.get(name_node)
    if isinstance(p, cst.BinaryOperation) and isinstance(p.operator, ARITH_OPS):
        return True
    if isinstance(p, cst.UnaryOperation) and isinstance(p.operator, (cst.Minus, cst.Plus)):
        return True
    if isinstance(p, cst.AugAssign) and isinstance(p.operator, AUG_OPS) and p.value is name_node:
        return True
    return False


def rewrite_item(tree: _Tree, start, end) -> str:
    """`t.item()` used only in tensor arithmetic → `t` (the 0-d tensor)."""
    calls = [c for c in tree.nodes_covering(start, end, cst.Call) if _is_item_call(c)]
    if not calls:
        # the break may cover only `.item` or the whole call; look inside the range too
        for node, r in tree.pos.items():
            if _is_item_call(node) and (r.start.line, r.start.column) >= start \
                    and (r.end.line, r.end.column) <= end:
                calls.append(node)
    if not calls:
        raise NoFix("no `.item()` call here")
    call = calls[0]
    inner = call.func.value
    parent = tree.parent.get(call)
    if _arith_use(tree, call):
        return _replace(tree.module, call, inner.with_changes(
            lpar=call.lpar or inner.lpar, rpar=call.rpar or inner.rpar)).code
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 \
            and isinstance(parent.targets[0].target, cst.Name):
        var = parent.targets[0].target.value
        fn = tree.enclosing_function(call)
        if fn is None:
            raise NoFix("not inside a function")
        uses, assigns = [], 0
        for node in tree.pos:
            if isinstance(node, cst.Name) and node.value == var and tree.enclosing_function(node) is fn:
                p = tree.parent.get(node)
                if isinstance(p, cst.AssignTarget) or (isinstance(p, cst.AugAssign) and p.target is node):
                    assigns += 1
                    if isinstance(p, cst.AugAssign):
                        raise NoFix(f"`{var}` is updated in place")
                elif isinstance(p, cst.Attribute) and p.attr is node:
                    continue  # `obj.var` is another name
                else:
                    uses.append(node)
        if assigns != 1:
            raise NoFix(f"`{var}` is assigned more than once")
        if not uses:
            raise NoFix(f"`{var}` is not used")
        if not all(_arith_use(tree, u) for u in uses):
            raise NoFix(f"`{var}` is used outside tensor arithmetic")
        return _replace(tree.module, call, inner).code
    raise NoFix("the value is used outside tensor arithmetic")


def _compile_decorated(fn: cst.FunctionDef) -> bool:
    """`fn`'s only decorator compiles it (`@torch.compile`, `@torch.compile(...)`, `@fuselens.compile`)."""
    if len(fn.decorators) != 1:
        return False
    d = fn.decorators[0].decorator
    name = cst.helpers.get_full_name_for_node(d.func if isinstance(d, cst.Call) else d) or ""
    return name.split(".")[-1] == "compile"


def _returns_only_at_tail(fn: cst.FunctionDef) -> bool:
    """No `return` or `yield` in `fn` (nested functions aside) except a last top-level `return`."""
    tail = fn.body.body[-1] if fn.body.body else None
    tail_return = tail.body[0] if isinstance(tail, cst.SimpleStatementLine) and len(tail.body) == 1 \
        and isinstance(tail.body[0], cst.Return) else None
    found = []

    class V(cst.CSTVisitor):
        def visit_FunctionDef(self, n):
            return n is fn

        def visit_Lambda(self, n):
            return False

        def visit_Return(self, n):
            if n is not tail_return:
                found.append(n)

        def visit_Yield(self, n):
            found.append(n)

        def visit_Await(self, n):
            found.append(n)
    fn.visit(V())
    return not found


def _fresh(taken: set[str], base: str) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def _forwarding_args(params: cst.Parameters) -> list[cst.Arg]:
    """Arguments that pass a function's parameters on unchanged."""
    args = [cst.Arg(cst.Name(p.name.value)) for p in params.posonly_params + params.params]
    if isinstance(params.star_arg, cst.Param):
        args.append(cst.Arg(cst.Name(params.star_arg.name.value), star="*"))
    tight = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
    args += [cst.Arg(cst.Name(p.name.value), keyword=cst.Name(p.name.value), equal=tight)
             for p in params.kwonly_params]
    if params.star_kwarg is not None:
        args.append(cst.Arg(cst.Name(params.star_kwarg.name.value), star="**"))
    return args


_LITERALS = (cst.SimpleString, cst.ConcatenatedString, cst.Integer, cst.Float)


def rewrite_log_after_step(tree: _Tree, start, end) -> str:
    """`log.info("loss %f", loss.item())` in a function compiled by its decorator → the compiled
    part (renamed) keeps `loss.detach()` and returns it beside its result; an uncompiled wrapper
    with the original name and parameters calls it and logs `.item()` of the kept tensor after
    the step. Only for a top-level logging statement whose arguments are literals and
    `.item()` calls, in a function with at most one `return`, its last statement."""
    stmt = next((s for s in tree.nodes_covering(start, end, cst.SimpleStatementLine)
                 if len(s.body) == 1 and isinstance(s.body[0], cst.Expr)
                 and isinstance(s.body[0].value, cst.Call) and _reports(s.body[0].value)), None)
    if stmt is None:
        raise NoFix("the `.item()` is not in a statement that only prints or logs")
    fn = tree.parent.get(tree.parent.get(stmt))
    if not (isinstance(fn, cst.FunctionDef) and isinstance(tree.parent.get(fn), cst.Module)):
        raise NoFix("the statement is not at the top level of a module-level function")
    if fn.asynchronous is not None or not _compile_decorated(fn) or not _returns_only_at_tail(fn):
        raise NoFix("the function is not a plain compiled function with one return at its end")
    call = stmt.body[0].value
    if any(a.star for a in call.args):
        raise NoFix("the call unpacks arguments")
    items = [a.value for a in call.args if _is_item_call(a.value)]
    if not items or not all(_is_item_call(a.value) or isinstance(a.value, _LITERALS) for a in call.args):
        raise NoFix("the call logs more than literals and `.item()` values")
    local = _names_in(fn.params) | {n.target.value for n in tree.pos if isinstance(n, cst.AssignTarget)
                                    and isinstance(n.target, cst.Name) and tree.enclosing_function(n) is fn}
    root = call.func
    while isinstance(root, cst.Attribute):
        root = root.value
    if not isinstance(root, cst.Name) or root.value in local:
        raise NoFix("the logger is not a module-level name")

    taken = _names_in(tree.module)
    compiled_name = _fresh(taken, f"_{fn.name.value}_compiled")
    kept, result = _fresh(taken, "logged"), _fresh(taken, "result")
    detached = [cst.Call(func=cst.Attribute(value=c.func.value, attr=cst.Name("detach"))) for c in items]
    kept_value = detached[0] if len(detached) == 1 else cst.Tuple([cst.Element(d) for d in detached])
    # the statement's comments move with the logging call to the wrapper
    keep = cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(kept))], value=kept_value)],
                                   leading_lines=[e for e in stmt.leading_lines if e.comment is None])
    body = [keep if s is stmt else s for s in fn.body.body]
    tail = body[-1]
    returned = tail.body[0].value if isinstance(tail, cst.SimpleStatementLine) \
        and isinstance(tail.body[0], cst.Return) else None
    if returned is None:
        returned = cst.Name("None")
    elif isinstance(returned, cst.Tuple) and not returned.lpar:
        returned = returned.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    both = cst.Return(cst.Tuple([cst.Element(returned), cst.Element(cst.Name(kept))], lpar=[], rpar=[]))
    if isinstance(tail, cst.SimpleStatementLine) and isinstance(tail.body[0], cst.Return):
        body[-1] = tail.with_changes(body=[both])
    else:
        body.append(cst.SimpleStatementLine(body=[both]))
    compiled = fn.with_changes(name=cst.Name(compiled_name), body=fn.body.with_changes(body=body))

    reads = iter([cst.Call(func=cst.Attribute(value=cst.Subscript(cst.Name(kept), [cst.SubscriptElement(
        cst.Index(cst.Integer(str(i))))]) if len(items) > 1 else cst.Name(kept), attr=cst.Name("item")))
        for i in range(len(items))])
    logged_call = call.with_changes(args=[a.with_changes(value=next(reads)) if _is_item_call(a.value) else a
                                          for a in call.args])
    wrapper = cst.FunctionDef(
        name=fn.name, params=fn.params, returns=fn.returns,
        leading_lines=[cst.EmptyLine(), cst.EmptyLine()],
        body=cst.IndentedBlock(body=[
            cst.SimpleStatementLine(body=[cst.Assign(
                targets=[cst.AssignTarget(cst.Tuple([cst.Element(cst.Name(result)), cst.Element(cst.Name(kept))],
                                                    lpar=[], rpar=[]))],
                value=cst.Call(func=cst.Name(compiled_name), args=_forwarding_args(fn.params)))]),
            stmt.with_changes(body=[cst.Expr(logged_call)]),
            cst.SimpleStatementLine(body=[cst.Return(cst.Name(result))])]))
    return _replace(tree.module, fn, cst.FlattenSentinel([compiled, wrapper])).code


def rewrite_backward_tail(tree: _Tree, start, end) -> str:
    """`loss.backward()` as the function's last statement (or just before `return loss`) →
    removed, the function returning `loss`, so that its callers run the backward pass outside
    the compiled function. Only where no other `return` or `yield` exists, `backward` takes
    no arguments and the function returned `loss` or nothing."""
    stmt = next((s for s in tree.nodes_covering(start, end, cst.SimpleStatementLine)
                 if len(s.body) == 1 and isinstance(s.body[0], cst.Expr)), None)
    call = stmt.body[0].value if stmt is not None else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "backward" and isinstance(call.func.value, cst.Name) and not call.args):
        raise NoFix("not a statement `loss.backward()` on a name")
    loss = call.func.value.value
    fn = tree.parent.get(tree.parent.get(stmt))
    if not isinstance(fn, cst.FunctionDef) or fn.asynchronous is not None or not _returns_only_at_tail(fn):
        raise NoFix("the function returns elsewhere or is not a plain function")
    body = list(fn.body.body)
    i = body.index(stmt)
    rest = body[i + 1:]
    returns_loss = cst.SimpleStatementLine(body=[cst.Return(cst.Name(loss))], leading_lines=stmt.leading_lines,
                                           trailing_whitespace=stmt.trailing_whitespace)
    if not rest:
        body[i] = returns_loss
    elif len(rest) == 1 and isinstance(rest[0], cst.SimpleStatementLine) and len(rest[0].body) == 1 \
            and isinstance(rest[0].body[0], cst.Return) and (rest[0].body[0].value is None or (
                isinstance(rest[0].body[0].value, cst.Name) and rest[0].body[0].value.value in (loss, "None"))):
        body[i:] = [rest[0].with_changes(body=[cst.Return(cst.Name(loss))],
                                         leading_lines=list(stmt.leading_lines) + list(rest[0].leading_lines))]
    else:
        raise NoFix("`backward()` is not the function's tail")
    return _replace(tree.module, fn, fn.with_changes(body=fn.body.with_changes(body=body))).code


def _names_in(node) -> set[str]:
    out = set()

    class V(cst.CSTVisitor):
        def visit_Name(self, n):
            out.add(n.value)
    node.visit(V())
    return out


def _branch_assigns(block) -> list[tuple[str, cst.BaseExpression, cst.SimpleStatementLine]]:
    if not isinstance(block, cst.IndentedBlock):
        raise NoFix("the branch is not a block")
    out, seen = [], set()
    for stmt in block.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            raise NoFix("a branch holds more than assignments")
        for s in stmt.body:
            if isinstance(s, cst.Pass):
                continue
            if not (isinstance(s, cst.Assign) and len(s.targets) == 1
                    and isinstance(s.targets[0].target, cst.Name)):
                raise NoFix("a branch holds more than assignments to names")
            var = s.targets[0].target.value
            if var in seen:
                raise NoFix(f"`{var}` is assigned twice in one branch")
            if _names_in(s.value) & seen:
                raise NoFix("an assignment uses a variable assigned earlier in the same branch")
            seen.add(var)
            out.append((var, s.value, stmt))
    return out


def _bool_cond(test: cst.BaseExpression) -> cst.BaseExpression:
    """The condition as a bool tensor, as `torch.where` needs it."""
    if isinstance(test, cst.Comparison):
        return test.with_changes(lpar=[], rpar=[])
    if isinstance(test, cst.Call) and isinstance(test.func, cst.Attribute) \
            and test.func.attr.value in BOOL_METHODS:
        return test
    if isinstance(test, (cst.BinaryOperation, cst.BooleanOperation, cst.UnaryOperation, cst.Comparison)):
        test = test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.Call(func=cst.Attribute(value=test, attr=cst.Name("bool")))


def rewrite_where(tree: _Tree, start, end) -> str:
    """`if cond: a = e1 else: a = e2` (assignments from tensor expressions only) →
    `a = torch.where(cond, e1, e2)`."""
    ifs = tree.nodes_covering(start, end, cst.If)
    if not ifs:
        raise NoFix("no if statement here")
    node = ifs[0]
    if isinstance(tree.parent.get(node), cst.If):
        raise NoFix("elif chains are not rewritten")
    if node.orelse is not None and not isinstance(node.orelse, cst.Else):
        raise NoFix("elif chains are not rewritten")
    then = _branch_assigns(node.body)
    other = _branch_assigns(node.orelse.body) if node.orelse is not None else []
    then_vars = [v for v, _, _ in then]
    other_map = {v: (e, s) for v, e, s in other}
    if node.orelse is not None and set(then_vars) != set(other_map):
        raise NoFix("the branches assign different variables")
    if not then:
        raise NoFix("the branches assign nothing")
    if node.orelse is None:
        fn = tree.enclosing_function(node)
        # `if c: x = e` needs x bound before the if: a parameter or an earlier assignment
        before = set()
        if fn is not None:
            before |= {p.name.value for p in fn.params.params + fn.params.posonly_params + fn.params.kwonly_params}
            for n, r in tree.pos.items():
                if isinstance(n, cst.AssignTarget) and isinstance(n.target, cst.Name) \
                        and tree.enclosing_function(n) is fn and r.end.line < tree.pos[node].start.line:
                    before.add(n.target.value)
        missing = [v for v in then_vars if v not in before]
        if missing:
            raise NoFix(f"`{missing[0]}` has no value when the condition is false")
    module, torch_name = _ensure_torch_import(tree.module)
    cond = _bool_cond(node.test)
    stmts: list = []
    lead = list(node.leading_lines)
    if len(then) > 1:
        taken = _names_in(tree.module)
        cname, i = "cond", 1
        while cname in taken:
            cname, i = f"cond_{i}", i + 1
        stmts.append(cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(cname))], value=cond)],
            leading_lines=lead))
        lead = []
        cond_expr = cst.Name(cname)
    else:
        cond_expr = cond
    for var, e1, s1 in then:
        e2, s2 = other_map[var] if node.orelse is not None else (cst.Name(var), None)
        call = cst.Call(func=cst.parse_expression(f"{torch_name}.where"),
                        args=[cst.Arg(cond_expr), cst.Arg(e1), cst.Arg(e2)])
        comments = lead + list(s1.leading_lines) + (list(s2.leading_lines) if s2 is not None else [])
        lead = []
        stmts.append(cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(var))], value=call)],
            leading_lines=comments, trailing_whitespace=s1.trailing_whitespace))
    return _replace(module, node, cst.FlattenSentinel(stmts)).code


def suppression_edit(lines: list[str], line: int, code: str) -> tuple:
    """Adds `# fuselens: ignore[CODE]` to the 1-based `line` (or the code to an existing list)."""
    text = lines[line - 1]
    m = SUPPRESS_RE.search(text)
    if m and m.group("codes") is not None:
        codes = [c.strip() for c in m.group("codes").split(",") if c.strip()]
        if code in codes:
            raise NoFix("already suppressed")
        new = f"# fuselens: ignore[{', '.join(codes + [code])}]"
        return (line - 1, m.start(), line - 1, m.end(), new)
    if m:
        raise NoFix("already suppressed")
    stripped = text.rstrip()
    return (line - 1, len(stripped), line - 1, len(text), f"  # fuselens: ignore[{code}]")


_GUARD = "Guard with `if not torch.compiler.is_compiling():`"
#: code -> the rewrites tried, each offered when it leaves the function with fewer breaks
REWRITES = {
    "FL100": [(_GUARD, rewrite_guard_side_effect, False)],
    "FL101": [(_GUARD, rewrite_guard_side_effect, False)],
    "FL110": [("Keep the 0-d tensor (drop `.item()`)", rewrite_item, True),
              (_GUARD, rewrite_guard_reporting, False),
              ("Log after the step: the compiled part returns the value `.detach()`ed, an uncompiled "
               "wrapper logs it (logs after the whole step)", rewrite_log_after_step, False)],
    "FL111": [(_GUARD, rewrite_guard_reporting, False)],
    "FL113": [(_GUARD, rewrite_guard_reporting, False)],
    "FL120": [("Select with `torch.where` instead of branching", rewrite_where, False)],
    "FL152": [("Move `backward()` out: the function returns the loss and callers must call "
               "`.backward()` on it", rewrite_backward_tail, False)],
}


def fixes_for_break(source: str, filename: str, brk: dict, qualname: str,
                    before: dict[str, int] | None = None) -> list[Fix]:
    """Fixes for one break (`brk` in the JSON form of `analysis.break_json`, 0-based lines)."""
    out: list[Fix] = []
    lines = split_lines(source)
    code = brk["code"]
    line, end_line = brk["line"] + 1, brk["endLine"] + 1
    for title, fn, preferred in REWRITES.get(code, ()):
        try:
            tree = _Tree(source)
            start = (line, _char_col(lines, line, brk["col"]))
            end = (end_line, _char_col(lines, end_line, brk["endCol"]))
            new_source = fn(tree, start, end)
        except (NoFix, cst.ParserSyntaxError):
            new_source = None
        except Exception:  # a rewrite bug must cost the fix, never the request
            logging.getLogger("fuselens_lsp").exception("rewrite for %s failed", code)
            new_source = None
        if new_source is not None and new_source != source:
            if before is None:
                analysis, err, _ = run_analysis(source, filename)
                before = count_breaks(analysis) if analysis is not None and err is None else None
            if before is not None:
                try:
                    after_an, err, _ = run_analysis(new_source, filename)
                except Exception:
                    logging.getLogger("fuselens_lsp").exception("analysis of the rewritten file failed")
                    after_an, err = None, True
                if after_an is not None and err is None:
                    after = count_breaks(after_an)
                    # a function the rewrite adds (a compiled part split off) counts as the rewritten one
                    b0 = before.get(qualname, 0)
                    b1 = after.get(qualname, 10**9) + sum(n for q, n in after.items() if q not in before)
                    no_worse = all(after.get(q, 0) <= n for q, n in before.items() if q in after)
                    if b1 < b0 and no_worse:
                        out.append(Fix(f"fuselens: {title}", code, new_source, preferred,
                                       breaks_before=b0, breaks_after=b1))
    try:
        edit = suppression_edit(lines, line, code)
        out.append(Fix(f"fuselens: Suppress {code} on this line (`# fuselens: ignore[{code}]`)", code,
                       None, False, edit=edit))
    except NoFix:
        pass
    return out


def minimal_edit(old: str, new: str) -> tuple[int, int, str]:
    """(first_line, end_line_exclusive, replacement) covering the changed lines, 0-based."""
    a, b = lines_with_ends(old), lines_with_ends(new)
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[len(a) - 1 - j] == b[len(b) - 1 - j]:
        j += 1
    repl = b[i:len(b) - j]
    return i, len(a) - j, "".join(repl)
