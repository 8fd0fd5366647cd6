"""torch.distributed's module wrappers, compiled with their own Python around the compiled forward.

- DistributedDataParallel: its `forward` (the profiler range, `_pre_forward`'s reducer
  preparation and input moves, `_post_forward`'s search for unused parameters and its sink for
  static graphs) is DDP's own and runs in Python; the module it wraps runs its `forward` compiled.
  The graphs captured there are split at DDP's buckets (ddp_buckets.py).
- FSDP2 (`fully_shard`): a sharded module's hooks (the pre-forward all-gather, the post-forward
  reshard, the backward reduce-scatter they register) are collectives and parameter swaps that
  run where FSDP2 runs them, in Python; the module's own `forward` runs compiled, with the
  gathered parameters FSDP2 registers for it. Capture breaks at a call of such a module
  (capture/objects.py) and the call goes to `unit_call`: one compiled function per unit.

`fuselens.compile` of either is a `compiled.CompiledWrapper`. Both are `nn.Module._call_impl` run as it is, with the compiled forward in place of the module's
`forward` for the call (an instance attribute, as `compile_in_place` sets it; the previous one
put back after)."""
from __future__ import annotations

import types
import weakref

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..capture.calls import fsdp_unit as is_fsdp_unit  # noqa: F401  (the runtime's name for it)


def is_ddp(module) -> bool:
    return isinstance(module, DistributedDataParallel)


def call_with_forward(called: nn.Module, module: nn.Module, compiled, args, kwargs):
    """`called(*args, **kwargs)` (its hooks and wrapper logic in Python) with `module`'s forward
    run compiled."""
    own = module.__dict__
    previous = own.get("forward")
    own["forward"] = types.MethodType(compiled, module)
    try:
        return called(*args, **kwargs)
    finally:
        if previous is None:
            del own["forward"]
        else:
            own["forward"] = previous


_UNITS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def unit_call(module: nn.Module, compile_forward):
    """An FSDP2 unit called from compiled code (after capture's break at the call): its hooks in
    Python, its forward compiled by a function of its own (`compile_forward(forward)`; one per
    unit: guards on one unit's parameters do not hold for another's). A unit compiled in place
    is called as it is."""
    if module.__dict__.get("forward") is not None:
        return module
    compiled = _UNITS.get(module)
    if compiled is None:
        compiled = _UNITS[module] = compile_forward(type(module).forward)
    return lambda *args, **kwargs: call_with_forward(module, module, compiled, args, kwargs)
