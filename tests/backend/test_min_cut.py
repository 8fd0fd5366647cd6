"""The partition's minimum cut (autograd/partition.py `_FlowNet`): on random small networks, the
cut it returns has the least capacity of all cuts, and is the one closest to the sink (the
largest source side among the minimum cuts), as networkx's `minimum_cut` partition was."""
import importlib
import itertools
import math
import random

import pytest

partition = importlib.import_module("fuselens.autograd.partition")


def capacity(edges, source_side):
    return sum(c for u, v, c in edges if u in source_side and v not in source_side)


@pytest.mark.parametrize("seed", range(60))
def test_minimum_cut_is_the_least_and_the_closest_to_the_sink(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    edges = []
    for _ in range(rng.randint(n, 3 * n)):
        u, v = rng.sample(range(n), 2)
        edges.append((u, v, math.inf if rng.random() < 0.1 else rng.randint(1, 6)))
    net = partition._FlowNet()
    for v in range(n):
        net.add_node(v)
    for u, v, c in edges:
        net.add_edge(u, v, c)
    cuts = [{0, *rest} for k in range(n - 1) for rest in itertools.combinations(range(1, n - 1), k)]
    best = min(capacity(edges, s) for s in cuts)
    if best == math.inf:
        with pytest.raises(ValueError):
            net.minimum_cut_source_side(0, n - 1)
        return
    got = net.minimum_cut_source_side(0, n - 1)
    assert capacity(edges, got) == best
    assert got == set().union(*[s for s in cuts if capacity(edges, s) == best])
