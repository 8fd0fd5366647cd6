"""What eager autograd does with a graph, asked of torch itself: the graph runs once on meta tensors
under autograd (torch's derivative table decides), and the autograd graph it leaves is read.

The compiled forward and backward are free to compute differently (other saved values, gradients
summed in other orders), but what a user can see must be eager's: which outputs require grad, which
inputs get a gradient (None where eager's backward never reaches them), which backwards raise
(ops whose derivative torch does not implement), and which tensors autograd checks for in-place
writes before backward (the inputs and outputs eager saves).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ops.primitives import RAISING_NODES


@dataclass
class EagerAutograd:
    output_requires_grad: list  # per graph output
    reaches: list  # per output: the inputs its backward reaches (a bit per input)
    raises: list  # per output: the message of the error its backward raises, or None
    saved_inputs: frozenset  # inputs eager saves for backward (or views of them)
    saved_outputs: frozenset  # outputs eager saves for backward (or whose base it saves)


def _meta_input(t):
    if not isinstance(t, torch.Tensor):
        return t
    m = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    return m.requires_grad_(t.requires_grad)


def _is_device(a) -> bool:
    return isinstance(a, (str, torch.device)) or isinstance(a, int) and not isinstance(a, bool)


class _MetaRun(fx.Interpreter):
    """The graph on meta tensors: a device the graph names becomes `meta` (as in capture)."""

    def run_node(self, n):
        result = eager_value(n, lambda: super(_MetaRun, self).run_node(n), self.fetch_args_kwargs_from_env)
        written = n.meta.get("writes")
        if written is not None:  # eager wrote this value into `written` in place: its version moves on
            torch.autograd.graph.increment_version(self.env[written])
        return result

    def call_function(self, target, args, kwargs):
        if target in (torch.Tensor.cuda, torch.Tensor.cpu):
            return args[0]
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "meta"}
        if target is torch.Tensor.to:
            args = (args[0], *("meta" if _is_device(a) else a for a in args[1:]))
        return super().call_function(target, args, kwargs)


def eager_value(n, run, fetch_args):
    """Node `n`'s value (`run()` computes it) with the derivative of the op eager ran: where capture
    functionalized an in-place op on its first argument (`aten.leaky_relu` for `leaky_relu_`,
    `aten.mul` for `mul_`: meta["in_place"]), that op runs in place on a copy of the argument. Its
    derivative saves what eager's saves (the result, or autograd's copy of the argument as it was,
    where the functional op saves the argument that the write makes stale: autograd's version check
    would refuse a backward eager runs) and exists where the functional op's may not (torch 2.11's
    `aten.copy`)."""
    inplace = _inplace_overload(n.target) if n.meta.get("in_place") else None
    if inplace is None:
        return run()
    args, kwargs = fetch_args(n)
    return inplace(args[0].clone(), *args[1:], **kwargs)


def _inplace_overload(op):
    """The in-place ATen overload (`foo_`) taking the arguments of `op` (`foo`), or None: the
    inverse of capture's `ops.effects.functional_overload`."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[1] + "_", None)
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [(a.name, str(a.type)) for a in candidate._schema.arguments] == want:
            return candidate
    return None


def _error_message(fn) -> str:
    try:
        fn(*[None] * len(fn._input_metadata))
    except RuntimeError as e:
        return str(e)
    return f"derivative for {fn.name()} is not implemented"


_SAVED_ATTRS: dict = {}  # autograd node class -> its attributes that unpack saved values


def _saved_tensors(fn) -> list:
    """The tensors autograd node `fn` saved for its backward, unpacked as its backward would:
    a RuntimeError if one was written in place since (autograd's version check)."""
    names = _SAVED_ATTRS.get(type(fn))
    if names is None:
        names = _SAVED_ATTRS[type(fn)] = [a for a in dir(type(fn)) if a.startswith("_saved_")] + \
            (["saved_tensors"] if hasattr(type(fn), "saved_tensors") else [])
    out = []
    for name in names:
        v = getattr(fn, name)
        for t in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _storage(t):
    return t.untyped_storage()._cdata


def _walk(roots, leaf_bit, saved_storages):
    """For every autograd node reachable from `roots`: (the leaves it reaches as a bitmask, the
    message of the error its backward or one after it raises, or None). Adds the storages of the
    values the nodes saved to `saved_storages`. Iterative: autograd graphs can be deep."""
    memo: dict = {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            fn, children_done = stack.pop()
            if fn is None or (fn in memo and not children_done):
                continue
            children = [c for c, _ in fn.next_functions if c is not None]
            if not children_done:
                stack.append((fn, True))
                stack.extend((c, False) for c in children if c not in memo)
                continue
            error = _error_message(fn) if fn.name() in RAISING_NODES else None
            try:
                saved_storages.update(_storage(t) for t in _saved_tensors(fn))
            except RuntimeError as e:  # a saved value written in place after it was saved
                error = error or str(e)
            bits = leaf_bit(fn)
            for c in children:
                c_bits, c_error = memo[c]
                bits |= c_bits
                error = error or c_error
            memo[fn] = (bits, error)
    return memo


def check_shapes(gm: fx.GraphModule, inputs) -> None:
    """`gm` run on meta stand-ins of `inputs`: raises where an op's shape checks refuse them."""
    with torch.no_grad(), torch.device("meta"):
        # (not freed at its last read: a value is kept until its `writes` node moves its version)
        _MetaRun(gm, garbage_collect_values=False).run(*[_meta_input(t) for t in inputs])


def eager_autograd(gm: fx.GraphModule, inputs) -> EagerAutograd:
    metas = [_meta_input(t) for t in inputs]
    with torch.enable_grad(), torch.device("meta"):
        out = _MetaRun(gm, garbage_collect_values=False).run(*metas)  # `writes` may name any earlier node
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    bit_of = {id(m): 1 << i for i, m in enumerate(metas) if isinstance(m, torch.Tensor) and m.requires_grad}

    def leaf_bit(fn):
        return bit_of.get(id(fn.variable), 0) if hasattr(fn, "variable") else 0

    saved: set = set()
    memo = _walk([o.grad_fn for o in outs if isinstance(o, torch.Tensor)], leaf_bit, saved)
    reaches, raises = [], []
    for o in outs:
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            reaches.append(0)
            raises.append(None)
        elif o.grad_fn is None:  # an input returned as it is
            reaches.append(bit_of.get(id(o), 0))
            raises.append(None)
        else:
            bits, error = memo[o.grad_fn]
            reaches.append(bits)
            raises.append(error)
    return EagerAutograd(
        output_requires_grad=[isinstance(o, torch.Tensor) and o.requires_grad for o in outs],
        reaches=reaches, raises=raises,
        saved_inputs=frozenset(i for i, m in enumerate(metas) if isinstance(m, torch.Tensor) and _storage(m) in saved),
        saved_outputs=frozenset(j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and _storage(o) in saved))
