"""Torch-level functions as compositions of primitives.

One function per torch op, registered for every spelling capture may produce: the `torch.*`
function, the `torch.nn.functional.*` function, the `operator.*` function and the unbound
`torch.Tensor.*` method. Anything not registered here becomes an extern `call_torch`.
Decompositions raise `Unsupported` for argument combinations they do not handle; the caller
then uses the extern call too, so no graph fails for want of a decomposition.

This module is the registry's entry point: it imports each module of decompositions (each
registers its own into `registry.DECOMPOSITIONS`), then gives the torch.Tensor methods that also
reach graphs as their C spellings the same decompositions.
"""
from . import (activations, creation, linalg, losses, normalization, pointwise, pooling,  # noqa: F401  (registrations)
               randomness, reductions, views, writes)
from .registry import DECOMPOSITIONS, Unsupported, Written, register_c_method_spellings

register_c_method_spellings()

__all__ = ["DECOMPOSITIONS", "Unsupported", "Written"]
