"""The torch API users call inside models, compiled: each entry point's result (and gradients,
where it has them) equals eager's, never a crash. Beside the random-program tester
(test_differential.py), which generates none of these: the `torch.compiler` API, custom
`autograd.Function`s, distributions, parametrizations, hooks, `torch.func`, checkpointing,
context managers and structured outputs."""
from __future__ import annotations

import contextlib
import dataclasses
import typing
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fuselens
from fuselens.capture.analyze import analyze_source
from fl_capture_testing import assert_same, check, clone_tree

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def check_grads(fn, *args, breaks=None):
    """`fn(*args)` (a scalar) compiled == eager, and so are the gradients of its inputs that
    require grad and of the parameters of the modules among the arguments."""
    def grads(f):
        a = clone_tree(args)
        for m in a:
            if isinstance(m, nn.Module):
                m.zero_grad(set_to_none=True)
        out = f(*a)
        out.backward()
        leaves = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves += [p for m in a if isinstance(m, nn.Module) for p in m.parameters()]
        return out.detach(), [t.grad for t in leaves]
    torch.manual_seed(0)
    want = grads(fn)
    cf = fuselens.compile(fn)
    for _ in range(2):
        torch.manual_seed(0)
        got = grads(cf)
        assert_same(got, want)
    if breaks is not None:
        ex = fuselens.explain(fn, *clone_tree(args))
        assert [b.code for b in ex.graph_breaks] == breaks, str(ex)


# ---------------------------------------------------------------------------- torch.compiler
@torch.compiler.disable
def _disabled(t):
    return t * 2


@torch._dynamo.disable
def _dynamo_disabled(t):
    return t * 3


def _plain(t):
    return t - 1


_called_disabled = torch.compiler.disable(_plain)


@torch.compiler.disable(recursive=False)
def _disabled_not_recursive(t):
    return _plain(t) * 4


@pytest.mark.parametrize("helper", [_disabled, _dynamo_disabled, _called_disabled, _disabled_not_recursive],
                         ids=["compiler.disable", "_dynamo.disable", "disable(fn)", "recursive=False"])
def test_compiler_disable_runs_eagerly_behind_a_break(helper):
    def f(x):
        return helper(x + 1).sin() + 1
    check(f, X, breaks=["FL141"])


def test_compiler_disable_on_a_method_and_a_forward():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @torch.compiler.disable
        def forward(self, x):
            return self.lin(x)

        @torch.compiler.disable
        def scale(self, x):
            return x * 2

    layer = Layer()

    def f(x):
        y = layer(x).relu()
        z = layer.scale(x + 1)
        return y + z
    check(f, X, breaks=["FL141", "FL141"])
    check_grads(lambda x: f(x).sum(), X.clone().requires_grad_())


def test_compiler_disable_break_seen_by_the_editor():
    src = ("import torch\n\n@torch.compiler.disable\ndef h(x):\n    return x * 2\n\n"
           "@torch._dynamo.disable(recursive=False)\ndef h2(x):\n    return x * 2\n\n"
           "@torch.compile\ndef f(x):\n    y = h(x + 1)\n    return h2(y).sin()\n")
    (fn,) = [f for f in analyze_source(src, "/tmp/fl_disable_example.py").functions if f.name == "f"]
    assert [b.code for b in fn.breaks] == ["FL141", "FL141"]


def test_is_compiling_is_true_while_compiled():
    def f(x):
        return x + 1 if torch.compiler.is_compiling() else x - 1
    assert_same(fuselens.compile(f)(X), X + 1)  # as under torch.compile
    assert_same(f(X), X - 1)


def test_allow_in_graph_function_is_captured():
    def helper(t):
        return t.sin() * 2
    allowed = torch.compiler.allow_in_graph(helper)

    def f(x):
        return allowed(x + 1) - 1
    check(f, X, graphs=1, breaks=[])


def test_mark_dynamic_makes_the_dim_dynamic_from_the_first_call():
    def f(x):
        return (x * 2).sum(0) + x.shape[0]
    cf = fuselens.compile(f)
    x = X.clone()
    torch._dynamo.mark_dynamic(x, 0)
    assert_same(cf(x), f(x))
    for n in (3, 6, 9):
        y = torch.randn(n, 8)
        assert_same(cf(y), f(y))
    assert len(fuselens.inspect(cf)) == 1  # no recompile on another row count


# ---------------------------------------------------------------------------- torch.distributions
def _normal(mu, log_sigma):
    d = torch.distributions.Normal(mu, log_sigma.exp())
    return d.log_prob(mu * 0.5).sum() + d.entropy().sum() + d.rsample().sum()


def _categorical(mu, log_sigma):
    d = torch.distributions.Categorical(logits=mu * log_sigma)
    return d.log_prob(torch.tensor([0, 1, 2, 3])).sum() + d.entropy().sum() + d.probs.sum()


def _bernoulli(mu, log_sigma):
    d = torch.distributions.Bernoulli(probs=torch.sigmoid(mu + log_sigma))
    return d.log_prob((mu > 0).float()).sum() + d.entropy().sum() + d.sample().sum()


@pytest.mark.parametrize("fn", [_normal, _categorical, _bernoulli], ids=lambda f: f.__name__[1:])
def test_distribution_methods_equal_eager(fn):
    """A distribution's methods are its class's Python code (found on the object, through its
    MRO), inlined: values and gradients as eager's (sampling with the same seed)."""
    mu = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    ls = torch.randn(4, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    check_grads(fn, mu, ls)


def _transformed(mu, log_sigma):
    t = torch.distributions.transforms.AffineTransform(mu, log_sigma.exp())
    return t.inv(mu * 3).sum() + t(mu).sum()  # (`t.inv`: an object of torch's Python, called)


def _gumbel(mu, log_sigma):
    # validation breaks in Distribution.__init__'s loop over constraints holding graph tensors
    g = torch.distributions.Gumbel(mu * 0, log_sigma.exp() + 1, validate_args=True)
    return g.log_prob(mu).sum()


@pytest.mark.parametrize("fn", [_transformed, _gumbel], ids=lambda f: f.__name__[1:])
def test_distribution_objects_of_torchs_python(fn):
    """A transform is a callable object of torch's Python: its `__call__` inlined, not an op.
    A break inside a loop whose remaining items hold graph tensors resumes with them."""
    mu = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    ls = torch.randn(4, 4, generator=torch.Generator().manual_seed(2)).requires_grad_()
    check_grads(fn, mu, ls)


class _Noisy:
    def __init__(self, t):
        self.a = t * 2
        print("made")  # a break inside `__init__`
        self.b = self.a + 1


def test_object_whose_init_breaks_is_the_call_result(capsys):
    """`cls(...)` whose `__init__` breaks: the caller goes on with the object (not `__init__`'s
    None), as with torch.distributions' validation (a data-dependent `if` in `__init__`)."""
    def f(x):
        o = _Noisy(x + 1)
        return o.a * o.b
    check(f, X, breaks=["FL100"])


# ---------------------------------------------------------------------------- autograd.Function
class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _StraightThrough(torch.autograd.Function):
    """Its backward is not its forward's derivative (which is 0): only the user's backward is right."""
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class _ProductAndArgmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        return x * y, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, g_idx):
        x, y = ctx.saved_tensors
        return (g * y if ctx.needs_input_grad[0] else None), (g * x if ctx.needs_input_grad[1] else None)


class _RandomMask(torch.autograd.Function):
    """Draws random numbers in its forward: a backward that recomputed the forward would differ."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        _RandomMask.calls += 1
        m = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(m)
        return x * m

    @staticmethod
    def backward(ctx, g):
        (m,) = ctx.saved_tensors
        return g * m


class _SetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x, k):
        return x * k

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.k = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class _AsksMetadata(torch.autograd.Function):
    """YOSO's backward: `if not g.is_contiguous(): g = g.contiguous()`, and shapes read."""
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.t() * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if not g.is_contiguous():
            g = g.contiguous()
        scale = 2.0 if x.dim() == 2 and g.shape[0] == x.size(1) else 3.0
        return g.t() * scale


_FUNCTION_CALLS = {
    "asks_metadata": lambda x, y: (_AsksMetadata.apply(x.sin()) * y.t()).sum(),
    "square": lambda x, y: _Square.apply(x.sin()).sum(),
    "straight_through": lambda x, y: (_StraightThrough.apply(x * 3) * y).sum(),
    "reverse": lambda x, y: _Reverse.apply(x.sin(), 0.5).sum() + y.sum(),
    "several_outputs": lambda x, y: (lambda p, i: p.sum() + i.float().sum())(*_ProductAndArgmax.apply(x, y)),
    "random_forward": lambda x, y: (_RandomMask.apply(x) * y).sum(),
    "setup_context": lambda x, y: _SetupContext.apply(x, 3.0).sum() + y.sum(),
}


@pytest.mark.parametrize("name", sorted(_FUNCTION_CALLS))
def test_custom_autograd_function_gradients_are_its_backward(name):
    """Where gradients are recorded: the user's backward gives them, traced into the graph as the
    VJP of the captured forward (of several outputs, the one that can have a gradient: an argmax
    beside it gets zeros, as from autograd); forward and backward run once each, as eager's. A
    function whose forward breaks the graph (a class attribute written) runs eagerly behind a
    break (FL142)."""
    fn = _FUNCTION_CALLS[name]

    def f(x, y):
        return fn(x + 1, y)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    y = torch.randn(4, 5, generator=torch.Generator().manual_seed(4)).requires_grad_()
    check_grads(f, x, y, breaks=["FL142"] if name == "random_forward" else [])


class _DataDependentBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 if x.sum() > 0 else -g  # Python decides on a tensor: no straight-line code


def test_custom_autograd_function_whose_backward_decides_on_a_tensor_breaks():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    check_grads(lambda x: _DataDependentBackward.apply(x.sin()).sum(), x, breaks=["FL142"])


def test_custom_autograd_function_backward_is_fused_into_the_backward_graph():
    """The traced backward's ops are primitives of the joint graph: a training step of a model
    with a custom activation in every block is one graph, its gradients eager's."""
    class Act(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * torch.sigmoid(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            s = torch.sigmoid(x)
            return g * s * (1 + x * (1 - s))

    torch.manual_seed(0)
    lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def f(lins, x):
        for lin in lins:
            x = Act.apply(lin(x)) + x
        return x.pow(2).sum()
    check_grads(f, lins, X.clone(), breaks=[])
    cf = fuselens.compile(f)
    cf(lins, X.clone()).backward()
    assert [len(e.graphs) for e in fuselens.inspect(cf)] == [1]


def test_custom_autograd_function_runs_its_forward_once():
    def f(x):
        return _RandomMask.apply(x * 2).sum()
    cf = fuselens.compile(f)
    x = X.clone().requires_grad_()
    for _ in range(2):
        _RandomMask.calls = 0
        cf(x).backward()
        assert _RandomMask.calls == 1


def test_custom_autograd_function_without_gradients_is_captured():
    """In inference its forward is code like any other: captured, with its context object."""
    def f(x):
        with torch.no_grad():
            a = _StraightThrough.apply(x * 3)
        p, i = _ProductAndArgmax.apply(x.detach(), x.detach() + 1)
        return a + p + i[:, None] + _SetupContext.apply(x.detach(), 2.0)
    check(f, X.clone().requires_grad_(), graphs=1, breaks=[])


# ---------------------------------------------------------------------------- parametrizations
_PARAMETRIZE = {
    "weight_norm": lambda lin: nn.utils.parametrizations.weight_norm(lin),
    "spectral_norm": lambda lin: nn.utils.parametrizations.spectral_norm(lin),
    "orthogonal": lambda lin: nn.utils.parametrizations.orthogonal(lin),
}


@pytest.mark.parametrize("name", sorted(_PARAMETRIZE))
def test_parametrized_linear_equals_eager(name):
    torch.manual_seed(0)
    lin = _PARAMETRIZE[name](nn.Linear(8, 8))
    lin.eval()  # (spectral_norm's power iteration writes its vectors in training)
    model = nn.Sequential(lin, nn.ReLU())
    check_grads(lambda m, x: m(x).sum(), model, X.clone())


# ---------------------------------------------------------------------------- hooks
def test_forward_hooks_and_pre_hooks_on_submodules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    seen = []
    model[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    model[2].register_forward_hook(lambda mod, args, out: out + 1)
    model[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    check_grads(lambda m, x: m(x).sum(), model, X.clone())
    assert seen and all(s == (4, 8) for s in seen)


def test_forward_hook_with_kwargs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    model[0].register_forward_hook(lambda mod, args, kwargs, out: out * 3, with_kwargs=True)
    check_grads(lambda m, x: m(x).sum(), model, X.clone())


# ---------------------------------------------------------------------------- torch.func
def test_functional_call():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    params = {k: v.detach() * 2 for k, v in lin.named_parameters()}

    def f(x):
        return torch.func.functional_call(lin, params, (x,))
    check(f, X)


def test_vmap():
    def f(x):
        return torch.func.vmap(lambda row: row.sin() * row.sum())(x)
    check(f, X)


def test_grad():
    def f(x):
        return torch.func.grad(lambda t: (t.sin() ** 2).sum())(x)
    check(f, X)


# ---------------------------------------------------------------------------- checkpointing
class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def block(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        y = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return (y * x).sum()


class _BreakInside(_Checkpointed):
    def block(self, x):
        print("inside")  # (a break: the checkpoint call runs in Python)
        return self.b(torch.relu(self.a(x)))


def test_checkpoint_is_captured_and_recomputed_in_the_backward():
    """Training: the checkpointed call is captured, its ops marked to be recomputed in the
    backward (tests/backend/test_min_cut.py: what the forward saves); inference: captured as the
    call. A break inside the function runs the call in Python."""
    torch.manual_seed(0)
    model = _Checkpointed()
    x = torch.randn(64, 8, requires_grad=True)
    check_grads(lambda m, x: m(x), model, x)
    check(lambda x: model(x), x, graphs=1, breaks=[])
    with torch.no_grad():
        check(lambda x: model(x), X, breaks=[])
    breaking = _BreakInside()
    check_grads(lambda m, x: m(x), breaking, x)
    check(lambda x: breaking(x), x, breaks=["FL180"])


# ---------------------------------------------------------------------------- context managers
class _Scaled:
    """A user's own context manager."""
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")
        return 2.0

    def __exit__(self, *exc):
        self.log.append("exit")
        return False


@contextlib.contextmanager
def _generator_manager(k):
    yield k * 2


_MANAGERS = {
    "no_grad": lambda x: _in(torch.no_grad(), x),
    "enable_grad": lambda x: _in(torch.enable_grad(), x),
    "set_grad_enabled": lambda x: _in(torch.set_grad_enabled(False), x),
    "inference_mode": lambda x: _in(torch.inference_mode(), x),
    "autocast": lambda x: _in(torch.autocast("cpu", dtype=torch.bfloat16), x),
    "nullcontext": lambda x: _in(contextlib.nullcontext(), x),
    "own_class": lambda x: _in(_Scaled([]), x),
    "contextmanager": lambda x: _in(_generator_manager(3), x),
}


def _in(cm, x):
    w = x + 1
    with cm as k:
        y = (w @ w.T).float() * (k if isinstance(k, (int, float)) else 1)
    return y.sum() + w.sum()


@pytest.mark.parametrize("name", sorted(_MANAGERS))
def test_context_managers(name):
    fn = _MANAGERS[name]
    x = X.clone().requires_grad_()
    if name in ("no_grad", "set_grad_enabled", "inference_mode"):
        check(fn, x)
    else:
        check_grads(fn, x)


# ---------------------------------------------------------------------------- structured outputs
@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    loss: typing.Optional[torch.Tensor] = None


class _Pair(typing.NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class _ModelOutputLike(dict):
    """transformers' ModelOutput in small: a dict whose items are also attributes."""
    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None

    def __setattr__(self, k, v):
        self[k] = v


def test_dataclass_output():
    def f(x):
        return _Out(logits=x.sin(), loss=x.sum())
    check(f, X)


def test_namedtuple_output():
    def f(x):
        p = _Pair(x.sin(), x.cos())
        return _Pair(p.first + 1, p.second * 2)
    check(f, X)


class _Rows(list):
    pass


def test_model_output_like_dict_subclass():
    def f(x):
        out = _ModelOutputLike(logits=x.sin())
        out.loss = out.logits.sum()
        return out
    check(f, X, breaks=[])


def test_list_and_ordered_dict_subclasses_holding_tensors():
    import collections

    def f(x):
        rows = _Rows([x.sin(), x.cos()])
        rows.append(x + 1)
        d = collections.OrderedDict(first=rows[0], last=rows[-1])
        return rows, d
    check(f, X, breaks=[])


def test_set_grad_enabled_leaves_grad_mode_as_eager_does():
    """`torch.set_grad_enabled(mode)` sets grad mode when made: as a `with` item it is restored
    on exit (capture once left it off for the whole process); called on its own it sets it for
    the code after it (a break: Python sets it)."""
    def in_with(x):
        with torch.set_grad_enabled(False):
            y = x * 2
        return y + x

    def bare(x):
        torch.set_grad_enabled(False)
        y = x * 2
        torch.set_grad_enabled(True)
        return y + x
    x = X.clone().requires_grad_()
    check(in_with, x, breaks=[])
    assert torch.is_grad_enabled()
    check(bare, x, breaks=["FL151", "FL151"])
    assert torch.is_grad_enabled()


def test_hooks_registered_or_removed_after_a_call_recompile():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def f(x):
        return model(x).sum()
    cf = fuselens.compile(f)
    assert_same(cf(X), f(X))
    handle = model[0].register_forward_hook(lambda mod, args, out: out * 2)
    assert_same(cf(X), f(X))
    handle.remove()
    assert_same(cf(X), f(X))
    pre = model[1].register_forward_pre_hook(lambda mod, args: (args[0] - 1,))
    assert_same(cf(X), f(X))
    pre.remove()


@torch.compiler.disable
class _DisabledClass:
    def __init__(self, t):
        self.t = t * 2

    def __call__(self, t):
        return t + self.t


def test_compiler_disable_on_a_class():
    """On a class, torch.compiler.disable marks its `__init__` and `__call__`."""
    def f(x):
        obj = _DisabledClass(x + 1)
        y = obj(x)
        return y.sin()
    check(f, X, breaks=["FL141", "FL141"])


def test_compiler_disable_on_a_method_seen_by_the_editor():
    src = ("import torch\nimport torch.nn as nn\n\nclass M(nn.Module):\n"
           "    @torch.compiler.disable\n    def helper(self, x):\n        return x * 2\n\n"
           "    def forward(self, x):\n        y = self.helper(x + 1)\n        return y.sin()\n\n"
           "m = torch.compile(M())\n")
    (fn,) = [f for f in analyze_source(src, "/tmp/fl_disable_method.py").functions if f.name == "forward"]
    assert [b.code for b in fn.breaks] == ["FL141"]


class _WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(2):
            x = _StraightThrough.apply(self.lin(x)) + x
        return x


def test_custom_autograd_function_inside_a_module_and_a_loop():
    torch.manual_seed(0)
    model = _WithFunction()
    check_grads(lambda m, x: m(x).sum(), model, X.clone(), breaks=[])
    with torch.no_grad():
        check(lambda x: model(x), X, breaks=[])


class _LazySoftmax:
    """A non-data descriptor with a Python `__get__` (as torch.distributions' lazy_property)."""

    def __get__(self, instance, owner):
        value = instance.logits.softmax(-1)
        instance.__dict__["probs"] = value
        return value


class _Lazy:
    probs = _LazySoftmax()

    def __init__(self, logits):
        self.logits = logits


def test_a_descriptors_python_get_is_evaluated():
    """A descriptor's `__get__` is code like the user's: evaluated on the capture's values, not
    run natively on them (it failed with "'TensorVar' object has no attribute 'softmax'")."""
    def f(x):
        o = _Lazy(x * 2)
        return (o.probs + o.probs).sum()
    mu = torch.randn(3, 5, generator=torch.Generator().manual_seed(3)).requires_grad_()
    check_grads(f, mu)
