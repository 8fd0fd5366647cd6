"""Autocast: what it does to a call is asked of torch (capture/autocast.py), on fake tensors of the
call's arguments, so CUDA's policy holds on a machine without a GPU. Checked against PyTorch's own
autocast test lists (the ops each policy covers, with arguments), and compiled == eager on CPU."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists, AutocastTestLists
from torch.utils._pytree import tree_leaves, tree_map

from fl_capture_testing import check
from fuselens.capture.autocast import REFUSED, cast_to
from fuselens.capture.values import TensorVar

# fake tensors cannot run these without a GPU (cuDNN-only kernels, fused RNN cells without a meta
# kernel): capture leaves them to Python, under the real autocast
_NOT_PROBED = {"cudnn_convolution", "cudnn_convolution_transpose", "gru_cell", "grid_sampler"}


def _entries(device):
    with FakeTensorMode(allow_non_fake_inputs=True):
        lists = AutocastTestLists(torch.device(device)) if device == "cuda" else AutocastCPUTestLists(device)
    if device == "cuda":
        lower = [("torch_fp16", torch), ("nn_fp16", torch._C._nn), ("linalg_fp16", torch._C._linalg),
                 ("methods_fp16", torch.Tensor)]
        fp32 = [("torch_fp32", torch), ("nn_fp32", torch._C._nn), ("methods_fp32", torch.Tensor)]
    else:
        lower, fp32 = [("torch_16", torch), ("nn_16", torch._C._nn)], [("torch_fp32", torch), ("nn_fp32", torch._C._nn)]
    for policy, groups in (("lower", lower), ("fp32", fp32), ("promote", [("torch_need_autocast_promote", torch)])):
        for list_name, owner in groups:
            for entry in getattr(lists, list_name):
                name, rest = entry[0], entry[1:]
                if isinstance(rest[0], str):  # einsum: its equation, then its operands
                    args, rest = (rest[0], *rest[1]), rest[2:]
                else:
                    args, rest = rest[0], rest[1:]
                kwargs = next((r for r in rest if isinstance(r, dict)), {})
                yield pytest.param(policy, getattr(owner, name), args, kwargs, id=f"{device}-{list_name}-{name}")
    for name, args, owner in getattr(lists, "banned", ()):
        yield pytest.param("banned", getattr(owner, name), args, {}, id=f"{device}-banned-{name}")


def _runs_in_float32_on_cpu(fn, args, kwargs) -> bool:
    """The list's arguments fit the op (einsum's equation does not fit its operands there)."""
    def real(v):
        if isinstance(v, torch.Tensor):
            return torch.ones(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype)
        return v
    try:
        fn(*tree_map(real, tuple(args)), **tree_map(real, kwargs))
    except Exception:  # noqa: BLE001
        return False
    return True


def _var(v):
    if isinstance(v, torch.Tensor):
        meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return TensorVar(None, meta, v.device)
    return v


@pytest.mark.parametrize("device, amp_dtype", [("cuda", torch.float16), ("cpu", torch.bfloat16)])
def test_autocast_policy_is_pytorchs(device, amp_dtype):
    wrong = []
    for p in _entries(device):
        policy, fn, args, kwargs = p.values
        floats = [t.dtype for t in torch.utils._pytree.tree_leaves(args) if isinstance(t, torch.Tensor)
                  and t.is_floating_point()]
        want = {"lower": amp_dtype, "fp32": torch.float32, "banned": REFUSED,
                "promote": max(floats, key=lambda d: d.itemsize)}[policy]
        if policy == "fp32" and all(d == torch.float32 for d in floats):
            want = None  # already float32: nothing to cast
        listed = want
        if policy != "banned" and not _runs_in_float32_on_cpu(fn, args, kwargs):
            want = REFUSED  # eager raises: Python runs it and raises
        got = cast_to(fn, tree_map(_var, tuple(args)), tree_map(_var, kwargs), device, amp_dtype)
        # the ops fake tensors cannot run without a GPU: refused there, the list's policy with one
        if got != want and not (fn.__name__ in _NOT_PROBED and got in (REFUSED, listed)):
            wrong.append(f"{p.id}: {got} (want {want})")
    assert not wrong, "\n".join(wrong)


_W = torch.randn(6, 8)
_B = torch.randn(6)
_K = torch.randn(3, 2, 3, 3)


def _under_autocast(op):
    def f(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return op(x, y)
    f.__name__ = f"autocast_{op.__name__}"
    return f


def _linear(x, y):
    return F.linear(x, _W, _B) + y.sum()


def _matmul_then_softmax(x, y):
    return torch.softmax(x @ y.T, -1)


def _cross_entropy(x, y):
    return F.cross_entropy(x @ y.T, torch.tensor([0, 1, 2, 3]))


def _mse_and_prod(x, y):
    return F.mse_loss(x, y) + x.prod(1)


def _conv(x, y):
    return F.conv2d(x.reshape(1, 2, 4, 4), _K, padding=1).exp()


def _bmm_mixed(x, y):
    return torch.bmm(x.bfloat16().unsqueeze(0), y.T.unsqueeze(0)).double()


def _cat_of_mixed(x, y):
    return torch.cat([x.bfloat16(), y]) * 3


def _losses_autocast_runs_in_float32(x, y):
    return F.l1_loss(x @ y.T, y @ x.T) + F.huber_loss(x.bfloat16(), y) + F.binary_cross_entropy_with_logits(
        (x @ y.T).sin(), torch.sigmoid(x @ y.T))


def _transposed_conv(x, y):
    return F.conv_transpose2d(x.reshape(1, 2, 4, 4), _K.transpose(0, 1)) + y.sum()


@pytest.mark.parametrize("op", [_linear, _matmul_then_softmax, _cross_entropy, _mse_and_prod, _conv, _bmm_mixed,
                                _cat_of_mixed, _losses_autocast_runs_in_float32, _transposed_conv], ids=lambda f: f.__name__.strip("_"))
def test_compiled_under_autocast_equals_eager(op):
    check(_under_autocast(op), torch.randn(4, 8), torch.randn(4, 8), graphs=1, breaks=[])


def _maybe_autocast(device_type, enabled=True):
    """transformers' maybe_autocast: a block only where autocast is on or asked for."""
    if torch.is_autocast_enabled(device_type) or enabled:
        return torch.autocast(device_type, enabled=enabled)
    return contextlib.nullcontext()


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (made where there is no CUDA: torch warns that it is off)
    _CUDA_AUTOCAST_OFF = torch.autocast("cuda", enabled=False)


def _autocast_state_asked_inside(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _maybe_autocast("cpu", enabled=False):  # (a rotary embedding's float32 product)
            off = x @ y.T
        with torch.autocast("cpu"):  # no dtype of its own: the enclosing block's
            inner = (x @ y.T) * (2.0 if torch.get_autocast_dtype("cpu") is torch.bfloat16 else 3.0)
        on = x @ y.T if torch.is_autocast_enabled("cpu") else x
        with _CUDA_AUTOCAST_OFF:  # another device's block leaves the CPU's on
            other = x @ y.T
    return off, inner, on, other


def test_autocast_state_is_the_blocks_the_code_is_in():
    """Capture enters none of torch's autocast blocks: what code inside one asks of autocast
    (is it on, its dtype) and which block casts a call are the walk's, each device its own."""
    check(_autocast_state_asked_inside, torch.randn(4, 8), torch.randn(4, 8), graphs=1, breaks=[])


def _mask_moved_by_keyword(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # transformers' padding mask (BLOOM, torch 2.11)
        mask = torch.ones(x.shape, device=x.device).to(device=x.device, dtype=torch.bool)
        return x @ x.T, x * mask[0, 1]


def test_to_with_a_device_keyword_is_on_that_device():
    """`t.to(device=d, dtype=...)` is on d (capture had it on the meta device its stand-ins run
    on, which autocast's queries then rejected)."""
    check(_mask_moved_by_keyword, torch.randn(4, 8), graphs=1, breaks=[])


_LAYER = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)


def _encoder_layer(x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _LAYER(x)


def test_torch_python_autocast_runs_in_several_dtypes_is_interpreted():
    """F.multi_head_attention_forward: its projections in bfloat16, its softmax where autocast puts
    it; recorded as one call on cast arguments it would all compute in one dtype."""
    check(_encoder_layer, torch.randn(2, 3, 16), graphs=1, breaks=[])


def _in_place_relu_and_add(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.relu(x @ y.T, inplace=True)  # functionalized to ATen overloads, asked as those
        h += y @ x.T
        return h


@pytest.mark.parametrize("fn, args", [(_under_autocast(_linear), (torch.randn(4, 8), torch.randn(4, 8))),
                                      (_encoder_layer, (torch.randn(2, 3, 16),)),
                                      (_in_place_relu_and_add, (torch.randn(4, 8), torch.randn(4, 8)))],
                         ids=["linear", "encoder_layer", "in_place"])
def test_a_later_process_asks_no_probe_again(tmp_path, monkeypatch, fn, args):
    """The answers are kept on disk (a probe costs milliseconds, a model asks dozens): a process
    that finds them there asks none, and gets the same answers, REFUSED included."""
    from fuselens.capture import autocast as AC
    monkeypatch.setenv("FUSELENS_PROGRAM_CACHE", "1")
    monkeypatch.setenv("FUSELENS_CAPTURE_CACHE", "0")  # (a kept capture would ask nothing at all)
    monkeypatch.setenv("FUSELENS_CACHE_DIR", str(tmp_path))
    asked = []
    probe = AC._probe
    monkeypatch.setattr(AC, "_probe", lambda *a: asked.append(a[0]) or probe(*a))
    answers = []
    for process in range(2):
        monkeypatch.setattr(AC, "_cache", {})  # a new process: nothing in memory
        monkeypatch.setattr(AC, "_disk", None)
        check(fn, *args, graphs=1, breaks=[])
        answers.append(dict(AC._cache))
        if process == 0:
            assert asked and len(list(tmp_path.glob("autocast-probes-*"))) == 1
            asked.clear()
    assert asked == []
    assert answers[0] == answers[1]
    # another build of fuselens (or torch) asks again: its probe may answer otherwise
    from fuselens import settings
    monkeypatch.setattr(settings, "compiler_version", lambda: "another-build")
    monkeypatch.setattr(AC, "_cache", {})
    monkeypatch.setattr(AC, "_disk", None)
    check(fn, *args, graphs=1, breaks=[])
    assert asked


@pytest.mark.parametrize("mask", [None, torch.float32, torch.bool])
def test_a_call_autocast_leaves_alone_is_recorded_as_it_is(mask):
    """SDPA on bfloat16 values under CUDA's bfloat16 autocast: autocast casts nothing (a float32 mask
    aside); the casts the probe sees are the op's own (fake CUDA SDPA runs its math kernel, which
    computes in float32), so the call is recorded, not left to Python (FL180 on every attention
    layer of a transformers model trained under autocast)."""
    from fuselens.capture.autocast import _probe, _Tensor
    cuda = torch.device("cuda")
    q, k, v = (_Tensor(torch.bfloat16, (2, 4, 16, 8), (512, 128, 8, 1), cuda, i) for i in range(3))
    spec = ((q, k, v), {"attn_mask": None if mask is None else _Tensor(mask, (2, 1, 16, 16), (256, 256, 16, 1), cuda, 3)})
    assert _probe(F.scaled_dot_product_attention, spec, "cuda", torch.bfloat16) in (
        None if mask is not torch.float32 else torch.bfloat16,)



_TARGET = torch.tensor([[0, 3], [-100, 1]])
# (a composite, its arguments from two bfloat16 tensors by views: no autocast there)
_COMPOSITES = {
    "ce_indices": (F.cross_entropy, lambda a, b: (a.reshape(2, 4, 2), _TARGET)),
    "ce_probabilities": (F.cross_entropy, lambda a, b: (a, b)),
    "pairwise_distance": (F.pairwise_distance, lambda a, b: (a, b)),
}


def _replay_eagerly(calls, args):
    values = {-1: [v for v in tree_leaves(args) if isinstance(v, torch.Tensor)]}
    resolve = lambda v: values[v.step][v.index] if isinstance(v, type(calls.result)) else v  # noqa: E731
    for step, (_, _, step_args, step_kwargs) in enumerate(calls.steps):
        out = calls.op(step)(*tree_map(resolve, step_args), **tree_map(resolve, step_kwargs))
        values[step] = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return resolve(calls.result)


@pytest.mark.parametrize("name", sorted(_COMPOSITES))
def test_a_composite_autocast_treats_in_parts_is_recorded_as_its_aten_ops(monkeypatch, name):
    """CUDA's bfloat16 autocast runs `cross_entropy` as log_softmax in bfloat16, its result cast to
    float32 for nll_loss: no cast of the arguments gives that, so the call is recorded as the ATen
    ops autocast ran (FL180 at a seq2seq model's loss otherwise). CUDA's policy is probed here for
    CPU tensors, so the recorded ops, run eagerly, are the reference."""
    import fuselens
    from fuselens.capture import autocast as AC
    composite, arguments = _COMPOSITES[name]
    probe = AC.cast_to
    as_cuda = lambda v: TensorVar(None, v.meta, torch.device("cuda")) if isinstance(v, TensorVar) else v  # noqa: E731
    answers = []
    monkeypatch.setattr(AC, "cast_to", lambda fn, args, kwargs, device_type, dtype: answers.append(
        probe(fn, tree_map(as_cuda, args), tree_map(as_cuda, kwargs), "cuda", dtype)) or answers[-1])

    def f(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return composite(*arguments(a, b))
    a, b = (torch.randn(4, 4).bfloat16().requires_grad_() for _ in range(2))
    got = fuselens.compile(f)(a, b)
    calls = [x for x in answers if isinstance(x, AC.AtenCalls)]
    assert len(calls) == 1 and len(calls[0].steps) > 1
    want = _replay_eagerly(calls[0], arguments(a, b))
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    grads = zip(*(torch.autograd.grad(r.sum(), (a, b), allow_unused=True) for r in (got, want)))
    assert all(g is w is None or torch.equal(g, w) for g, w in grads)
    assert fuselens.explain(f, a, b).graph_breaks == []


_MHA = torch.nn.MultiheadAttention(16, 4, batch_first=True)


def _self_attention_of_a_product(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = (x @ y.T)[None]  # bfloat16
        return _MHA(h, h, h, need_weights=False)[0]


def _attention_of_three_views(x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ y.T
        return _MHA(h[None], h[None], h[None], need_weights=False)[0]


@pytest.mark.parametrize("fn", [_self_attention_of_a_product, _attention_of_three_views], ids=lambda f: f.__name__)
def test_the_probe_runs_the_path_the_call_takes(fn):
    """F._in_projection_packed under autocast projects `q is k is v` with one linear of the packed
    weight, and three tensors with its chunks (views autocast casts, not the arguments): the probe
    passes one tensor where the call does (a probe of the other path recorded a float32 weight
    beside bfloat16 values: a crash where eager runs)."""
    check(fn, torch.randn(16, 16), torch.randn(16, 16), graphs=1, breaks=[])
    h, k, v = (_var(torch.randn(16, 1, 16, dtype=torch.bfloat16)) for _ in range(3))
    w, b = _var(_MHA.in_proj_weight), _var(_MHA.in_proj_bias)
    qkv = (h, h, h) if fn is _self_attention_of_a_product else (h, k, v)
    assert cast_to(F._in_projection_packed, [*qkv, w, b], {}, "cpu", torch.bfloat16) == torch.bfloat16
