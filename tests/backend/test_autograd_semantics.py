"""What a user sees of autograd through a compiled graph is eager's: which outputs require grad,
which inputs get a gradient (None where eager's backward never reaches them), which backwards
raise (an op without a derivative, a saved value written in place), and which in-place writes
after the call autograd refuses."""
import warnings
import weakref

import pytest
import torch

import fuselens
from fl_backend_testing import DEVICE, compile, trace
from fuselens.autograd import build_joint, partition
from fuselens.autograd.facts import eager_autograd
from fuselens.ops import to_primitive_graph
from fuselens.backend.driver import compile_graph


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(5, generator=g).to(DEVICE) for _ in range(3))
    return x.requires_grad_(), y.requires_grad_(), z  # z: no gradient


def _sum_all(outs):
    return sum(o.sum() for o in outs if o.requires_grad)


def _write_input_z(inputs, outs):
    inputs[2].add_(1)


def _write_input_x(inputs, outs):
    with torch.no_grad():  # a leaf that requires grad is written under no_grad (an optimizer step)
        inputs[0].mul_(0.5)


def _write_output(inputs, outs):
    outs[0].mul_(2)


def _product_and_sin(x, y, z):
    p = x.view(5, 1) @ y.view(1, 5)  # a matmul: kept by the compiled forward, not recomputed
    return p, torch.sin(p * 0.5)


# (function, what happens between the call and backward, the loss)
CASES = {
    "detached_output": (lambda x, y, z: (x.sum(), x.detach().sum() + 100), None, _sum_all),
    "detached_operand": (lambda x, y, z: x.detach() * 2 + y, None, _sum_all),
    "integer_output": (lambda x, y, z: (x * y, (x > 0).sum()), None, _sum_all),
    "unused_input": (lambda x, y, z: y.abs() * 2, None, _sum_all),
    "input_only_reaching_an_unused_output": (lambda x, y, z: (y * 2, x * 3), None, lambda o: o[0].sum()),
    "zero_derivative_reaches_its_input": (lambda x, y, z: x.sign() * y + x.floor(), None, _sum_all),
    "floor_divide": (lambda x, y, z: x // (z.abs() + 0.5), None, _sum_all),
    "floor_divide_of_an_output_the_loss_ignores": (lambda x, y, z: (y * 2, x // (z.abs() + 0.5)), None,
                                                   lambda o: o[0].sum()),
    "floor_divide_of_a_detached_value": (lambda x, y, z: x.detach() // 0.3 + y, None, _sum_all),
    # the compiled forward may keep an input that eager does not save (relu saves its result)
    "input_written_after_the_call_eager_does_not_save": (lambda x, y, z: (z * 2).relu() * y, _write_input_z,
                                                         _sum_all),
    "leaf_written_after_the_call_eager_does_not_save": (lambda x, y, z: (x * 2).relu(), _write_input_x,
                                                        _sum_all),
    "input_written_after_the_call_eager_saves_a_function_of": (lambda x, y, z: z.sin() * y, _write_input_z,
                                                                 _sum_all),
    "input_written_after_the_call_eager_saves": (lambda x, y, z: z * y, _write_input_z, _sum_all),
    "leaf_written_after_the_call_eager_saves": (lambda x, y, z: x.sin(), _write_input_x, _sum_all),
    "output_written_after_the_call_eager_saves": (lambda x, y, z: x.exp(), _write_output, _sum_all),
    "output_written_after_the_call_eager_does_not_save": (lambda x, y, z: x * 2, _write_output, _sum_all),
    # sin saves its input, a function of the output that the compiled backward would rather keep
    "output_written_after_the_call_eager_saves_a_function_of": (_product_and_sin, _write_output, _sum_all),
}


def _observe(fn, post, loss):
    """Everything of one call and its backward that a user can look at."""
    inputs = _inputs()
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    seen = {"values": [o.detach().clone() for o in outs], "requires_grad": [o.requires_grad for o in outs]}
    if post is not None:
        post(inputs, outs)
    try:
        loss(outs).backward()
        seen["error"] = None
    except RuntimeError as e:
        seen["error"] = type(e)
    seen["grads"] = [t.grad for t in inputs]
    return seen


def _assert_same(got, expected):
    assert got["requires_grad"] == expected["requires_grad"]
    for g, e in zip(got["values"], expected["values"]):
        torch.testing.assert_close(g, e)
    assert got["error"] == expected["error"]
    assert [g is None for g in got["grads"]] == [e is None for e in expected["grads"]]
    for g, e in zip(got["grads"], expected["grads"]):
        if e is not None:
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("case", CASES)
def test_compiled_autograd_is_eagers(case):
    fn, post, loss = CASES[case]
    cg = compile(fn, *_inputs())

    def compiled(*inputs):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an eager fallback would hide what is tested
            return cg(*inputs)
    _assert_same(_observe(compiled, post, loss), _observe(fn, post, loss))


def _marked_inplace(fn, hops):
    """fn's graph with its last op marked as an in-place write (meta["writes"], as capture marks a
    functionalized write) into the value `hops` first operands up from it: 1 for `t.mul_(2)` as
    `t * 2`; 2 where the write's result comes through one more node (an extern run on copies of
    what it writes, then `getitem`)."""
    gm = trace(fn)
    last = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")][-1]
    written = last
    for _ in range(hops):
        written = written.args[0]
    last.meta["writes"] = written
    return gm


def _relu_add_(x):
    t = torch.relu(x)
    t.add_(1)
    return t


@pytest.mark.parametrize("functional,inplace,hops,raises", [
    # relu saves its result, which the write changes: eager's backward raises
    (lambda x: torch.relu(x) * 2, lambda x: torch.relu(x).mul_(2), 1, True),
    (lambda x: torch.sigmoid(x) + 1, lambda x: torch.sigmoid(x).add_(1), 1, True),
    (lambda x: (torch.relu(x) + 1).clone(), _relu_add_, 2, True),
    # a product by a constant saves nothing: the write is harmless
    (lambda x: (x * 3) * 2, lambda x: (x * 3).mul_(2), 1, False),
    # sin saves its input, not its result
    (lambda x: torch.sin(x) * 2, lambda x: torch.sin(x).mul_(2), 1, False),
], ids=["relu", "sigmoid", "relu_through_a_copy", "product_by_constant", "sin"])
def test_a_value_saved_for_backward_and_written_in_place_in_the_graph(functional, inplace, hops, raises):
    x = torch.randn(6, device=DEVICE, requires_grad=True)
    gm = _marked_inplace(functional, hops)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    placeholder.meta["val"] = torch.empty(6, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg = compile_graph(gm, [x])
        out = cg(x)[0]
    eager_out = inplace(x)
    torch.testing.assert_close(out, eager_out)
    if raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            eager_out.sum().backward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    else:
        (expected,) = torch.autograd.grad(eager_out.sum(), x)
        (got,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(got, expected)


def _copy_into_product(x, y):
    t = y * 2
    t.copy_(x)
    return t * y


def test_the_functional_form_of_an_in_place_op_differentiates_as_the_op():
    """Capture writes `t.copy_(x)` as `aten.copy(t, x)` marked as the in-place op's (its
    meta["in_place"] and "writes"), differentiated as `copy_` though `aten.copy` has no derivative."""
    x, y, _ = _inputs()
    gm = trace(lambda x, y: torch.ops.aten.copy.default(y * 2, x) * y)
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.copy.default:
            n.meta.update(in_place=True, writes=n.args[0])
    cg = compile(gm, x, y)
    expected = torch.autograd.grad(_copy_into_product(x, y).sum(), [x, y])
    got = torch.autograd.grad(cg(x, y)[0].sum(), [x, y])
    torch.testing.assert_close(got, expected)


def test_the_error_of_an_op_without_a_derivative_is_torchs():
    x = torch.randn(4, device=DEVICE, requires_grad=True)
    f = lambda x: x // 0.3  # noqa: E731
    with pytest.raises(RuntimeError) as eager:
        f(x).sum().backward()
    with pytest.raises(RuntimeError) as compiled:
        compile(f, x)(x)[0].sum().backward()
    assert str(compiled.value) == str(eager.value)


def test_eager_facts_of_a_graph():
    def f(x, y, z):
        return x.sin() * z, (y * 2).relu(), x // 2, z + 1
    x, y, z = _inputs()
    facts = eager_autograd(trace(f), [x, y, z])
    assert facts.output_requires_grad == [True, True, True, False]
    assert facts.reaches == [0b001, 0b010, 0b001, 0]
    assert [r is not None for r in facts.raises] == [False, False, True, False]
    assert facts.saved_inputs == {0, 2}  # sin saves x, the product saves z (relu: its result)
    assert facts.saved_outputs == {1}


def test_a_saved_input_eager_does_not_save_is_a_copy():
    def f(x):
        return (x * 2).relu() * x.sin()
    x = torch.randn(8, device=DEVICE, requires_grad=True)
    prim = to_primitive_graph(trace(f), [x], DEVICE)
    kept = partition(build_joint(prim, [True], DEVICE), private_inputs=[0])
    shared = partition(build_joint(prim, [True], DEVICE))
    outputs = lambda g: list(next(n for n in g.nodes if n.op == "output").args[0])  # noqa: E731
    # sin's backward reads x: the forward saves x itself, or a copy where x is marked as an input
    # eager would not save
    assert any(o.op == "placeholder" for o in outputs(shared.forward)[1:])
    assert not any(o.op == "placeholder" for o in outputs(kept.forward)[1:])


def test_a_buffer_updated_from_a_detached_value_stays_out_of_autograd():
    w = torch.randn(3, device=DEVICE, requires_grad=True)
    buf = torch.zeros(3, device=DEVICE)

    def f(x):
        t = x * w
        buf.add_(t.detach().mean(0))
        return t

    cf = fuselens.compile(f)
    for _ in range(2):  # the second backward once failed: buf had joined the first call's graph
        cf(torch.randn(2, 3, device=DEVICE)).sum().backward()
    assert not buf.requires_grad


def test_a_graph_reached_only_through_an_unused_input_checks_no_saved_value():
    """After a graph break, a later graph may take a value it does not use: autograd reaches the
    earlier graph's backward through it, with no gradient; eager never runs that backward."""
    x, y, _ = _inputs()
    x = x * 1  # a non-leaf: written in place below, as a program may
    first = compile(lambda x: x.sin(), x)  # saves x, as eager
    second = compile(lambda a, y: y * 2, torch.empty(5, device=DEVICE).requires_grad_(), y)
    out = second(first(x)[0], y)[0]
    with torch.no_grad():
        x.mul_(2)
    out.sum().backward()  # (autograd.grad would prune the path to the first graph)
    torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))


class _AliveAtEachOp(torch.utils._python_dispatch.TorchDispatchMode):
    """At each op the backward runs through torch (a matmul's extern call): how many of `refs`
    (weak references to saved values) are still alive."""

    def __init__(self, refs):
        super().__init__()
        self.refs, self.alive = refs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.alive.append(sum(r() is not None for r in self.refs))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiler", ["eager", "fuselens"])
def test_the_backward_frees_each_saved_value_after_its_last_use(compiler):
    # a deep MLP: its backward reads the last layer's activations first; holding every saved value
    # to the end of the backward made a ResNet-50 training step's peak memory 1.6x eager's
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16, device=DEVICE) for _ in range(6)]

    def f(x):
        for layer in layers:
            x = torch.tanh(layer(x)) * 2
        return x.sum()
    fn = f if compiler == "eager" else fuselens.compile(f)
    x = torch.randn(4, 16, device=DEVICE)
    fn(x)
    params = {id(p) for layer in layers for p in layer.parameters()}
    refs = []

    def pack(t):
        if id(t) not in params and t is not x:
            refs.append(weakref.ref(t))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x)
    mode = _AliveAtEachOp(refs)
    with mode:
        loss.backward()
    assert len(refs) >= 6 and len(mode.alive) >= 6
    # the first layers' gradients are computed once the last layers' saved values are gone
    # while the backward ran, some of the saved values were gone and some not yet
    assert any(0 < alive <= len(refs) // 2 for alive in mode.alive), mode.alive


class _Sizes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of memory behind each tensor the ops run through torch make."""

    def __init__(self):
        super().__init__()
        self.nbytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.nbytes += [t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor)]
        return out


def test_an_output_without_a_gradient_costs_its_backward_no_tensor():
    """A language model returns its loss and its logits; the backward from the loss alone runs a
    program without the logits' terms and makes no tensor the logits' size (zeros of GPT-2's
    logits were 412 MB and a fill each step)."""
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)

    def fn(x):
        logits = x.repeat(1, 64)
        return torch.logsumexp(x, -1).mean(), logits * 2
    cf = fuselens.compile(fn)
    for _ in range(2):  # (the first call compiles)
        loss, logits = cf(x)
        with _Sizes() as sizes:
            (got,) = torch.autograd.grad(loss, x)
    (want,) = torch.autograd.grad(fn(x)[0], x)
    torch.testing.assert_close(got, want)
    assert max(sizes.nbytes) < logits.untyped_storage().nbytes(), sizes.nbytes


def test_beside_a_loss_the_backward_without_the_other_outputs_gradients_is_compiled_ahead():
    """A model returning (loss, logits) trains from the loss alone: the backward compiled with the
    first call is that one (compiling the one over every gradient too cost GPT-2 a third of its
    graph work). Gradients for both outputs still work: that backward compiles at its first use."""
    from fuselens import stats

    def model(x, w, target):
        logits = torch.tanh(x @ w)
        return torch.nn.functional.cross_entropy(logits, target), logits
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g).to(DEVICE), torch.randn(4, 5, generator=g).to(DEVICE)
    target = torch.tensor([0, 1, 2, 3, 4, 0], device=DEVICE)
    cf = fuselens.compile(model)
    before = dict(stats.backend)
    for both in (False, False, True):
        ws = [w.clone().requires_grad_(), w.clone().requires_grad_()]
        outs = [f(x, ws[i], target) for i, f in enumerate((cf, model))]
        for (loss, logits), wi in zip(outs, ws):
            torch.autograd.backward([loss, logits] if both else [loss],
                                    [torch.ones(()), torch.ones_like(logits)] if both else None)
        torch.testing.assert_close(ws[0].grad, ws[1].grad)
        if not both:  # the loss-only backward was compiled with the first call, not at backward()
            assert stats.backend["backward_layouts"] == before["backward_layouts"]
    assert stats.backend["backward_layouts"] == before["backward_layouts"] + 1


def _saved_then_written(x, y):
    s = torch.sign(x) * x
    m = torch.maximum(y, s)  # saves s
    s[0] = 1  # unused afterwards: the graph drops the op, not its effect on s's version
    return m


def test_a_saved_value_written_by_an_unused_op_fails_backward_as_eager():
    x, y, _ = _inputs()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _saved_then_written(x, y).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fuselens.compile(_saved_then_written)(x, y).sum().backward()



def test_torch_call_returning_its_argument_has_its_gradient():
    """A torch call run as an extern whose result is an argument itself (broadcast_tensors of an
    operand that needs no broadcast, as a Categorical's log_prob does): a leaf with no grad_fn in
    its VJP's recomputation, whose gradient is the cotangent (the backend failed on it)."""
    def f(x, idx):
        v, lp = torch.broadcast_tensors(idx.unsqueeze(-1), x)
        return lp.gather(-1, v[..., :1]).sum()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(5)).requires_grad_()
    idx = torch.tensor([0, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", fuselens.FuselensWarning)
        got = torch.autograd.grad(fuselens.compile(f)(x, idx), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(f(x, idx), x)[0])
