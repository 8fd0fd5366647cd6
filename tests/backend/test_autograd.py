"""Joint graph, min-cut partition, compiled backward, random numbers, fallbacks."""
import pytest
import torch
import torch.nn.functional as F

import fuselens
from fl_backend_testing import DEVICE, check, compile, run, tolerance, trace, triton_kernels
from fuselens import settings
from fuselens.autograd import build_joint, partition
from fuselens.autograd.partition import _bytes, _tangent_dependent
from fuselens.codegen import launcher
from fuselens.ops import to_primitive_graph
from fuselens.backend import driver
from fuselens.errors import FuselensWarning
from test_fusion import manual_gelu_tanh, manual_layer_norm, manual_softmax, sin_plus_cos


def randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def joint_of(fn, *inputs):
    gm = trace(fn)
    return build_joint(to_primitive_graph(gm, inputs, DEVICE), [True] * len(inputs), DEVICE)


def save_everything(joint):
    """What a partition without recomputation saves: every forward value a backward node uses."""
    in_backward = _tangent_dependent(joint.graph)
    return [n for n in joint.graph.nodes
            if n.op != "output" and n not in in_backward and any(u in in_backward for u in n.users)]


@pytest.mark.parametrize("fn,shapes", [
    (manual_gelu_tanh, [(6, 7)]),
    (manual_layer_norm, [(5, 12), (12,), (12,)]),
    (manual_softmax, [(4, 9)]),
    (sin_plus_cos, [(3, 8), (3, 8)]),
])
def test_gradients_match_eager(fn, shapes):
    cg = check(fn, *[randn(*s) for s in shapes])
    assert len(cg.kernels) >= 2  # a forward kernel and a backward kernel


@pytest.mark.parametrize("fn,shapes", [(manual_gelu_tanh, [(6, 7)]), (manual_layer_norm, [(5, 12), (12,), (12,)])])
def test_min_cut_saves_less_than_everything(fn, shapes):
    joint = joint_of(fn, *[randn(*s) for s in shapes])
    saved = [n for n in joint.graph.nodes if n.name in partition(joint).saved]
    everything = save_everything(joint)
    assert sum(map(_bytes, saved)) < sum(map(_bytes, everything))
    if fn is manual_gelu_tanh:
        assert [n.name for n in saved] == ["x"]  # the whole GeLU is recomputed from its input


def test_matmuls_and_random_ops_are_never_recomputed():
    def f(x, w):
        return F.dropout(torch.tanh(x @ w), p=0.3).sum()
    joint = joint_of(f, randn(4, 5), randn(5, 6))
    parts = partition(joint)
    backward_prims = [n.target.name for n in parts.backward.nodes if n.op == "call_function"]
    assert backward_prims.count("mm") == 2  # the two gradient matmuls, not the forward one again
    assert "rand" not in backward_prims


def test_dropout_is_reproducible_and_its_backward_uses_the_forward_mask():
    def f(x):
        return F.dropout(x, p=0.4, training=True)
    x = randn(64, 33).requires_grad_()
    cg = compile(f, x)
    torch.manual_seed(0)
    a = cg(x)[0]
    torch.manual_seed(0)
    b = cg(x)[0]
    c = cg(x)[0]
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)
    kept = a != 0
    assert 0.5 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(a[kept], x[kept] / 0.6)
    g = torch.randn_like(a)
    (grad,) = torch.autograd.grad(a, x, g)
    torch.testing.assert_close(grad, torch.where(kept, g / 0.6, torch.zeros_like(g)))


def test_rand_and_randn_statistics():
    def f(x):
        return torch.rand(x.shape, device=x.device) + x, torch.randn(x.shape, device=x.device) * 2
    x = torch.zeros(100, 100, device=DEVICE)
    u, n = run(f, x)[1]
    assert 0.45 < u.mean().item() < 0.55 and u.min() >= 0 and u.max() < 1
    assert abs(n.mean().item()) < 0.1 and 1.9 < n.std().item() < 2.1


def test_outputs_not_requiring_grad_and_integer_outputs():
    def f(x, y):
        return x * y, (x > 0).sum(), y.detach() * 2
    check(f, randn(3, 4), randn(4))


@triton_kernels
def test_codegen_failure_falls_back_to_eager_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("codegen exploded")
    monkeypatch.setattr(driver, "generate_kernel", broken)
    x = randn(4, 5)
    gm = trace(manual_softmax)
    cg = driver.compile_graph(gm, [x])
    with pytest.warns(FuselensWarning, match="codegen exploded"):  # at the call, whose eager run succeeds
        out = cg(x)[0]
    torch.testing.assert_close(out, manual_softmax(x))


def test_cpu_graphs_run_eagerly_where_the_cpu_backend_is_eager(monkeypatch):
    monkeypatch.setattr(settings, "CPU_BACKEND", "eager")
    x = torch.randn(4, 5)
    gm = trace(manual_softmax)
    cg = driver.compile_graph(gm, [x])
    calls = []
    real = launcher.TritonKernel.run
    monkeypatch.setattr(launcher.TritonKernel, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    torch.testing.assert_close(cg(x)[0], manual_softmax(x))
    assert calls == [] and len(cg.kernels) == 1  # kernels are generated (to be shown), not run


@pytest.mark.parametrize("grad_out_requires_grad", [False, True])
def test_a_second_derivative_is_refused_saying_what_to_do(grad_out_requires_grad):
    """backward(create_graph=True) through a compiled function raises at once, naming what to do:
    the gradients it would return have no graph, so a gradient penalty added to a loss would lose
    its second-order term silently (the incoming gradient of a `.sum()` needs none), where eager
    differentiates it. A backward without create_graph afterwards still works."""
    x = randn(3, 3).requires_grad_()
    cg = compile(lambda x: torch.sin(x) * x, x)
    out = cg(x)[0]
    g_out = torch.ones_like(out).requires_grad_(grad_out_requires_grad)
    with pytest.raises(RuntimeError, match="create_graph=True.*uncompiled"):
        torch.autograd.grad(out, x, g_out, create_graph=True)
    (g,) = torch.autograd.grad(cg(x)[0], x, torch.ones(3, 3, device=DEVICE))
    torch.testing.assert_close(g, torch.cos(x) * x + torch.sin(x))


def test_backward_with_noncontiguous_incoming_gradient():
    x = randn(5, 6).requires_grad_()
    cg = compile(manual_gelu_tanh, x)
    out = cg(x)[0]
    (g,) = torch.autograd.grad(out.sum(), x)  # sum's backward hands an expanded (stride 0) gradient
    expected = torch.autograd.grad(manual_gelu_tanh(x).sum(), x)[0]
    torch.testing.assert_close(g, expected)


def _linear_gelu_linear(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def test_a_matmul_operand_is_saved_not_recomputed():
    # the GeLU output is in memory for the forward's second matmul anyway; recomputing it would
    # make the backward write it again for the weight gradient's matmul
    joint = joint_of(_linear_gelu_linear, randn(8, 16), randn(32, 16), randn(32), randn(4, 32), randn(4))
    parts = partition(joint)
    prim = lambda n: getattr(n.target, "name", None)
    second_matmul = [n for n in joint.graph.nodes if prim(n) in ("mm", "addmm")][1]
    gelu_out = second_matmul.args[-2]
    assert prim(gelu_out) == "mul" and gelu_out.name in parts.saved


@pytest.mark.parametrize("activation", [torch.relu, lambda h: F.threshold(h, 0.5, 0.5),
                                        lambda h: torch.where(h >= 1.0, 1.0, h)], ids=["relu", "threshold", "where"])
def test_a_clamping_activation_saves_no_mask_beside_its_result(activation):
    """relu between two linears: the second saves relu's result for its weight gradient, and
    relu's backward reads its mask from that result (as eager's threshold_backward): the
    partition saves the same bytes as eager's autograd, no boolean mask beside them."""
    def f(x, w1, w2):
        return activation(x @ w1) @ w2

    inputs = [randn(8, 16).requires_grad_(), randn(16, 32).requires_grad_(), randn(32, 4).requires_grad_()]
    joint = joint_of(f, *inputs)
    saved_dtypes = [n.meta["val"].dtype for n in joint.graph.nodes if n.name in partition(joint).saved]
    assert torch.bool not in saved_dtypes, saved_dtypes
    check(f, *inputs)


def test_a_max_pools_backward_needs_no_copy_of_its_input():
    """A GroupNorm ResNet's stem, conv -> GroupNorm -> ReLU -> max pool: the pooling's backward
    reads its offsets and its input's shape alone, so the forward saves the convolution's result
    (which the GroupNorm's backward needs) and not the pooled ReLU output beside it (a 64x112x112
    image a sample at ResNet-50's size, held until the backward)."""
    def f(x, w, gamma, beta):
        return F.max_pool2d(torch.relu(F.group_norm(F.conv2d(x, w), 2, gamma, beta)), 3, 2, 1)

    inputs = [randn(2, 3, 10, 10).requires_grad_(), randn(4, 3, 3, 3).requires_grad_(),
              randn(4).requires_grad_(), randn(4).requires_grad_()]
    joint = joint_of(f, *inputs)
    saved_shapes = [tuple(n.meta["val"].shape) for n in joint.graph.nodes if n.name in partition(joint).saved]
    assert saved_shapes.count((2, 4, 8, 8)) == 1, saved_shapes
    check(f, *inputs)
    check(f, *[x.to(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs])


def test_multihead_attention_stores_each_copy_once():
    """nn.MultiheadAttention (torchvision's ViT), batch first: its input transposed and flattened
    for the packed projection is a copy (a reshape that cannot view), which the weight's gradient
    reads again: saved, not the input copied and transposed again in the backward; the packed
    q, k, v the forward saves are the attention's operands too, viewed as eager's are, not each
    stored a second time for it."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).to(DEVICE)
    x = randn(2, 16, 64).requires_grad_()
    f = lambda x: mha(x, x, x, need_weights=False)[0]
    cf = fuselens.compile(f)
    got = cf(x)
    got_grads = torch.autograd.grad(got.sum(), [x, *mha.parameters()])
    want = f(x)
    torch.testing.assert_close(got, want)
    for g, e in zip(got_grads, torch.autograd.grad(want.sum(), [x, *mha.parameters()])):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    (entry,) = fuselens.inspect(cf)
    forward, backward = "".join(entry.wrappers).split("# backward")
    sdpa = next((line for line in forward.splitlines() if "prims.sdpa" in line), None)
    assert sdpa is not None, forward
    assert sdpa.count("reinterpret(buf") == 3 and "empty((2, 4, 16, 16)" not in forward, forward
    assert "empty((32, 64)" not in backward, backward


def test_a_contiguous_copy_is_stored_row_major_where_it_is_saved():
    """`.contiguous()` of a permuted value is stored in the layout it asks for, also where the
    forward saves it for the backward: the flattening view after it and the matmuls on both sides
    read that one copy (nn.MultiheadAttention's attention output on a GPU, whose fused kernel
    returns it in another layout than q's: stored in its input's layout, it was copied again for
    the out-projection in the forward, and again in the backward)."""
    B, L, H, D = 2, 8, 4, 16

    def f(x, w):
        y = (x.transpose(1, 2) * 2.0).permute(2, 0, 1, 3).contiguous().view(L * B, H * D)
        return y @ w
    cg = check(f, randn(B, L, H, D), randn(H * D, 32))
    forward, backward = cg.wrapper_source.split("# backward")
    assert forward.count("empty(") == 1 and "view((16, 64))" in forward, forward
    assert backward.count("empty(") == 1, backward  # x's gradient alone


def test_the_backward_recomputes_a_value_just_before_its_first_use():
    """Recomputed forward values come in the joint graph's order first, before every gradient
    node; the backward places each after the gradient nodes that run before its first user, as
    eager autograd would compute it there: not held from the backward's start (a UNet's recomputed
    GroupNorm inputs were held through its whole backward)."""
    def f(x, w1, w2):
        return torch.sin(manual_gelu_tanh(x @ w1) @ w2)
    inputs = [randn(8, 16).requires_grad_(), randn(16, 32).requires_grad_(), randn(32, 4).requires_grad_()]
    backward = partition(joint_of(f, *inputs)).backward
    nodes = [n for n in backward.nodes if n.op != "placeholder"]
    dependent = _tangent_dependent(backward)
    recomputed = [n for n in nodes if n not in dependent and n.op != "output"]
    assert any(getattr(n.target, "name", None) == "tanh" for n in recomputed)
    for n in recomputed:
        first_use = min(nodes.index(u) for u in n.users)
        assert not dependent.intersection(nodes[nodes.index(n) + 1:first_use]), n
    check(f, *inputs)


def test_the_backward_knows_which_inputs_others_hold():
    """A saved primal (the weight, held by its module) and the incoming gradient (held by
    autograd's engine) are freed by no `del` of the backward; a value the forward computed is:
    the wrapper's plan of live bytes counts only those (codegen/wrapper.py live_bytes)."""
    def f(x, w):
        return torch.tanh(x @ w) @ w
    parts = partition(joint_of(f, randn(8, 8), randn(8, 8)))
    held = {n.name: n.meta["held"] for n in parts.backward.nodes if n.op == "placeholder"}
    assert held == {"x": True, "w": True, "prim_tanh": False, "tangent_0": True}


def test_mlp_training_step():
    def mlp(x, w1, b1, w2, b2, target):
        h = F.gelu(F.linear(x, w1, b1))
        h = F.layer_norm(h, (h.shape[-1],))
        return F.cross_entropy(F.linear(h, w2, b2), target)
    inputs = [randn(8, 16), randn(32, 16) * 0.2, randn(32), randn(10, 32) * 0.2, randn(10),
              torch.randint(0, 10, (8,), device=DEVICE)]
    cg = check(mlp, *inputs, atol=1e-4, rtol=1e-4)
    forward, backward = cg.wrapper_source.split("# backward")
    # each linear one call, as F.linear makes it (no transposed view made in Python)
    assert forward.count("torch.nn.functional.linear(") == 2 and ".t()" not in forward
    # the bias gradients (column sums) are allocated in their returned shape: no reshape per call
    assert ".view(" not in backward
    leaves = [t.detach().requires_grad_() for t in inputs[:5]]
    compiled = compile(mlp, *leaves, inputs[5])
    compiled(*leaves, inputs[5])[0].backward()
    for t in leaves:
        assert (t.grad.shape, t.grad.stride()) == (t.shape, t.stride())


@pytest.mark.parametrize("fn,shapes,backward_kernels", [
    (manual_gelu_tanh, [(6, 7)], 1),
    (manual_softmax, [(4, 9)], 1),
    (sin_plus_cos, [(3, 8), (3, 8)], 1),
    (manual_layer_norm, [(5, 12), (12,), (12,)], 2),  # rows (dx) and columns (dw, db)
])
def test_backward_is_fused_too(fn, shapes, backward_kernels):
    inputs = [randn(*s).requires_grad_() for s in shapes]
    cg = compile(fn, *inputs)
    forward_kernels = 1
    assert len(cg.kernels) == forward_kernels + backward_kernels


@triton_kernels
def test_a_failing_backward_kernel_falls_back_on_the_first_call(monkeypatch):
    real = launcher.TritonKernel.run

    def fail_in_backward(self, *args, **kwargs):
        if self.name.endswith("_1"):  # the backward's kernel (numbered after the forward's)
            raise RuntimeError("backward kernel does not compile")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(launcher.TritonKernel, "run", fail_in_backward)
    x = randn(4, 5).requires_grad_()
    cg = compile(manual_gelu_tanh, x)
    with pytest.warns(FuselensWarning, match="backward kernel does not compile"):
        out = cg(x)[0]
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, torch.autograd.grad(manual_gelu_tanh(x).sum(), x)[0])


def test_a_failing_backward_leaves_the_random_sequence_to_the_eager_run(monkeypatch):
    # the first call checks the backward after its forward drew a seed: where that check fails,
    # the graph's eager run must draw what eager draws (as if the compiled forward never ran)
    def fail(self, args):
        raise RuntimeError("backward program fails")
    monkeypatch.setattr(driver.Program, "call_boxed", fail)
    f = lambda x: F.dropout(x, 0.5) * 3  # noqa: E731
    x = randn(64, 8).requires_grad_()
    cg = compile(f, x)
    torch.manual_seed(7)
    with pytest.warns(FuselensWarning, match="backward program fails"):
        out = cg(x)[0]
    after = torch.rand(())
    torch.manual_seed(7)
    want = f(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(after, torch.rand(()))
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, torch.autograd.grad(want.sum(), x)[0])


def test_the_first_training_call_runs_the_forward_once(monkeypatch):
    # its backward check reads what that forward saved (the check costs the backward alone)
    forwards, backwards = [], []
    call, call_boxed = driver.Program.__call__, driver.Program.call_boxed
    monkeypatch.setattr(driver.Program, "__call__", lambda self, *a: forwards.append(1) or call(self, *a))
    monkeypatch.setattr(driver.Program, "call_boxed", lambda self, a: backwards.append(1) or call_boxed(self, a))
    x = randn(6, 7).requires_grad_()
    cg = compile(manual_gelu_tanh, x)
    out = cg(x)[0]
    assert (len(forwards), len(backwards)) == (1, 1)
    (g,) = torch.autograd.grad(out.sum(), x)
    assert (len(forwards), len(backwards)) == (1, 2)
    torch.testing.assert_close(g, torch.autograd.grad(manual_gelu_tanh(x).sum(), x)[0])


@triton_kernels
def test_kernels_compiled_before_the_first_call_are_the_ones_it_launches(monkeypatch):
    # a program's kernels (forward and backward) compile together before the first call, for
    # the launches its wrapper will make: those predictions must be the launches that happen
    from triton.runtime.jit import JITFunction
    from fuselens.codegen import cuda
    from fuselens.schedule import fusion
    expected, launched = {}, []

    def predict(self, dtypes, scalars, sizes, device):
        expected[self.name] = (self, self.expected_launches(dtypes, scalars, sizes, device.index or 0))
        return []
    real_run = launcher.TritonKernel.run

    def record(self, *args, xnumel, rnumel=None, xchunk=None):
        sizes = (xnumel,) + (() if rnumel is None else (rnumel,)) + (() if xchunk is None else (xchunk,))
        launched.append((self.name, args, sizes))
        return real_run(self, *args, xnumel=xnumel, rnumel=rnumel, xchunk=xchunk)
    monkeypatch.setattr(launcher.TritonKernel, "compile_jobs", predict)
    monkeypatch.setattr(launcher.TritonKernel, "run", record)
    monkeypatch.setattr(fusion, "COLUMN_SPLIT_MIN_ROWS", 64)  # dw and db in two stages
    x = randn(256, 48).requires_grad_()
    w, b = randn(48).requires_grad_(), randn(48).requires_grad_()
    cg = compile(lambda x, w, b: F.dropout(manual_layer_norm(x, w, b), 0.1), x, w, b)  # a seed too
    out = cg(x, w, b)[0]
    out.backward(randn(*out.shape))
    assert {name for name, _, _ in launched} == set(expected) and len(expected) == 3
    for name, args, sizes in launched:
        kernel, launches = expected[name]
        params = getattr(kernel.fn, "params", None) or JITFunction(kernel.fn.fn, **kernel.fn.kwargs).params  # interpreter
        for exp_args, exp_sizes, config in launches:
            assert exp_sizes == sizes
            assert cuda.specialize(params, exp_args, exp_sizes, config) == cuda.specialize(params, args, sizes, config)


def test_the_backward_compiled_ahead_is_the_one_the_first_backward_runs(monkeypatch):
    # tanh(x.t() + y.t()) is saved (one read, where recomputing it reads x and y) in the transposed
    # layout eager gives it; the backward compiled with the forward must expect that layout, and
    # the compile-time check must run that program, or the first call compiles the backward again
    from fuselens.backend import driver
    lowered = []
    real_lower = driver.lower_graph
    monkeypatch.setattr(driver, "lower_graph", lambda *a: lowered.append(a) or real_lower(*a))
    fn = lambda x, y: torch.tanh(x.t() + y.t())
    x, y = randn(9, 7).requires_grad_(), randn(9, 7).requires_grad_()
    cg = compile(fn, x, y)
    assert len(lowered) == 2  # forward and backward
    out = cg(x, y)[0]
    assert out.stride() == fn(x, y).stride() == (1, 7)
    out.backward(torch.ones(7, 9, device=DEVICE))
    assert len(lowered) == 2
    torch.testing.assert_close(x.grad, torch.autograd.grad(fn(x, y).sum(), x)[0])


def test_saved_tensor_hooks_that_change_a_saved_layout():
    # save_on_cpu and offloading hooks hand back copies: a saved input of a transposed layout
    # comes back contiguous, and the backward must be the program for that layout
    f = lambda x: torch.sin(x) * x  # noqa: E731  (x itself is saved)
    x = randn(32, 16).t().detach().requires_grad_()
    cg = compile(f, x)
    g = randn(16, 32)
    want = torch.autograd.grad(f(x), x, g)[0]
    torch.testing.assert_close(torch.autograd.grad(cg(x)[0], x, g)[0], want)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
        out = cg(x)[0]
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], want)


def test_saved_values_layouts_are_read_once_without_hooks(monkeypatch):
    # without saved-tensor hooks the saved values come back as the forward's program stored them:
    # a backward call reads the layouts of its incoming gradients only (a ResNet-50's backward
    # has ~300 saved values); hooks that change a layout are seen (the test above)
    from fuselens.backend import training
    f = lambda x: torch.sin(x) * x  # noqa: E731
    x = randn(32, 16).requires_grad_()
    cg = compile(f, x)
    read = []
    real = training.layout_key
    monkeypatch.setattr(training, "layout_key", lambda ts: read.append(len(ts)) or real(ts))
    g = randn(32, 16)
    want = torch.autograd.grad(f(x), x, g)[0]
    torch.testing.assert_close(torch.autograd.grad(cg(x)[0], x, g)[0], want)
    read.clear()
    for _ in range(2):
        torch.testing.assert_close(torch.autograd.grad(cg(x)[0], x, g)[0], want)
    assert read == [1, 1]  # the gradient's layout, each call


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_keeps_the_callers_inputs():
    import fuselens
    f = fuselens.compile(lambda x, y: torch.relu(x * y + 1.0), mode="reduce-overhead")
    xs = [randn(64, 64) for _ in range(40)]
    y = randn(64, 64)
    copies = [x.clone() for x in xs]
    for x, c in zip(xs, copies):  # past the recording and the replay-or-launch trial
        torch.testing.assert_close(f(x, y).clone(), torch.relu(c * y + 1.0))
    for x, c in zip(xs, copies):
        assert torch.equal(x, c)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_replays_buffers_refilled_in_place():
    import fuselens
    f = fuselens.compile(lambda x, y: torch.relu(x * y + 1.0), mode="reduce-overhead")
    x, y = randn(64, 64), randn(64, 64)
    for _ in range(20):  # a loop that refills its input buffer: the graph reads it where it is
        x.copy_(randn(64, 64))
        torch.testing.assert_close(f(x, y).clone(), torch.relu(x * y + 1.0))
    graphed = f.entries[0].graph_calls[0].compiled
    assert graphed.graph is not None and graphed.static == [None, None]  # nothing copied per call
    for x2 in [randn(64, 64) for _ in range(40)]:  # x elsewhere: read from an owned buffer
        want = torch.relu(x2 * y + 1.0)
        torch.testing.assert_close(f(x2, y).clone(), want)
        torch.testing.assert_close(f(x, y).clone(), torch.relu(x * y + 1.0))
    # recorded again once, x copied; the trial then kept the graph, or direct launches
    assert graphed.recordings == 2 and (graphed.graph is None or graphed.static[0] is not None)


def _layers(x, w):  # 12 GEMMs and softmaxes: a replay beats launching them, copies and all
    for _ in range(12):
        x = torch.softmax(x @ w, -1)
    return x


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_copies_fresh_inputs_on_its_fast_path(monkeypatch):
    """A decode loop's fresh token each call: once replays are chosen, a call checks each input
    once, copies the fresh one into its buffer and replays, without the search for moved inputs."""
    import fuselens
    from fuselens.backend import cudagraphs
    f = fuselens.compile(_layers, mode="reduce-overhead")
    w = randn(64, 64)
    xs = [randn(64, 64) for _ in range(53)]  # (all alive: each call's x lies elsewhere)
    for x in xs[:50]:  # warm-up, recordings, the replay-or-launch trial
        f(x, w)
    graphed = f.entries[0].graph_calls[0].compiled
    assert graphed.graph is not None and [i for i, _ in graphed.copies] == [0], "replays not chosen"
    monkeypatch.setattr(cudagraphs.CudaGraphed, "_moved", lambda *a: pytest.fail("left the fast path"))
    for x in xs[50:]:
        torch.testing.assert_close(f(x, w).clone(), _layers(x, w))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_copies_only_the_inputs_that_move():
    import fuselens
    f = fuselens.compile(lambda x, w: torch.relu(x @ w + 1.0), mode="reduce-overhead")
    w = randn(64, 64)  # a weight passed as a plain tensor: stays where it is
    for i in range(40):
        x = randn(64, 64)  # a fresh input each call
        torch.testing.assert_close(f(x, w).clone(), torch.relu(x @ w + 1.0))
        if i == 3:  # warm-up, recording in place, x seen elsewhere: recorded again copying x alone
            graphed = f.entries[0].graph_calls[0].compiled
            assert graphed.recordings == 2 and graphed.static[0] is not None and graphed.static[1] is None
    w2 = randn(64, 64)  # now the weight moves too: both copied, results follow
    for _ in range(40):
        x = randn(64, 64)
        torch.testing.assert_close(f(x, w2).clone(), torch.relu(x @ w2 + 1.0))
        torch.testing.assert_close(f(x, w).clone(), torch.relu(x @ w + 1.0))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_follows_a_parameters_new_data():
    import fuselens

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(randn(64, 64))

        def forward(self, x):
            return torch.relu(x * self.w + 1.0)
    m = fuselens.compile(M(), mode="reduce-overhead")
    with torch.no_grad():
        for i in range(60):  # fresh inputs: the graph reads them from its own buffers
            if i == 30:
                m.w.data = randn(64, 64)  # the same Parameter, its storage elsewhere
            x = randn(64, 64)
            torch.testing.assert_close(m(x).clone(), torch.relu(x * m.w + 1.0))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_survives_a_failed_second_recording():
    import fuselens
    from fuselens.errors import FuselensWarning
    f = fuselens.compile(lambda x, y: torch.relu(x * y + 1.0), mode="reduce-overhead")
    x, y = randn(64, 64), randn(64, 64)
    for _ in range(4):
        f(x, y)
    graphed = f.entries[0].graph_calls[0].compiled
    graphed._capture = lambda inputs: (_ for _ in ()).throw(torch.OutOfMemoryError("no memory for the graph"))
    x2 = randn(64, 64)
    with pytest.warns(FuselensWarning, match="recording a CUDA graph failed .*OutOfMemoryError"):
        got = f(x2, y)  # inputs moved: recording 2 fails; the call still returns its result
    torch.testing.assert_close(got, torch.relu(x2 * y + 1.0))
    for x2 in [randn(64, 64) for _ in range(40)]:  # launched directly from then on
        torch.testing.assert_close(f(x2, y).clone(), torch.relu(x2 * y + 1.0))
    assert graphed.graph is None


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_copies_a_strided_input_in_its_layout():
    import fuselens
    f = fuselens.compile(lambda q, y: torch.relu(q * y + 1.0), mode="reduce-overhead")
    y = randn(64, 64)
    for i in range(40):  # a fresh slice of a wider tensor each call: not dense, copied as it lies
        q = randn(64, 192)[:, :64]
        torch.testing.assert_close(f(q, y).clone(), torch.relu(q * y + 1.0))
        if i == 3:
            graphed = f.entries[0].graph_calls[0].compiled
            assert graphed.graph is not None and graphed.static[0].stride() == (192, 1)



@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_copies_an_expanded_input():
    import fuselens
    f = fuselens.compile(lambda e, y: torch.relu(e * y + 1.0), mode="reduce-overhead")
    y = randn(64, 64)
    for i in range(40):  # a fresh row broadcast over 64 rows each call (a stride of 0): its 64 values copied
        e = randn(1, 64).expand(64, 64)
        torch.testing.assert_close(f(e, y).clone(), torch.relu(e * y + 1.0))
        if i == 3:
            graphed = f.entries[0].graph_calls[0].compiled
            assert graphed.graph is not None and graphed.static[0].stride() == (0, 1)

def mlp_gelu(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def mlp_params():
    return [(randn(64, 32) * 0.2).requires_grad_(), randn(64).requires_grad_(),
            (randn(16, 64) * 0.2).requires_grad_(), randn(16).requires_grad_()]


def training_graphs(f):
    """The TrainingGraphs of a compiled function's one graph (reduce-overhead, training calls)."""
    import inspect
    cg = f.entries[0].graph_calls[0].compiled
    runs = [inspect.getclosurevars(s.run).nonlocals for s in cg._specializations.values()]
    return next(r["state"].graphs for r in runs if "state" in r)  # (a training call's run)


def eager_grads(fn, inputs, params, g):
    out = fn(*inputs, *params)
    return out, torch.autograd.grad(out, params, g)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_steps_replay_and_match_eager():
    import fuselens
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    params, x = mlp_params(), randn(8, 32)

    def step(x):  # .grad set to None each step, as optimizers do
        g = randn(8, 16)
        for p in params:
            p.grad = None
        out = f(x, *params)
        want, want_grads = eager_grads(mlp_gelu, [x], params, g)
        torch.testing.assert_close(out, want)
        out.backward(g)
        for p, w in zip(params, want_grads):
            torch.testing.assert_close(p.grad, w)
    for _ in range(20):  # a batch refilled in place: nothing copied, every step replays
        x.copy_(randn(8, 32))
        step(x)
    graphs = training_graphs(f)
    bw, = graphs.bw.values()
    # the backward recorded reading g in place; again, copying it, if a fresh g lay elsewhere
    assert graphs.generation == 19 and not graphs.fw.dropped and bw.graphed.recordings in (1, 2)
    for _ in range(40):  # a fresh batch each step: copied into the graph (or launched directly)
        step(randn(8, 32))


def _loss_and_logits(x, w1, b1, w2, b2):
    logits = mlp_gelu(x, w1, b1, w2, b2)
    return logits.logsumexp(-1).mean(), logits


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_replays_a_backward_without_the_logits_gradient():
    # a language model returns its loss and its logits; the loss's backward leaves the logits'
    # gradient undefined, and that backward (a program without the logits' terms) replays too
    import fuselens
    f = fuselens.compile(_loss_and_logits, mode="reduce-overhead")
    params, x = mlp_params(), randn(8, 32)
    for _ in range(12):
        x.copy_(randn(8, 32))
        for p in params:
            p.grad = None
        loss, logits = f(x, *params)
        want_loss, want_logits = _loss_and_logits(x, *params)
        torch.testing.assert_close(logits, want_logits)
        loss.backward()
        for p, w in zip(params, torch.autograd.grad(want_loss, params)):
            torch.testing.assert_close(p.grad, w)
    graphs = training_graphs(f)
    bw, = graphs.bw.values()
    # replayed, reading the saved values and the logits' unread stand-in in place (the loss's
    # gradient, a fresh tensor each backward(), is copied once it is seen elsewhere)
    assert bw.graphed.graph is not None and bw.graphed.recordings in (1, 2)
    assert bw.graphed.static[-1] is None and all(b is None for b in bw.graphed.static[:-2])
    assert graphs.generation == 11


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_gradients_that_are_an_input_are_copied():
    import fuselens
    f = fuselens.compile(lambda x, w: torch.relu(x) + w, mode="reduce-overhead")
    x, w = randn(64, 64).requires_grad_(), randn(64, 64).requires_grad_()
    g = randn(64, 64)  # the same incoming gradient each step, read where it lies
    g0 = g.clone()
    for _ in range(8):  # w's gradient is g itself: .grad must be a copy, not g's memory
        x.grad = w.grad = None
        f(x, w).backward(g)
        w.grad.mul_(0.5)  # in place, as gradient clipping or unscaling does
        torch.testing.assert_close(w.grad, 0.5 * g0)
        torch.testing.assert_close(x.grad, g0 * (x > 0))
        assert torch.equal(g, g0)
    bw, = training_graphs(f).bw.values()
    assert bw.graphed.recordings == 1 and not bw.graphed.dropped


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_backward_follows_a_forward_recorded_again():
    import fuselens
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    w1 = torch.nn.Parameter(randn(64, 32) * 0.2)
    params, x, g = [w1, *mlp_params()[1:]], randn(8, 32), randn(8, 16)

    def step():
        for p in params:
            p.grad = None
        f(x, *params).backward(g)
        for p, w in zip(params, torch.autograd.grad(mlp_gelu(x, *params), params, g)):
            torch.testing.assert_close(p.grad, w)
    for _ in range(5):
        step()
    w1.data = w1.data.clone()  # the same Parameter, elsewhere: the forward is recorded again there
    for _ in range(5):
        step()
    graphs = training_graphs(f)
    bw, = graphs.bw.values()
    # the backward reads the saved values where the new forward graph writes them: nothing copied
    assert graphs.fw.recordings == 2 and bw.graphed.recordings == 1 and all(b is None for b in bw.graphed.static)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_gemms_keep_their_workspace_when_torch_clears_its_cache():
    # torch.compile's CUDA graphs clear torch's cached cuBLAS workspaces before recording; a graph
    # whose GEMMs were captured with a cached one would then write into freed memory
    import fuselens
    bf = torch.bfloat16
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    x = randn(8192, 1024).to(bf)
    params = [(randn(4096, 1024) * 0.03).to(bf).requires_grad_(), randn(4096).to(bf).requires_grad_(),
              (randn(1024, 4096) * 0.015).to(bf).requires_grad_(), randn(1024).to(bf).requires_grad_()]
    g = randn(8192, 1024).to(bf)
    for _ in range(4):  # warm-up and recordings of both graphs
        for p in params:
            p.grad = None
        f(x, *params).backward(g)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 22,), 7.0, device=DEVICE) for _ in range(64)]  # takes the freed memory
    for p in params:
        p.grad = None
    f(x, *params).backward(g)
    want = torch.autograd.grad(mlp_gelu(x, *params), params, g)
    assert all(bool((j == 7.0).all()) for j in junk)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, **tolerance(bf))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_two_forwards_before_one_backward():
    import fuselens
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    params, a = mlp_params(), randn(8, 32)  # `a` refilled in place: its forward replays each step
    for _ in range(3):  # warm-up and recordings
        f(a, *params).sum().backward()
    generation = training_graphs(f).generation
    for _ in range(5):  # the second forward must not overwrite what the first one saved
        a.copy_(randn(8, 32))
        b = randn(8, 32)
        for p in params:
            p.grad = None
        (f(a, *params) * f(b, *params)).sum().backward()
        want = torch.autograd.grad((mlp_gelu(a, *params) * mlp_gelu(b, *params)).sum(), params)
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad, w)
    assert training_graphs(f).generation == generation + 5


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_gradients_held_across_steps():
    import fuselens
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    params, x = mlp_params(), randn(8, 32).requires_grad_()  # x refilled in place: forwards replay
    want = [torch.zeros_like(p) for p in params]
    kept = []
    for _ in range(12):  # .grad accumulates over steps and x's gradients are kept: neither may be
        with torch.no_grad():  # a buffer that the next replay overwrites
            x.copy_(randn(8, 32))
        x.grad = None
        f(x, *params).sum().backward()  # the gradient of a sum: expanded, copied into the graph
        kept.append((x.grad, torch.autograd.grad(mlp_gelu(x, *params).sum(), x)[0]))
        for w, g in zip(want, torch.autograd.grad(mlp_gelu(x, *params).sum(), params)):
            w += g
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
    for got, expected in kept:
        torch.testing.assert_close(got, expected)
    bw, = training_graphs(f).bw.values()
    assert bw.graphed.recordings == 1  # the backward did replay (then launched directly while held)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_reduce_overhead_training_backward_after_a_later_call_raises():
    import fuselens
    f = fuselens.compile(mlp_gelu, mode="reduce-overhead")
    params, x = mlp_params(), randn(8, 32)  # the same x each call: nothing copied, every call replays
    for _ in range(3):
        f(x, *params).sum().backward()
    loss = f(x, *params).sum()
    loss.backward(retain_graph=True)
    f(x, *params).sum().backward()  # replays into the buffers the first loss saved
    assert training_graphs(f).fw.graph is not None
    with pytest.raises(RuntimeError, match="overwrote"):
        loss.backward()


def _attention_with_bias(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias * 2)  # a tensor by keyword


def _lerp_by_keyword(a, b, w):
    return torch.lerp(a, end=b * 2, weight=w.sigmoid())


@pytest.mark.parametrize("fn, shapes", [
    (_attention_with_bias, [(2, 4, 7, 8), (2, 4, 7, 8), (2, 4, 7, 8), (1, 4, 7, 7)]),  # T5's position bias
    (_lerp_by_keyword, [(3, 5), (3, 5), (3, 5)]),
], ids=["sdpa-attn_mask", "lerp-end-weight"])
def test_tensors_passed_by_keyword_get_their_gradients(fn, shapes):
    """An extern differentiated through its keyword tensors too (the position bias of T5's
    attention, an SDPA `attn_mask`, got no gradient: a silent zero)."""
    check(fn, *[randn(*s) for s in shapes])


@pytest.mark.parametrize("fn", [
    lambda x, w, b: torch.addmm(b, x, w),  # transformers' Conv1D (GPT-2): the weight is (in, out)
    lambda x, w, b: F.linear(x, w.t(), b),  # nn.Linear: the weight is (out, in)
], ids=["addmm", "linear"])
def test_a_half_precision_bias_row_is_added_in_the_gemms_epilogue(fn):
    # as eager's: cuBLAS adds the bias before the product rounds, and no kernel of ours reads the
    # product again only to add it (GPT-2's QKV projection, whose reader is SDPA: 12 passes a step)
    x, w, b = randn(16, 24).bfloat16(), randn(24, 40).bfloat16(), randn(40).bfloat16()
    cg = check(fn, x, w, b)
    forward = cg.wrapper_source.split("# backward")[0]
    assert "addmm" in forward and ".launch(" not in forward, forward
    # the weight's gradient in the weight's layout (a transposed one, copied by autograd into .grad),
    # in fp32 too (the bias added apart)
    for dtype in (torch.bfloat16, torch.float32):
        x, w, b = (t.detach().to(dtype).requires_grad_() for t in (x, w, b))
        gw, = torch.autograd.grad(compile(fn, x, w, b)(x, w, b)[0].sum(), [w])
        assert gw.stride() == w.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_shape", [(3, 5), (2, 1, 5)])
def test_a_linears_bias_may_broadcast_over_the_inputs_leading_dims(bias_shape, dtype):
    check(lambda x, w, b: F.linear(x, w, b), randn(2, 3, 4).to(dtype), randn(5, 4).to(dtype), randn(*bias_shape).to(dtype))


def _logits_loss(x, w, b, w2, target):
    h = torch.tanh(F.linear(x, w, b))  # addmm: K and N unaligned
    return F.cross_entropy(h @ w2.t(), target), h  # mm: N unaligned (an odd vocabulary)


def test_unaligned_gemms_are_padded_with_values_and_gradients_unchanged(monkeypatch):
    # on a GPU, half-precision GEMMs with a dim off cuBLAS's 16-byte alignment run 3-5x slower
    # kernels (GPT-2's 50257-word LM head); forced here for any device and size
    from torch.utils._python_dispatch import TorchDispatchMode
    from fuselens.ops.decompositions import linalg
    monkeypatch.setattr(linalg, "_gemm_alignment", lambda dtype: 8)
    monkeypatch.setattr(linalg, "PAD_GEMM_MIN", 0)
    inputs = [randn(6, 13), randn(11, 13), randn(11), randn(21, 11), torch.randint(0, 21, (6,), device=DEVICE)]
    cg = check(_logits_loss, *inputs, atol=1e-4, rtol=1e-4)

    class GemmShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.shapes.append([tuple(t.shape) for t in args[-2:]])
            return func(*args, **(kwargs or {}))
    leaves = [t.requires_grad_() for t in inputs[:4]]
    with GemmShapes() as mode:
        loss, h = cg(*leaves, inputs[4])
        (loss + h.sum()).backward()
    assert len(mode.shapes) == 6 and all(d % 8 == 0 for a, b in mode.shapes for d in (*a, *b)), mode.shapes


class _Blocks(torch.nn.Module):
    """Residual MLP blocks, each (optionally) under torch.utils.checkpoint."""

    def __init__(self, checkpointed, d=16):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d),
                                                              torch.nn.GELU(), torch.nn.Linear(4 * d, d))
                                          for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed
                     else block(x))
        return x.square().mean()


def _saved_activation_bytes(model, x):
    """Bytes of what autograd saves in a warm forward (a first compiled call also learns what eager
    saves), parameters aside."""
    model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def test_a_checkpointed_call_is_recomputed_not_saved():
    """torch.utils.checkpoint: the call's ops (matmuls too) are recomputed in the backward, so the
    forward saves no more than eager's checkpoint (each call's input), far less than unchecked;
    values and gradients as eager's."""
    torch.manual_seed(0)
    x = torch.randn(32, 16, device=DEVICE, requires_grad=True)
    checked, unchecked = _Blocks(True).to(DEVICE), _Blocks(False).to(DEVICE)
    unchecked.load_state_dict(checked.state_dict())
    compiled = fuselens.compile(checked)
    got, want = compiled(x), checked(x)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, [x, *checked.parameters()]), torch.autograd.grad(want, [x, *checked.parameters()])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    saved = _saved_activation_bytes(compiled, x)
    assert saved <= _saved_activation_bytes(checked, x)
    assert 3 * saved < _saved_activation_bytes(fuselens.compile(unchecked), x)


def compiled_as_eager(f, *inputs):
    """`fuselens.compile(f)` equals eager, forward and gradients, with no fallback."""
    import warnings
    inputs = [x.detach().requires_grad_() for x in inputs]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FuselensWarning)
        got = fuselens.compile(f)(*inputs)
    want = f(*inputs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, g, allow_unused=True),
                    torch.autograd.grad(want, inputs, g, allow_unused=True)):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


COMPLEX_INTERMEDIATES = {
    "view_as_real(fft)": lambda x: torch.view_as_real(torch.fft.fft(x)).sum(-1),
    "fftn(x).real (FNet)": lambda x: torch.fft.fftn(x * 2, dim=(1, 2)).real,
    "rfft(x).abs()": lambda x: torch.fft.rfft(x).abs(),
    "fft(x) * conj, .imag": lambda x: (torch.fft.fft(x) * torch.fft.fft(x.sin()).conj()).imag,
    "view_as_complex rotary (Llama 4)": lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, 4, 2))
                                                                      * torch.polar(torch.ones(4, device=x.device),
                                                                                    torch.arange(4.0, device=x.device))).flatten(-2),
}


@pytest.mark.parametrize("name", COMPLEX_INTERMEDIATES)
def test_gradients_through_complex_intermediates(name):
    """Complex values are differentiated as torch does (their ops left to torch): the backward
    had taken a complex value for an integer one and given zero gradients (FNet's training), and
    capture's stand-in of a complex view of a real tensor had dropped its requires_grad (Llama 4's
    rotary embedding: q and k projections' gradients zero)."""
    compiled_as_eager(COMPLEX_INTERMEDIATES[name], randn(2, 3, 8))


LISTED_OPERANDS = {
    "einsum(eq, (a, b))": lambda a, b: torch.einsum("bxd,byd->bxy", (a, b)).sin(),
    "einsum(eq, [a, b])": lambda a, b: torch.einsum("bxd,byd->bxy", [a * 2, b]),
    "multi_dot": lambda a, b: torch.linalg.multi_dot([a[0], b[0].t(), a[1]]),
}


@pytest.mark.parametrize("name", LISTED_OPERANDS)
def test_gradients_of_an_extern_whose_tensors_come_in_a_list(name):
    """Longformer's `torch.einsum(eq, (a, b))`: each listed tensor gets its gradient (the backend
    had refused, and the graph ran eagerly)."""
    compiled_as_eager(LISTED_OPERANDS[name], randn(2, 3, 4), randn(2, 3, 4))
