"""Meta evaluations remembered (capture/meta_memo.py): a repeated call is evaluated once, and what
is recalled is what evaluating it again would give (results, writes, views, dtypes, leafness)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuselens
from fl_capture_testing import check
from fuselens.capture import meta_memo
from fuselens.ops import effects


@pytest.fixture
def runs(monkeypatch):
    """Counts the meta evaluations that ran (were not recalled), from an empty memo."""
    meta_memo._MEMO.clear()
    count = {"runs": 0}
    run = effects.run

    def counted(*args, **kwargs):
        count["runs"] += 1
        return run(*args, **kwargs)
    monkeypatch.setattr(effects, "run", counted)
    return count


def block(x, y):
    """Every kind of result a recall rebuilds: new tensors, the argument itself (`float()` of a
    float tensor), views, a write into an argument, factories whose dtype follows the fill."""
    h = torch.relu(x @ y) * 2
    h = h.float().t().contiguous().t()
    h.add_(1)
    ints, floats = torch.full((3,), 1), torch.full((3,), 1.0)
    return h[:, :3] + floats + ints, h.is_leaf, h.reshape(-1)[:4]


@pytest.mark.parametrize("grad", [False, True])
def test_repeated_blocks_are_evaluated_once_with_eager_results(runs, grad):
    def fn(x, ys):
        outs = []
        for y in ys:
            out, leaf, flat = block(x, y)
            outs.append((out.sum(), leaf, flat))
            x = x + out.mean()
        return outs
    x = torch.randn(4, 5, requires_grad=grad)
    ys = [torch.randn(5, 4, requires_grad=grad) for _ in range(4)]
    check(fn, x, ys, calls=1)
    once = runs["runs"]
    meta_memo._MEMO.clear()
    runs["runs"] = 0
    check(fn, x, ys[:1], calls=1)
    # four blocks cost what one block and the adds between them cost
    assert once <= runs["runs"] + 6, (once, runs["runs"])


def test_batch_norm_layers_write_their_own_running_statistics(runs):
    """A training BatchNorm writes its running statistics: the second layer's call, recalled, still
    writes the second layer's buffers (and the first's are the first's)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.BatchNorm2d(3), nn.BatchNorm2d(3)).train()
    for bn in (m[0], m[2], m[3]):
        nn.init.normal_(bn.weight)
    compiled = fuselens.compile(copy.deepcopy(m))
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(compiled(x), m(x))
    for got, want in zip(compiled.buffers(), m.buffers()):
        torch.testing.assert_close(got, want)
    assert runs["runs"] < 8  # the third layer's calls recalled (its input is the second's kind)


def test_a_write_without_functional_form_is_evaluated_once(monkeypatch):
    """A training BatchNorm writes its running statistics, which no functional ATen overload
    returns: the graph runs the call on copies of them (effects.OnCopies), whose metas follow
    from the call's own evaluation (a second one was ~4 ms a fresh shape)."""
    meta_memo._MEMO.clear()
    evaluated = []
    run = effects.run

    def recorded(fn, *args, **kwargs):
        evaluated.append(fn)
        return run(fn, *args, **kwargs)
    monkeypatch.setattr(effects, "run", recorded)
    torch.manual_seed(0)
    m = nn.BatchNorm2d(3).train()
    nn.init.normal_(m.weight)
    compiled = fuselens.compile(copy.deepcopy(m))
    x = torch.randn(2, 3, 4, 4)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(xc), m(xe)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)
    for a, b in zip([*compiled.buffers(), *(p.grad for p in compiled.parameters())],
                    [*m.buffers(), *(p.grad for p in m.parameters())]):
        torch.testing.assert_close(a, b)
    assert F.batch_norm in evaluated and not any(isinstance(fn, effects.OnCopies) for fn in evaluated)


def test_a_call_on_other_layouts_is_evaluated_again(runs):
    def fn(a, b):
        return torch.mm(a, b), torch.mm(a.t().contiguous().t(), b), torch.mm(a[:, :2], b[:2])
    check(fn, torch.randn(3, 4), torch.randn(4, 5), calls=1)
    assert len(meta_memo._MEMO) >= 3  # three layouts of `a`: three evaluations of mm


# pairs of calls alike but for what a recall must tell apart (or rebuild right)
def fills(x):
    ints, floats, bools = torch.full((3,), 1), torch.full((3,), 1.0), torch.full((3,), True)
    return x[0, :3] + ints, x[0, :3] + floats, bools, x.new_full((2,), 1), x.new_full((2,), 1.5)


def structs(x):
    m, m2 = x.max(1), (x * 2).max(1)
    s, s2 = torch.split(x, 2, 1), torch.split(x + 1, 2, 1)
    return m.values, m.indices, m2.values, m2.indices, s[1] * 2, s2[1] * 2, x.unbind(0)[1], (x + 1).unbind(0)[1]


def views(x):
    return (x.view(torch.int32), (x + 1).view(torch.int32), x.t() * 1, (x + 1).t() * 1, x.contiguous(),
            (x + 1).contiguous(), x.to(torch.float32), (x + 1).to(torch.float32))


def complex_parts(x):
    c, d = torch.complex(x, x), torch.complex(x + 1, x + 1)
    return c.conj() * 1, d.conj() * 1, c.real * 1, d.real * 1, torch.view_as_real(c) * 1, torch.view_as_real(d) * 1


def writes(x):
    y, z, w, v = x.clone(), x.clone(), x.clone(), x.clone()
    y.t_(), z.t_()
    w.add_(1), v.add_(1)
    w[0] = 5
    v[0] = 5
    return y, z, w, v


def grad_modes(x, w):
    a = x @ w
    with torch.no_grad():
        b = x @ w
    return a, b, x @ w, a.requires_grad, b.requires_grad, x.detach() * 2, (x * 1).detach() * 2


@pytest.mark.parametrize("fn,args", [
    (fills, (torch.randn(4, 4),)),
    (structs, (torch.randn(4, 6),)),
    (views, (torch.randn(4, 4),)),
    (complex_parts, (torch.randn(4, 4),)),
    (writes, (torch.randn(3, 4),)),
    (grad_modes, (torch.randn(4, 4, requires_grad=True), torch.randn(4, 4))),
], ids=lambda v: getattr(v, "__name__", ""))
def test_recalls_tell_alike_calls_apart(runs, fn, args):
    check(fn, *args)


def test_the_memo_keeps_no_graph_alive(runs):
    """What is remembered holds stand-ins, not the graph of the call (its constants, a model)."""
    import gc
    import weakref
    import numpy as np

    def compiled_once():
        arr = np.ones((100, 100), np.float32)

        def f(x):
            return (x * 2 + torch.as_tensor(arr)).relu()
        fuselens.compile(f)(torch.randn(100, 100))
        return weakref.ref(arr)
    ref = compiled_once()
    gc.collect()
    assert meta_memo._MEMO and ref() is None


@torch.jit.script
def _scale_of(x: torch.Tensor, k: int):
    return torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * k)  # (made on the CPU, whatever x's device)


def test_a_result_made_on_a_device_of_its_own_keeps_it_when_called_again(runs):
    """DeBERTa's `scaled_size_sqrt` makes its result on the CPU in a GPU model: a second call on
    the same layouts, recalled, had its result on the arguments' device, and a GPU kernel then
    read the CPU tensor (an illegal address). TensorVars on "cuda" stand for a GPU graph here."""
    from fuselens.capture.graph import GraphBuilder
    g = GraphBuilder()
    a, b = g.input(torch.randn(4, 8), "a"), g.input(torch.randn(4, 8), "b")
    a.device = b.device = torch.device("cuda")
    first, second = g.call(_scale_of, (a, 3), {}, None), g.call(_scale_of, (b, 3), {}, None)
    assert first.device == second.device == torch.device("cpu")
    assert first.node.meta["device"] == second.node.meta["device"] == torch.device("cpu")
