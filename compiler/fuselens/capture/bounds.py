"""What capture knows of a tensor's values without its data: bounds every element lies within.

`torch.rand` draws from [0, 1), so `torch.rand([]) < p` is known for any p outside (0, 1): False for
`p <= 0`, True for `p >= 1`. HF's LayerDrop is that test (`if torch.rand([]) < self.layerdrop:
skip the layer`, with `layerdrop` 0 in every released config): known, it is no graph break, where
Dynamo breaks on it. The draw stays in the graph; the constant it is compared with is guarded as
any other read. A comparison that bounds do not decide breaks as any tensor condition."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bounds:
    lo: float
    hi: float
    hi_closed: bool  # whether hi itself may occur (lo always may)
    dtype: torch.dtype  # the tensor's: a Python number is compared in it (rounded: -1e-8 is -0.0 in float16)


# draws from the unit interval; in float32/float64 1.0 itself never occurs, while a float16 or
# bfloat16 draw may round up to it
_UNIT_DRAWS = {torch.rand, torch.rand_like}


def of_result(fn, dtype) -> Bounds | None:
    if fn in _UNIT_DRAWS and dtype is not None and dtype.is_floating_point:
        return Bounds(0.0, 1.0, dtype not in (torch.float32, torch.float64), dtype)
    return None


_FLIPPED = {operator.lt: operator.gt, operator.le: operator.ge, operator.gt: operator.lt,
            operator.ge: operator.le, operator.eq: operator.eq, operator.ne: operator.ne}


def decided(fn, args) -> bool | None:
    """Every element of `fn(*args)` (a comparison of a bounded tensor with a Python number),
    where the bounds decide it; else None."""
    if fn not in _FLIPPED or len(args) != 2:
        return None
    a, b = args
    if getattr(a, "bounds", None) is None:
        a, b, fn = b, a, _FLIPPED[fn]
    bounds = getattr(a, "bounds", None)
    if bounds is None or isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b):
        return None
    b = torch.tensor(b, dtype=bounds.dtype).item()  # as eager compares: in the tensor's dtype
    lo, hi, hi_closed = bounds.lo, bounds.hi, bounds.hi_closed
    below = b < lo  # every element > b
    above = b > hi or b == hi and not hi_closed  # every element < b
    if fn is operator.lt:
        return True if above else False if b <= lo else None
    if fn is operator.le:
        return True if b >= hi else False if below else None
    if fn is operator.gt:
        return True if below else False if b >= hi else None
    if fn is operator.ge:
        return True if b <= lo else False if above else None
    outside = below or above
    if fn is operator.eq:
        return False if outside else None
    return True if outside else None
