"""Writes into tensors, whatever their spelling: what a call writes and aliases is read from
ATen's schemas (fuselens/ops/effects.py), so every spelling of every in-place op is captured
the same way, and compiled results and mutated inputs equal eager's. Where eager refuses a
write, compiled code raises the same error."""
from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools

import pytest
import torch
import torch.nn as nn  # noqa: F401 (used by the generated functions)
import torch.nn.functional as F

import fuselens
from fl_capture_testing import check
from fuselens.backend import driver

REAL_COMPILE_GRAPH = driver.compile_graph  # before the capture tests' eager fixture patches it

# op name -> its arguments after the tensor: pointwise ops of several kinds
OPS = {"relu": "", "sigmoid": "", "tanh": "", "exp": "", "abs": "", "neg": "", "floor": "",
       "clamp": "min=0", "add": "1", "mul": "2.5", "sub": "y", "div": "2", "pow": "2",
       "masked_fill": "y > 0, 0.5", "lerp": "torch.zeros(6), 0.3",
       "conj_physical": ""}  # an identity on real tensors: the write changes nothing
SPELLINGS = {
    "method": "y.{op}_({args})",
    "function": "torch.{op}_(y, {args})",
    "unbound method": "torch.Tensor.{op}_(y, {args})",
    "method passed around": "g = torch.Tensor.{op}_\n    g(y, {args})",
    "returned value": "y = y.{op}_({args})",
    "out=": "torch.{op}(y, {args}, out=y)",
}
F_INPLACE = ["F.relu(y, inplace=True)", "F.silu(y, inplace=True)", "F.hardtanh(y, inplace=True)",
             "F.leaky_relu(y, 0.1, inplace=True)", "F.elu(y, inplace=True)", "F.relu6(y, inplace=True)",
             "F.hardswish(y, inplace=True)", "F.hardsigmoid(y, inplace=True)", "F.mish(y, inplace=True)",
             "F.celu(y, inplace=True)", "F.selu(y, inplace=True)", "F.rrelu(y, training=False, inplace=True)",
             "F.threshold(y, 0.1, 20., inplace=True)", "F.dropout(y, 0.5, False, True)",
             "nn.ReLU(inplace=True)(y)", "nn.SiLU(inplace=True)(y)", "nn.ReLU6(inplace=True)(y)",
             "nn.Hardtanh(inplace=True)(y)", "nn.LeakyReLU(0.2, inplace=True)(y)",
             "nn.ELU(inplace=True)(y)", "nn.Hardswish(inplace=True)(y)", "nn.Dropout(inplace=True).eval()(y)"]
THROUGH_VIEWS = ["y[1:].mul_(2)", "y.view(-1).add_(1)", "y.t().t().sub_(1)", "y.unsqueeze(0).tanh_()",
                 "y[::2].zero_()", "y.reshape(2, 3).fill_(2)", "y[1:].mul_(2).add_(1)", "y[2:4] *= 3",
                 "y[y < 0] = 0", "y[1] = 7", "y.view(2, 3)[:, 1].copy_(torch.ones(2))",
                 "y.narrow(0, 1, 2).relu_()", "y.view(3, 2).permute(1, 0)[0].add_(1)",
                 "y.index_add_(0, torch.tensor([0, 1]), torch.ones(2))",
                 "y.scatter_(0, torch.tensor([0, 1]), 5.)", "y.addcmul_(y, y, value=0.5)",
                 "y.copy_(y * 3)", "torch.clamp_(y, min=0)", "torch.add(y, y, alpha=2, out=y)"]
METADATA = ["y.unsqueeze_(0)", "y.unsqueeze_(0); y.squeeze_(0)", "y.resize_as_(y)",
            "y = y.view(2, 3); y.t_()", "y = y.view(2, 3); y.transpose_(0, 1)",
            "y = y.view(2, 3); y.swapdims_(0, 1)"]


def _module(tmp_path, name, body):
    """A function in a real file (capture reads source), from `body` statements."""
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
                    f"def f(x):\n    y = x * 2\n    {body}\n    return y + 1, x\n\n\n"
                    f"def g(x):\n    y = x\n    {body}\n    return y * 1\n")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _eager_runs(body) -> bool:
    try:
        exec(body.replace("\n    ", "\n"), {"torch": torch, "y": torch.randn(6)})
    except (TypeError, AttributeError):
        return False
    return True


def _cases():
    for (op, args), (sp, text) in itertools.product(OPS.items(), SPELLINGS.items()):
        body = text.format(op=op, args=args).replace(", )", ")").replace("(y, , ", "(y, ")
        if _eager_runs(body):  # not every op has every spelling (`torch.relu(out=)`)
            yield f"{op}-{sp}", body
    for i, body in enumerate(F_INPLACE + THROUGH_VIEWS + METADATA):
        yield body.split("(")[0] + f"-{i}", body


CASES = dict(_cases())


@pytest.mark.parametrize("name", list(CASES))
def test_write_spellings_equal_eager(tmp_path, name):
    """Every spelling writes: the local's new value (`f`) and the input written back (`g`)."""
    mod = _module(tmp_path, f"m_{abs(hash(name))}", CASES[name])
    x = torch.randn(6)
    check(mod.f, x)
    if "unsqueeze_" not in name and "t_" not in CASES[name] and "transpose_" not in CASES[name] \
            and "swapdims_" not in CASES[name] and "resize_as_" not in CASES[name]:
        check(mod.g, x)  # the same write into the caller's tensor


@pytest.mark.parametrize("body", ["y.unsqueeze_(0)", "y.t_()", "y.squeeze_()"])
def test_metadata_write_into_an_input_keeps_its_shape_change(tmp_path, body):
    """`squeeze_`, `t_`... change the caller's tensor object: the caller sees the new shape."""
    mod = _module(tmp_path, f"meta_{abs(hash(body))}", body)
    x = torch.randn(1, 6)
    xe, xc = x.clone(), x.clone()
    want = mod.g(xe)
    got = fuselens.compile(mod.g)(xc)
    assert got.shape == want.shape and xc.shape == xe.shape
    torch.testing.assert_close(got, want)


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e)
    return None


def leaf_write(x):
    x.add_(1)
    return x * 2


def leaf_view_write(x):
    x[1:] += 1
    return x * 2


def dtype_cannot_cast(x):
    t = x.argmax(0, keepdim=True)
    t.add_(x)
    return x * 2


def partial_overlap(x):
    t = x * 1
    t[1:].add_(t[:-1])
    return t


def internal_overlap(x):
    t = (x * 1)[:1].expand(4)
    t.add_(1)
    return t


def broadcast_into_smaller(x):
    t = x[:1] * 1
    t.add_(x)
    return t


@pytest.mark.parametrize("fn,grad", [(leaf_write, True), (leaf_view_write, True),
                                     (dtype_cannot_cast, False), (partial_overlap, False),
                                     (internal_overlap, False), (broadcast_into_smaller, False)])
def test_writes_eager_refuses_raise_the_same(fn, grad):
    x = torch.randn(4, requires_grad=grad)
    want = _raises(fn, x)
    assert want is RuntimeError
    assert _raises(fuselens.compile(fn), x) is want
    with torch.no_grad():  # autograd does not check writes under no_grad
        if grad:
            check(fn, x.detach().requires_grad_(True), calls=1)


def inplace_under_no_grad(x):
    y = x * 2
    with torch.no_grad():
        y.relu_()
        torch.mul(y, 3, out=y)
    return y


def test_write_under_no_grad_keeps_history():
    x = torch.randn(6, requires_grad=True)
    check(inplace_under_no_grad, x)
    ge, gc = x.clone().detach().requires_grad_(), x.clone().detach().requires_grad_()
    inplace_under_no_grad(ge).sum().backward()
    fuselens.compile(inplace_under_no_grad)(gc).sum().backward()
    torch.testing.assert_close(gc.grad, ge.grad)


def named_tuples(x):
    a = x.max(dim=-1).values
    b = torch.sort(x, dim=0).indices
    v, i = torch.topk(x, 2)
    m = x.min(1)
    return a + m.values, b, v, i, m.indices


def test_named_tuple_results():
    check(named_tuples, torch.randn(4, 3), graphs=1, breaks=[])


def view_write_dynamic(x):
    t = x * 1
    t.unsqueeze(0).tanh_()
    t.view(-1)[0] = 9
    return t


def test_write_through_view_after_dims_go_dynamic():
    cf = fuselens.compile(view_write_dynamic)
    for n in (5, 7, 8):
        x = torch.randn(n, 2)
        torch.testing.assert_close(cf(x), view_write_dynamic(x))


def write_across_break(x):
    t = x[::2]
    t += 1
    print("break")
    t.mul_(2)
    return t


def test_view_written_on_both_sides_of_a_break(capsys):
    check(write_across_break, torch.randn(5))


def returned_view(y):
    t = y.t()
    t += 1
    return t


def test_returned_view_of_written_input_aliases_it():
    y = torch.zeros(2, 3)
    out = fuselens.compile(returned_view)(y)
    out.add_(100)
    assert y[0, 0].item() == 101


class Block(torch.nn.Module):
    """torchvision's ResNet BasicBlock: in-place ReLUs after BatchNorm, an in-place residual add."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


@pytest.mark.parametrize("train", [False, True])
def test_inplace_relu_block_real_backend(monkeypatch, train):
    """The kernels (in Triton's interpreter) compute eager's values and gradients."""
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    torch.manual_seed(0)
    m = Block().train(train)
    ref = copy.deepcopy(m)
    x = torch.randn(2, 4, 5, 5)
    xe, xc = x.clone().requires_grad_(train), x.clone().requires_grad_(train)
    want = ref(xe)
    got = fuselens.compile(m)(xc)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for b, b_ref in zip(m.buffers(), ref.buffers()):  # running statistics, updated once
        torch.testing.assert_close(b, b_ref)
        assert not b.requires_grad
    if train:
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)
        for p, p_ref in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("body", ["y.view(2, 3).narrow(1, 1, 2).mul_(3)", "y.view(2, 3).select(1, 0).zero_()",
                                  "y.view(2, 3).diagonal().fill_(5)", "torch.chunk(y, 3)[1].add_(1)",
                                  "y.view(2, 3).unbind(0)[1].neg_()", "y.view(3, 2).t().narrow(0, 0, 1).relu_()",
                                  "y.unsqueeze_(0); y.squeeze(0).add_(1)",
                                  # a base laid out in another dim order (a product of a transposed view)
                                  "y = y.view(2, 3).t() * 1; y.diagonal().fill_(5)"])
def test_writes_through_any_view_reach_the_base(tmp_path, body):
    """Views with no inverse of their own are written back by their strides."""
    mod = _module(tmp_path, f"v_{abs(hash(body))}", body)
    _, ex = check(mod.f, torch.randn(6), graphs=1, breaks=[])
    if "unsqueeze_" not in body:
        check(mod.g, torch.randn(6), graphs=1, breaks=[])


def convnext_block_no_grad(x, w):
    with torch.no_grad():
        r = w * x.permute(0, 2, 3, 1).mul(2).permute(0, 3, 1, 2)  # channels-last layout
        r += x  # through the detached result: the same elements
    return r


def test_write_into_a_no_grad_result_in_another_layout():
    """torchvision's ConvNeXt block in eval: `result += input` on a product laid out channels-last."""
    check(convnext_block_no_grad, torch.randn(2, 8, 4, 4), torch.rand(8, 1, 1, requires_grad=True),
          graphs=1, breaks=[])


def _activations_in_place(x, w):
    """Each in-place activation of torch.nn.functional (that draws no random numbers) on a fresh
    product that requires grad, and in-place products with an operand that requires grad."""
    h = x
    for name, extra in IN_PLACE_F.items():
        h = getattr(F, name)(h * w, *extra, inplace=True)
    h = h * 1.5
    h.mul_(w)
    h = h + 0.5
    h.div_(w.abs() + 1)
    h = h + 2
    h.pow_(w.sigmoid())
    return h


def _in_place_functionals():
    """name -> the arguments it needs after the tensor, of each function of torch.nn.functional
    with an `inplace` flag whose in-place call writes its input with no random numbers (dropout
    and rrelu in training draw them: those run on copies, as they must)."""
    out = {}
    for name, fn in vars(F).items():
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if name.startswith("_") or "inplace" not in params or "dropout" in name or name == "rrelu":
            continue
        out[name] = (0.1, 20.0) if name == "threshold" else ()
    return out


IN_PLACE_F = _in_place_functionals()


def test_in_place_writes_differentiated_as_their_functional_ops(monkeypatch):
    """An in-place op whose derivative reads its argument as it was (`silu_`, `hardswish_`,
    `mul_` by a tensor that requires grad: autograd copies the argument) or its result
    (`leaky_relu_`, `elu_`) is captured as its functional op, fused and differentiated by fuselens,
    with eager's values, gradients and version checks (it ran on copies with torch's autograd
    called at run time: EfficientNet's `SiLU(inplace=True)` made 98 such calls a training step;
    `leaky_relu_` after a convolution raised where eager does not)."""
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    assert {"silu", "hardswish", "hardsigmoid", "mish", "leaky_relu", "elu", "relu6"} <= set(IN_PLACE_F)
    torch.manual_seed(0)
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = _activations_in_place(x, w)
    want.square().sum().backward()
    c = fuselens.compile(_activations_in_place)
    got = c(x2, w2)
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close((x2.grad, w2.grad), (x.grad, w.grad))
    ir = "".join(g.ir for e in fuselens.inspect(c) for g in e.graphs)
    assert "on_copies" not in ir, [line for line in ir.split("\n") if "on_copies" in line]


def relu_then_write(x):
    t = torch.relu(x)
    t.mul_(2)  # into the value relu saved for backward: eager's backward refuses
    return t


@pytest.mark.parametrize("kernels", [True, False])
def test_backward_refused_after_a_write_into_a_saved_value(monkeypatch, kernels):
    """With kernels (Triton) and without (CPU graphs run as plain PyTorch), as eager refuses."""
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    if not kernels:
        monkeypatch.setattr(driver, "runs_kernels", lambda inputs: False)
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        relu_then_write(x).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fuselens.compile(relu_then_write)(x).sum().backward()


def _metadata_chain(x):
    y = x.clone()
    y.unsqueeze_(0)
    y.squeeze_(0)
    y.t_()
    return y


def _metadata_then_data(x):
    b = x.clone()
    y = b[1:]
    y.t_()
    y.mul_(2)  # reaches b through the transposed view
    return b, y, y.shape


def _view_before_metadata(x):
    y = x.clone()
    v = y[0]
    y.unsqueeze_(0)
    v.add_(1)  # v still views y's storage
    return y, v


@pytest.mark.parametrize("fn", [_metadata_chain, _metadata_then_data, _view_before_metadata])
def test_metadata_writes_of_locals_are_captured(fn):
    """`y.t_()` on a local: its new value is a view of the value it replaced; resuming after it
    makes it from that value, not from y's latest (which is itself: capture looped and fell back)."""
    check(fn, torch.randn(3, 4), graphs=1, breaks=[])


def test_writes_of_every_kind_in_one_graph_on_every_call():
    # the write-back of a graph decides at its first call which inputs it copies by one
    # `_foreach_copy_` per dtype (buffers), which one by one (a leaf written under no_grad, as an
    # optimizer does; two views of one storage): every later call writes each the same way
    def step(x, stats, counts, w, buf):
        h = x @ w
        stats.mul_(0.9).add_(h.mean(0), alpha=0.1)
        counts.add_(1)
        with torch.no_grad():
            w.sub_(0.01 * h.sum())
        buf[0].add_(1)
        buf[1].mul_(2)
        return h.relu()
    x = torch.randn(4, 8)
    check(step, x, torch.zeros(8), torch.zeros((), dtype=torch.long), torch.randn(8, 8).requires_grad_(),
          torch.ones(2, 3), calls=3)


def batch_norm_under_no_grad(x, running_mean, running_var, weight, bias):
    with torch.no_grad():
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True)
    return y, y * x


def test_a_call_run_on_copies_under_no_grad_returns_what_requires_no_grad():
    # the graph runs in grad mode: BatchNorm's output (its running statistics written on copies)
    # required grad through x where eager's does not (a backward from it reached x)
    check(batch_norm_under_no_grad, torch.randn(4, 3, 5, requires_grad=True), torch.zeros(3), torch.ones(3),
          torch.randn(3), torch.randn(3))


def cumsum_out(x, out):
    torch.cumsum(x, 0, out=out)
    return out + 1


def test_an_out_argument_resized_by_the_call_is_resized_in_the_callers_tensor():
    # eager resizes an `out=` of another shape; the write-back copied into the old shape (an error)
    check(cumsum_out, torch.randn(3, 4), torch.empty(0))


def index_select_into(y, index, out):
    return torch.index_select(y, 1, index, out=out)


def test_an_out_whose_elements_share_memory_is_refused_before_it_is_resized():
    # eager checks the `out=` as given (an expanded tensor), before resizing it to the result
    y, index = torch.rand(3, 6), torch.tensor([0, 1])
    for f in (index_select_into, fuselens.compile(index_select_into)):
        with pytest.raises(RuntimeError, match="unsupported operation"):
            f(y, index, torch.rand(1, 6).expand(2, 6))
