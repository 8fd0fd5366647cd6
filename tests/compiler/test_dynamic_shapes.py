"""Dynamic dims that reach intermediates (capture/symbolic.py): after a size changes once, one
dynamic entry serves every later size where the code only computes with its intermediates' sizes
(slices, arange, expand, view, new tensors); only what Python decides on them is guarded, a
comparison as a relation, a value used as a Python number by its value, and each recompile names
that guard."""
from __future__ import annotations

import pytest
import sympy
import torch

import fuselens
from fuselens.capture.symbolic import SymbolicShapes

W = torch.randn(8, 8)
TABLE = torch.arange(64.0).view(1, 64)


def entries(cf):
    return fuselens.inspect(cf)


def run(f, sizes, make):
    cf = fuselens.compile(f)
    for n in sizes:
        args = make(n)
        torch.testing.assert_close(cf(*args), f(*args))
    return cf


def test_intermediate_sizes_in_ops_stay_symbolic():
    def f(x):
        h = torch.relu(x @ W)  # [b, s, 8]: its sizes are no input's
        b, s, _ = h.shape
        pos = torch.arange(int(s), dtype=h.dtype)
        heads = h.view(b, s, 2, 4).transpose(1, 2).reshape(b * 2, s, -1)
        mask = h.new_ones(b, s).expand(2, b, s)
        return heads.sum(0) + pos[:, None], TABLE[:, :s] * mask, h.size(1) * h.numel()
    cf = run(f, (3, 4, 5, 7, 9, 12), lambda n: (torch.randn(2, n, 8),))
    first, dyn = entries(cf)
    assert dyn.dynamic_dims == {"x": [1]}
    assert "2x3x8" in dyn.recompiled_because
    # every size read of an intermediate is computed in the graph: nothing pins the dim
    assert not any("x.shape[1] ==" in g.expr for g in dyn.guards), [g.expr for g in dyn.guards]


def test_comparison_of_an_intermediate_size_is_guarded_as_a_relation():
    def f(x):
        h = torch.cat([x, x])  # 2 * x.shape[0] rows
        if h.shape[0] > 10:
            return h * 2
        return h - 1
    cf = run(f, (6, 7, 8, 9), lambda n: (torch.randn(n, 4),))
    assert len(entries(cf)) == 2
    x = torch.randn(4, 4)  # 8 rows: the other branch
    torch.testing.assert_close(cf(x), f(x))
    last = entries(cf)[-1]
    assert len(entries(cf)) == 3
    # the relation, and where the code decided it
    assert "(2 * x.shape[0]) > 10: decided at test_dynamic_shapes.py:" in last.recompiled_because, \
        last.recompiled_because


def test_intermediate_size_used_as_a_python_value_is_guarded_on_its_value():
    def f(x):
        h = x.relu()[1:]
        out = h
        for i in range(h.shape[0]):  # the loop is unrolled for this many rows
            out = out + i
        return out
    cf = run(f, (3, 4, 5), lambda n: (torch.randn(n, 2),))
    assert len(entries(cf)) == 3
    assert "used as a Python value" in entries(cf)[-1].recompiled_because
    assert "x.shape[0]" in entries(cf)[-1].recompiled_because


def test_truth_min_max_and_shape_equality_are_relations():
    def f(x, y):
        h = x.relu()
        n = min(h.shape[0], 6)  # `6 < x.shape[0]`, not the size
        out = h[:n].sum(0) * max(2, h.shape[0])
        if h.shape[0] - 3:  # `x.shape[0] - 3 != 0`
            out = out + 1
        if h.shape == y.shape:  # each dim's equality
            out = out + y.sum(0)
        return out
    cf = run(f, (8, 9, 10, 11), lambda n: (torch.randn(n, 4), torch.randn(n, 4)))
    assert len(entries(cf)) == 2
    for n, m in ((9, 7), (4, 4), (3, 3)):  # each relation the other way: an entry each
        x, y = torch.randn(n, 4), torch.randn(m, 4)
        torch.testing.assert_close(cf(x, y), f(x, y))
    assert len(entries(cf)) == 5
    reasons = [e.recompiled_because for e in entries(cf)[2:]]
    assert "x.shape[0] == y.shape[0]" in reasons[0] and "6 < x.shape[0]" in reasons[1] and "!= 0" in reasons[2], reasons


def test_shape_rules_assumptions_are_guarded():
    # the symbolic run takes `t`'s columns for x's, as the slice's rule decided at these sizes (the
    # end inside the table's 64): that is guarded, so at 70 columns the other branch is taken
    def f(x):
        h = x * 2
        t = TABLE[:, : h.shape[1]]
        if t.shape[1] == h.shape[1]:
            return h + t
        return h[:, :64] - t
    cf = run(f, (3, 4, 5, 70), lambda n: (torch.randn(1, n),))
    assert len(entries(cf)) == 3
    because = entries(cf)[-1].recompiled_because
    assert "x.shape[1] <= 64: assumed by the shape rule of getitem at test_dynamic_shapes.py:" in because, because


def test_strides_that_follow_dynamic_dims_are_guarded():
    def f(x):
        h = x * 2  # [2, n]: its row stride is n
        return h.view(-1) * h.stride(0) + x.stride(1) + h.stride()[1]
    cf = run(f, (3, 4, 5, 6), lambda n: (torch.randn(2, n),))
    assert len(entries(cf)) == 4  # each size its entry: a stride is this call's number
    assert "(a stride is read)" in entries(cf)[-1].recompiled_because

    def g(x):
        h = x * 2  # [n, 3]: strides (3, 1) at every size
        return h * h.stride(0)
    cf = run(g, (3, 4, 5, 6), lambda n: (torch.randn(n, 3),))
    assert len(entries(cf)) == 2


def test_sizes_of_two_dynamic_inputs():
    def f(tokens, pos):
        e = torch.nn.functional.one_hot(tokens, 16).float()  # [1, n, 16]
        n = e.shape[1]
        return e.view(n, 16) * pos.view(n, 1) + torch.arange(n)[:, None]
    cf = run(f, (3, 4, 6, 9), lambda n: (torch.randint(0, 16, (1, n)), torch.arange(n) * 1.0))
    assert len(entries(cf)) == 2


def test_size_of_no_python_spelling():
    # n * n (a Pow): no guard spells it; returned, it comes out of the graph; decided on, it pins
    def f(v):
        m = torch.outer(v, v).view(-1)
        return m * 2, m.shape[0] + 1
    cf = run(f, (3, 4, 5, 6), lambda n: (torch.randn(n),))
    assert len(entries(cf)) == 2

    def g(v):
        m = torch.outer(v, v).view(-1)
        return m * 2 if m.shape[0] > 20 else m
    cf = run(g, (3, 4, 5, 6), lambda n: (torch.randn(n),))
    assert len(entries(cf)) == 4
    assert "a size of no expression used as a Python value" in entries(cf)[-1].recompiled_because


def test_a_size_a_shape_rule_specialises_is_guarded(monkeypatch):
    """A shape rule that finds a dynamic dim equal to a number (some of torch 2.11's fake rules
    specialise a length so) makes the size a constant in the graph; the guard of that equality is
    what keeps the entry from running at another length (torch 2.11: a Llama prefill's repeat_kv
    expand kept its first length, and the next length raised inside the graph)."""
    from fuselens.capture import symbolic
    run_node = symbolic.SymbolicShapes._run

    def specialising(self, n):  # the fake rule of mul reads its result's length as an int
        out = run_node(self, n)
        if getattr(n.target, "__name__", "") == "mul" and isinstance(out, torch.Tensor) and out.dim() == 2:
            int(out.shape[0])
        return out
    monkeypatch.setattr(symbolic.SymbolicShapes, "_run", specialising)

    def f(x):
        h = x * 2
        return h.reshape(h.shape[0], 2, 2) + 1
    cf = run(f, (3, 5, 6, 9), lambda n: (torch.randn(n, 4),))
    assert any("a shape rule made" in (e.recompiled_because or "") for e in entries(cf)), \
        [e.recompiled_because for e in entries(cf)]


def test_guard_text_of_size_expressions():
    x = sympy.Symbol("s0", positive=True, integer=True)
    names = {x: "x.shape[0]"}
    sym = SymbolicShapes.__new__(SymbolicShapes)
    sym.names = names
    from torch.utils._sympy.functions import FloorDiv, Max, Mod
    assert sym.text(2 * x + 1) == "(1 + (2 * x.shape[0]))"
    assert eval(sym.text(FloorDiv(x, 2) + Mod(x, 3)), {}, {"x": torch.empty(7)}) == 7 // 2 + 7 % 3
    assert eval(sym.text(sympy.Gt(Max(x, 4), 5)), {}, {"x": torch.empty(7)}) is True
    assert sym.text(x ** 2) is None  # (no shape rule capture meets makes one: refused, not misprinted)
    assert sym.text(sympy.Symbol("other") + 1) is None  # a symbol of no source


def _bert(T):
    return T.BertModel(T.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                    intermediate_size=64, vocab_size=100, max_position_embeddings=64,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _llama(T):  # a decoder's prefill: causal mask, rotary positions, grouped key/value heads
    return T.LlamaModel(T.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                      max_position_embeddings=64, use_cache=False))


@pytest.mark.parametrize("make, lengths", [(_bert, (8, 12, 16, 20, 24, 32, 40)), (_llama, (8, 12, 20, 40))],
                         ids=["bert", "llama-prefill"])
def test_transformers_over_several_lengths_one_dynamic_entry(make, lengths):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make(T).eval()
    cf = fuselens.compile(model)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(3, 100, (2, n))
            torch.testing.assert_close(cf(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
    es = entries(cf)
    assert len(es) == 2, [e.recompiled_because for e in es]
    assert es[1].dynamic_dims == {"kwargs['input_ids']": [1]}
