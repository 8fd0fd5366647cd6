"""Quick fixes end to end: the offered edit, and what the file looks like (and analyses to)
after applying it."""
from __future__ import annotations

import textwrap

import pytest
from lsprotocol import types as lsp

from fl_lsp_testing import apply_edits

pytestmark = pytest.mark.asyncio


async def actions_for(session, uri, diag):
    return await session.client.text_document_code_action_async(lsp.CodeActionParams(
        text_document=lsp.TextDocumentIdentifier(uri=uri), range=diag.range,
        context=lsp.CodeActionContext(diagnostics=[diag])))


def edits_of(action):
    (change,) = action.edit.document_changes
    return change.edits


async def fix_and_reanalyse(session, uri, src, code, title_part):
    diags = await session.diagnostics(uri)
    diag = next(d for d in diags if d.code == code)
    actions = await actions_for(session, uri, diag)
    action = next(a for a in actions if title_part in a.title)
    assert action.kind == lsp.CodeActionKind.QuickFix
    assert action.diagnostics and action.diagnostics[0].code == code
    new = apply_edits(src, edits_of(action))
    await session.change(uri, new)
    return action, new, await session.diagnostics(uri)


async def test_print_is_guarded_by_is_compiling(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x):
        y = x.sin()
        # show progress
        print("y", y.shape)  # debug
        return y * 2
    ''')
    await session.init()
    uri = await session.open("p.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL100", "is_compiling")
    assert new == src.replace(
        '    # show progress\n    print("y", y.shape)  # debug\n',
        '    # show progress\n    if not torch.compiler.is_compiling():\n        print("y", y.shape)  # debug\n')
    assert not action.is_preferred  # under compilation the print no longer runs
    assert "1 → 0 breaks" in action.title
    assert [d.code for d in diags] == []


async def test_logging_call_guard_adds_the_torch_import_when_aliased(session):
    src = textwrap.dedent('''\
    import logging
    import torch as th
    import fuselens

    log = logging.getLogger(__name__)


    @fuselens.compile
    def f(x):
        log.info("shape %s", x.shape)
        return x.relu()
    ''')
    await session.init()
    uri = await session.open("q.py", src)
    _, new, diags = await fix_and_reanalyse(session, uri, src, "FL101", "is_compiling")
    assert "    if not th.compiler.is_compiling():\n        log.info(" in new
    assert diags == []


async def test_item_in_tensor_arithmetic_keeps_the_tensor_and_is_preferred(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def scale(x, w):
        s = w.sum().item()  # a scalar
        return x * s + 1
    ''')
    await session.init()
    uri = await session.open("r.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL110", ".item()")
    assert new == src.replace("s = w.sum().item()  # a scalar", "s = w.sum()  # a scalar")
    assert action.is_preferred
    assert diags == []


async def test_item_used_outside_arithmetic_gets_no_rewrite(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x):
        n = x.sum().item()
        return x.new_zeros(int(n))
    ''')
    await session.init()
    uri = await session.open("s.py", src)
    diag = next(d for d in await session.diagnostics(uri) if d.code == "FL110")
    titles = [a.title for a in await actions_for(session, uri, diag)]
    assert not any(".item()" in t for t in titles)
    assert any("ignore[FL110]" in t for t in titles)


async def test_data_dependent_if_becomes_torch_where(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x):
        if x.sum() > 0:
            y = x * 2
        else:
            y = x - 1
        return y.relu()
    ''')
    await session.init()
    uri = await session.open("t.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL120", "torch.where")
    assert "    y = torch.where(x.sum() > 0, x * 2, x - 1)\n    return y.relu()\n" in new
    assert "if x.sum()" not in new
    assert not action.is_preferred  # both branches run; shapes may broadcast
    assert diags == []


async def test_if_with_side_effects_gets_no_where_rewrite(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x, out):
        if x.sum() > 0:
            out.add_(1)
        return x
    ''')
    await session.init()
    uri = await session.open("u.py", src)
    diag = next(d for d in await session.diagnostics(uri) if d.code == "FL120")
    titles = [a.title for a in await actions_for(session, uri, diag)]
    assert not any("torch.where" in t for t in titles)


async def test_suppression_comment_action(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x):
        print(x)  # keep
        return x + 1
    ''')
    await session.init()
    uri = await session.open("v.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL100", "ignore[FL100]")
    assert "    print(x)  # keep  # fuselens: ignore[FL100]\n" in new
    assert not action.is_preferred
    assert diags == []


async def test_restricted_mode_keeps_diagnostics_and_fixes(session):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def f(x):
        s = x.sum().item()
        return x * s
    ''')
    await session.init(trusted=False)
    uri = await session.open("w.py", src)
    _, new, diags = await fix_and_reanalyse(session, uri, src, "FL110", ".item()")
    assert "s = x.sum()\n" in new and diags == []


async def test_item_in_logging_is_kept_detached_and_logged_after_the_step(session):
    src = textwrap.dedent('''\
    import logging
    import torch

    log = logging.getLogger(__name__)


    @torch.compile
    def train_step(model, batch, *, scale=1.0):
        loss = model(batch).sum() * scale
        log.info("loss %f", loss.item())  # every step
        return loss
    ''')
    await session.init()
    uri = await session.open("log_item.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL110", "Log after the step")
    assert new.endswith(textwrap.dedent('''\
    @torch.compile
    def _train_step_compiled(model, batch, *, scale=1.0):
        loss = model(batch).sum() * scale
        logged = loss.detach()
        return loss, logged


    def train_step(model, batch, *, scale=1.0):
        result, logged = _train_step_compiled(model, batch, scale=scale)
        log.info("loss %f", logged.item())  # every step
        return result
    '''))
    assert not action.is_preferred  # the message is logged after the step, not in its middle
    assert "1 → 0 breaks" in action.title
    assert diags == []


@pytest.mark.parametrize("body", [
    "history.append(loss.item())",                    # not logging: the value is used
    'log.info("loss %f step %d", loss.item(), step)',  # a Python value the step computes
    'log.info(f"loss {loss.item()}")',                 # the value is formatted in the function
    'if step:\n        log.info("loss %f", loss.item())',  # not a top-level statement
])
async def test_item_logging_fix_only_where_it_is_simple(session, body):
    src = textwrap.dedent('''\
    import logging
    import torch

    log = logging.getLogger(__name__)
    history = []


    @torch.compile
    def train_step(model, batch, step):
        loss = model(batch).sum()
        BODY
        return loss
    ''').replace("BODY", body)
    await session.init()
    uri = await session.open("log_item_no.py", src)
    diag = next(d for d in await session.diagnostics(uri) if d.code == "FL110")
    titles = [a.title for a in await actions_for(session, uri, diag)]
    assert titles and not any("Log after the step" in t for t in titles)


@pytest.mark.parametrize("tail, rewritten", [
    ("    # gradients\n    loss.backward()\n    return loss\n", "    # gradients\n    return loss\n"),
    ("    loss.backward()  # grads\n", "    return loss  # grads\n"),
])
async def test_backward_tail_moves_out_and_the_function_returns_the_loss(session, tail, rewritten):
    head = textwrap.dedent('''\
    import torch


    @torch.compile
    def train_step(model, batch):
        loss = model(batch).sum()
    ''')
    src = head + tail
    await session.init()
    uri = await session.open("bw.py", src)
    action, new, diags = await fix_and_reanalyse(session, uri, src, "FL152", "Move 'backward()' out")
    assert new == head + rewritten
    assert "callers must call" in action.title and not action.is_preferred
    assert diags == []


@pytest.mark.parametrize("tail", [
    "    loss.backward()\n    opt.step()\n",              # more than a tail
    "    loss.backward()\n    return loss.detach()\n",    # returns something else
    "    loss.backward(retain_graph=True)\n",             # callers would need the arguments
    "    if loss > 0:\n        return loss\n    loss.backward()\n",  # another return
])
async def test_backward_fix_only_for_a_simple_tail(session, tail):
    src = textwrap.dedent('''\
    import torch


    @torch.compile
    def train_step(model, batch, opt):
        loss = model(batch).sum()
    ''') + tail
    await session.init()
    uri = await session.open("bw_no.py", src)
    diag = next(d for d in await session.diagnostics(uri) if d.code == "FL152")
    titles = [a.title for a in await actions_for(session, uri, diag)]
    assert titles and not any("Move 'backward()' out" in t for t in titles)
