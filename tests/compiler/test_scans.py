"""`associative_scan` (torch._higher_order_ops) captured as graph ops: eager's recursion
(generic_associative_scan) on the graph's values, its combine function inlined on whole slices.
Results and gradients equal eager's for every length (odd, even, one), dim, direction and pytree
of inputs; a combine function of other than pointwise ops in `"generic"` mode (eager vmaps it) is
a break, run by eager."""
from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.associative_scan import associative_scan

import fuselens
from fl_capture_testing import check


def _linear_recurrence(a, b, dim, reverse):
    """Mamba's selective scan: h_t = a_t * h_(t-1) + b_t, with a local combine function."""
    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r
    _, h = associative_scan(combine, (a, b), dim=dim, reverse=reverse, combine_mode="generic")
    return h.sin()


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("dim,reverse", [(1, False), (-1, True), (0, False)])
def test_a_scan_is_captured_whole_and_equals_eager(n, dim, reverse):
    shape = [3, 4, 2]
    shape[dim] = n
    a = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    b = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    check(_linear_recurrence, a, b, dim, reverse, graphs=1, breaks=[])


def test_gradients_through_a_scan_equal_eagers():
    a = torch.rand(2, 7, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    b = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    want = torch.autograd.grad(_linear_recurrence(a, b, 1, False).sum(), (a, b))
    got = torch.autograd.grad(fuselens.compile(_linear_recurrence)(a, b, 1, False).sum(), (a, b))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _cumulative_over_rows(x):
    # not pointwise: under eager's vmap, sum(0) sums each element's own first dim
    return associative_scan(lambda l, r: l + r.sum(0, keepdim=True), x, dim=0, combine_mode="generic")


def test_a_combine_function_of_other_than_pointwise_ops_is_a_break():
    check(_cumulative_over_rows, torch.randn(6, 3, 2), breaks=["FL151"])
