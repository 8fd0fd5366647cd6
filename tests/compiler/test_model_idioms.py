"""Idioms of real model code (torchvision, timm, HF transformers) captured whole: each test is
the reduction of a construct one of those libraries uses."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fuselens
from fl_capture_testing import check


class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.relative_position_bias_table = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("relative_position_index", torch.arange(4))

    def forward(self, x):
        return x + self.relative_position_bias_table[self.relative_position_index]


class _Swin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Module()])])
        self.features[0][0].attn = _Attn()

    def forward(self, x):
        return self.features[0][0].attn(x)


def test_inputs_whose_sources_share_a_long_prefix():
    """torchvision swin_t: `...attn.relative_position_bias_table` and `...attn.relative_position_index`
    agree in their first 40 characters; the graph's parameters stay distinct."""
    with torch.no_grad():
        check(_Swin(), torch.randn(4), graphs=1, breaks=[])


def lookup_or_default(x, table):
    try:
        scale = table["scale"]
    except KeyError:
        scale = 3.0
    else:
        scale = scale * 2
    finally:
        x = x + 1
    return x * scale


def is_compiling_like_transformers(x):
    try:  # transformers' is_torchdynamo_compiling()
        import torch
        compiling = torch.compiler.is_compiling()
    except Exception:
        compiling = False
    return x * 2 if compiling else x - 1


def return_inside_try(x):
    try:
        return x.sin()
    finally:
        x.add_(1)


def break_inside_try(x):
    try:
        y = x * 2
        print("in try")  # a graph break: the whole statement runs in Python
    except ValueError:
        y = x
    return y.cos()


def raise_and_handle(x, n):
    try:
        if n > 2:
            raise ValueError("too big")
        y = x * n
    except (TypeError, ValueError) as err:
        y = x * len(str(err))
    return y


STORE = {"n": 0}


def try_finally_counts(x):
    try:
        y = x * 2
    finally:
        STORE["n"] += 1  # a side effect replayed once per call
    return y + 1


def test_try_statements_are_captured():
    """A `try` runs in the graph: handlers, `else` and `finally` as in Python."""
    check(lookup_or_default, torch.randn(3), {"scale": 0.5}, graphs=1, breaks=[])
    check(lookup_or_default, torch.randn(3), {}, graphs=1, breaks=[])
    x = torch.randn(3)  # compiled code takes the branch torch.compile takes, not eager's
    torch.testing.assert_close(fuselens.compile(is_compiling_like_transformers)(x), x * 2)
    assert len(fuselens.explain(is_compiling_like_transformers, x).graphs) == 1
    check(return_inside_try, torch.randn(3), graphs=1, breaks=[])
    check(raise_and_handle, torch.randn(3), 1, graphs=1, breaks=[])
    check(raise_and_handle, torch.randn(3), 5, graphs=1, breaks=[])
    STORE["n"] = 0
    cf = fuselens.compile(try_finally_counts)
    for _ in range(3):
        cf(torch.randn(3))
    assert STORE["n"] == 3 and len(fuselens.explain(try_finally_counts, torch.randn(3)).graph_breaks) == 0


def test_break_inside_try_runs_the_statement_in_python(capsys):
    check(break_inside_try, torch.randn(3), breaks=["FL100"])
    assert capsys.readouterr().out.count("in try") == 6  # once each: eager, 2 compiled calls, both on other values, explain


def _inner_with_break(x):
    y = x.sin() * 2
    print("inner")                 # the break
    return y.cos() + 1


def _outer_with_try(x):
    try:                           # as transformers wraps each forward
        out = _inner_with_break(x * 3)
    finally:
        pass
    return out.relu()


def test_call_inside_a_statement_run_in_python_is_compiled_on_its_own(capsys):
    """The `try` runs in Python because of the break inside the callee; the callee is compiled
    on its own there (as torch.compile compiles each frame Python enters): its code before and
    after its break still runs in graphs."""
    check(_outer_with_try, torch.randn(3), calls=3)
    ex = fuselens.explain(_outer_with_try, torch.randn(3))
    ops = sorted(str(n.target) for g in ex.graphs for n in g.graph.nodes if n.op == "call_function")
    assert any("sin" in o for o in ops) and any("cos" in o for o in ops), ops


def _wraps(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("scale", 2.0)
        return fn(self, *args, **kwargs)
    return wrapper


class Decorated(torch.nn.Module):
    """HF transformers decorates every `forward` (`@can_return_tuple`, `@auto_docstring`...)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    @_wraps
    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


def test_decorated_forward_is_captured_through_its_wrapper():
    check(Decorated(), torch.randn(2, 3), graphs=1, breaks=[])


class _Base:
    def get(self, k, d=None):
        return d


class _Registry(_Base):
    """transformers' `_CanRecordRegistry.get`: `super().get(...)` in a helper class."""

    def get_interface(self, k, d):
        return super().get(k, d)


_REG = _Registry()


class _Scaled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _ScaledPrinting(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x) * 2
        print("break")                       # a break inside a method that uses super()
        return super().forward(y).relu()     # ... and super() after it, in the resume


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _ScaledPrinting(3, 3)

    def forward(self, x):
        return self.inner(x) + 1             # the break is inside an inlined method


def act_from_registry(x):
    act = _REG.get_interface("gelu", torch.relu)
    return act(x) * 2


def test_zero_argument_super():
    check(act_from_registry, torch.randn(3), graphs=1, breaks=[])
    check(_Scaled(3, 3), torch.randn(2, 3), graphs=1, breaks=[])


def test_zero_argument_super_in_code_around_a_break(capsys):
    """Generated functions (the transformed function, break helpers, resumes) have no
    `__class__` cell: their `super()` is written `super(cls, self)`."""
    check(_ScaledPrinting(3, 3), torch.randn(2, 3), breaks=["FL100"])
    check(_Outer(), torch.randn(2, 3), breaks=["FL100"])


LIB = '''
import torch

PREFIX = "pkg"


def log_usage(obj):
    print("used", obj.__name__)  # a graph break inside the callee
    return obj.__module__.startswith(PREFIX)


def scale(x, p):
    if not torch.jit.is_scripting():
        log_usage(scale)
    return x * p
'''


def test_break_inside_a_callee_from_another_module_uses_its_globals(tmp_path, capsys):
    """The breaking statement and the rest of the callee run with the callee's own module globals."""
    import importlib.util
    path = tmp_path / "other_lib.py"
    path.write_text(LIB)
    spec = importlib.util.spec_from_file_location("other_lib", path)
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)

    def f(x):
        return lib.scale(x, 0.5) + 1
    check(f, torch.randn(3), breaks=["FL100"])


def plain_value_idioms(x):
    torch._assert(x.dim() == 2, "expected 2-d")  # torchvision's shape checks
    name = type(x).__name__
    if name.startswith("Ten") and "{}-{}".format(*x.shape) == "2-3" and not torch.jit.is_tracing():
        x = x * 2
    return x + 1


def test_plain_values_compute_in_python():
    """Methods of str and other immutable builtins, torch._assert on a Python bool, and the
    tracer queries (False under torch.compile) run during capture: no graph break."""
    check(plain_value_idioms, torch.randn(2, 3), graphs=1, breaks=[])


class _Interface(__import__("collections.abc").abc.MutableMapping):
    """transformers' AttentionInterface: a registry that is a MutableMapping of functions."""
    _global = {"sdpa": torch.nn.functional.scaled_dot_product_attention}

    def __init__(self):
        self._local = {}

    def __getitem__(self, k):
        return self._local[k] if k in self._local else self._global[k]

    def __setitem__(self, k, v):
        self._local[k] = v

    def __delitem__(self, k):
        del self._local[k]

    def __iter__(self):
        return iter({**self._global, **self._local})

    def __len__(self):
        return len(self._global) + len(self._local)

    def get_interface(self, name, default):
        if name != "eager" and name not in self:
            raise KeyError(name)
        return super().get(name, default)  # Mapping.get: the standard library's, no source


_ATTN = _Interface()


def attention_from_registry(q, impl):
    import inspect
    assert "impl" in inspect.signature(attention_from_registry).parameters
    fn = _ATTN.get_interface(impl, None)
    return fn(q, q, q) * 2


def test_registries_and_the_standard_library_run_in_python():
    """`in` on a user mapping asks its own `__contains__`; a standard-library function on plain
    values (`inspect.signature`, `Mapping.get` of a frozen module) runs in Python."""
    check(attention_from_registry, torch.randn(1, 2, 4, 8), "sdpa", graphs=1, breaks=[])


def _nest(x, n):
    return x * 2 if n == 0 else _nest(x, n - 1) + 1


def test_calls_nest_as_deep_as_real_models():
    """HF models reach 20+ frames (decorators, layers, attention interfaces): captured whole."""
    check(_nest, torch.randn(3), 30, graphs=1, breaks=[])


class _Noisy(torch.nn.Module):
    def forward(self, x):
        torch._C._log_api_usage_once("fuselens.tests")  # torchvision's telemetry: no break
        print("noisy")
        return x * 2


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(3, 3), _Noisy(), torch.nn.ReLU())

    def forward(self, x):
        return self.block(x) + 1


def test_break_inside_a_sequential_continues_in_the_graph(capsys):
    """The continuation of torch's own `Sequential.forward` after a break is fuselens's code,
    not a torch op (its globals are torch's module's)."""
    check(_Outer(), torch.randn(2, 3), graphs=2, breaks=["FL100"])


def kind_flags(x):
    # nn.MultiheadAttention: `assert not query.is_nested, ...` outside its fast path
    assert not x.is_nested and not x.is_sparse and x.is_cpu and not x.is_meta
    return x * 2


def test_tensor_kind_flags_are_the_tensors_own():
    check(kind_flags, torch.randn(3), graphs=1, breaks=[])


def test_multihead_attention_outside_its_fast_path():
    """torchvision's vit_b_16 encoder: nn.MultiheadAttention with grad enabled."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)

    def f(q):
        return mha(q, q, q, need_weights=False)[0]
    check(f, x, graphs=1)


def test_multihead_attention_real_backend(monkeypatch):
    """nn.MultiheadAttention trained through real kernels: its (out, None) result, the None given
    no gradient."""
    from fuselens.backend import driver
    from test_inplace import REAL_COMPILE_GRAPH
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def f(q):
        return mha(q, q, q, need_weights=False)[0]
    x = torch.randn(2, 5, 8, requires_grad=True)
    check(f, x, graphs=1)


def overrides_check(x, w):
    # nn.MultiheadAttention's fast-path test in eval
    if torch.overrides.has_torch_function((x, w)) or torch._C._has_torch_function_unary(x):
        return x
    return x * w


def test_torch_function_queries_answer_false_for_plain_tensors():
    check(overrides_check, torch.randn(3), torch.randn(3), graphs=1, breaks=[])


def test_multihead_attention_fast_path_in_eval(monkeypatch):
    """vit_b_16 in eval: nn.MultiheadAttention's fast-path checks (`_check_arg_device`, the
    dispatch-mode stack) are answered during capture; its fused kernel returns (out, None)."""
    from fuselens.backend import driver
    from test_inplace import REAL_COMPILE_GRAPH
    monkeypatch.setattr(driver, "compile_graph", REAL_COMPILE_GRAPH)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()

    def f(q):
        return mha(q, q, q, need_weights=False)[0]
    with torch.no_grad():
        check(f, torch.randn(2, 5, 8), graphs=1, breaks=[])


class _Rotary(torch.nn.Module):
    """transformers' rotary embeddings: a forward decorated with `@torch.no_grad()`."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4))

    @torch.no_grad()
    def forward(self, x):
        return (x[..., None] * self.inv_freq).cos()


class _WithRotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = _Rotary()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.rotary(x)).sum(-1)


def test_function_decorated_with_a_grad_mode():
    x = torch.randn(2, 3, requires_grad=True)
    check(_WithRotary(), x, graphs=1, breaks=[])


class _RotaryWithBreak(_Rotary):
    @torch.no_grad()
    def forward(self, x):
        y = (x[..., None] * self.inv_freq).cos()
        print("break")              # inside the grad-mode decorator's `with ctx_factory():`
        return y * 2


def test_break_inside_a_grad_mode_decorator(capsys):
    m = _WithRotary()
    m.rotary = _RotaryWithBreak()
    check(m, torch.randn(2, 3, requires_grad=True))


class _ParameterContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(1, 8)) for _ in range(3)])
        self.pd = nn.ParameterDict({"a": nn.Parameter(torch.randn(8)), "b": nn.Parameter(torch.randn(8))})

    def forward(self, x):
        for w in self.ws:
            x = x + w.expand(4, 8)
        for k in self.pd:
            x = x * self.pd[k]
        return x + self.ws[-1]


def test_parameters_of_a_parameter_list_or_dict_are_graph_inputs():
    """Reformer's `self.weights[0].expand(...)`: an item of an nn.ParameterList (by index or
    iterated) or nn.ParameterDict is the parameter as a graph input (its methods had broken:
    FL140 `Parameter.expand`)."""
    check(_ParameterContainers(), torch.randn(4, 8), graphs=1, breaks=[])


class _TransposedLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return nn.LayerNorm.forward(self, x.permute(0, 2, 1)).permute(0, 2, 1)


class _Conv(nn.Conv1d):
    def forward(self, x):
        return nn.Conv1d.forward(self, x) + nn.Conv1d._conv_forward(self, x, self.weight, None)


@pytest.mark.parametrize("make", [lambda: (_TransposedLayerNorm(4), torch.randn(2, 4, 3)),
                                  lambda: (_Conv(3, 5, 3), torch.randn(2, 3, 9))], ids=["LayerNorm", "Conv1d"])
def test_a_torch_module_method_called_through_its_class_is_inlined(make):
    """SqueezeBERT's `nn.LayerNorm.forward(self, x)`: a method of torch's module classes called
    through the class runs as the module's call would (it had been taken for an op of a module
    argument: FL180)."""
    m, x = make()
    check(m, x, graphs=1, breaks=[])


class _Router(nn.Module):
    """Switch Transformers' and NLLB-MoE's router: `self.classifier.to(self.dtype)` in forward."""

    def __init__(self, cast):
        super().__init__()
        self.classifier, self.cast = nn.Linear(8, 4), cast

    def forward(self, x):
        self.classifier = self.cast(self.classifier, x)
        return self.classifier(x).softmax(-1)


@pytest.mark.parametrize("cast", [lambda m, x: m.to(x.dtype), lambda m, x: m.float(),
                                  lambda m, x: m.to("cpu", torch.float32)], ids=["to", "float", "to device dtype"])
def test_a_module_converted_to_what_it_is_in_forward_is_itself(cast):
    check(_Router(cast), torch.randn(2, 8), graphs=1, breaks=[])


def test_a_module_converted_in_forward_to_another_dtype_runs_in_python():
    torch.manual_seed(0)
    eager, compiled = _Router(lambda m, x: m.to(x.dtype)), _Router(lambda m, x: m.to(x.dtype))
    compiled.load_state_dict(eager.state_dict())
    cm = fuselens.compile(compiled)
    for dtype in (torch.float32, torch.float64, torch.float64):
        x = torch.randn(2, 8, dtype=dtype)
        torch.testing.assert_close(cm(x), eager(x), rtol=0, atol=0)
        assert compiled.classifier.weight.dtype == eager.classifier.weight.dtype == dtype
    assert any(e.graph_break is not None and "converts the module's parameters" in e.graph_break.detail
               for e in fuselens.inspect(cm))


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda c: c.__name__)
def test_recurrent_modules_are_captured_whole(rnn):
    """Their forward checks its weights by calling the `weakref.ref`s it holds: a referent found
    at its source each call (a tensor: the same graph input as the parameter)."""
    torch.manual_seed(0)
    m = rnn(8, 8, num_layers=2, batch_first=True)
    check(lambda x: m(x)[0].sum(), torch.randn(2, 5, 8), graphs=1, breaks=[])
    x = torch.randn(2, 5, 8)
    m.zero_grad()
    m(x)[0].sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    fuselens.compile(m)(x)[0].sum().backward()
    for g, w in zip([p.grad for p in m.parameters()], want):
        torch.testing.assert_close(g, w)
