"""Python side effects of compiled code happen once, in order, as in eager: mutations of lists,
dicts and sets reached from arguments, globals and closures are made on the real objects by
the transformed function (never during capture), on every call, cache hits included."""
from __future__ import annotations

import warnings

import pytest
import torch

import fuselens
from fl_capture_testing import assert_same, clone_tree

X = torch.randn(4, 3)
GLOBAL_LOG: list = []
GLOBAL_STATE: dict = {}


def _reset_globals(log=(), state=None):
    GLOBAL_LOG[:] = list(log)
    GLOBAL_STATE.clear()
    GLOBAL_STATE.update(state or {})


def _helper_append(log, v):
    log.append(v * 2)
    return v + 1


# -- cases: (function, arguments after x, initial globals) ------------------------------------
def list_append(x, log):
    log.append(1)
    return x + 1


def list_append_tensor(x, log):
    y = x * 2
    log.append(y)
    return y + 1


def list_extend(x, log):
    items = [x.sum(), 2]
    log.extend(items)
    items.append(3)  # after the extend: not in log
    return x - 1


def list_iadd(x, log):
    log += [x.mean(), "a"]
    return x


def list_insert(x, log):
    log.insert(0, x * 3)
    log.insert(1, "b")
    return x


def list_pop(x, log):
    y = log.pop(0)
    z = log.pop()
    return x + y * z


def list_setitem(x, log):
    log[0] = x + 1
    log[-1] = "z"
    return log[0] * 2


def list_delitem(x, log):
    del log[0]
    del log[-1]
    return x * len(log)


def list_remove_clear(x, log):
    log.remove(2.0)
    n = len(log)
    log.clear()
    log.append(n)
    return x * n


def dict_setitem(x, d):
    d["new"] = x.sum()
    d["a"] = d["a"] + 1
    return x * d["a"]


def dict_update_pop(x, d):
    v = d.pop("a")
    d.update(b=x * v, c="s")
    d.update({"e": 5})
    missing = d.pop("zz", None)
    return x + v, missing


def dict_setdefault_del(x, d):
    d.setdefault("a", 100)
    lst = d.setdefault("lst", [])
    lst.append(x.max())
    del d["a"]
    return x


def set_add(x, s):
    s.add(3)
    s.discard(1)
    s.update({7, 8})
    return x * len(s)


def nested_containers(x, d):
    d["inner"].append(x.shape[0])
    d["pair"][1]["k"] = x * 2
    d["fresh"] = [1]
    d["fresh"].append(x.sum())  # a list of the function's own, stored into an argument
    return x


def nested_replaced_then_mutated(x, d):
    d["inner"] = []
    d["inner"].append(x + 1)
    return x


def mutation_around_break(x, log):
    log.append(1)
    v = x.sum().item()  # graph break
    log.append(v)
    log.append(x * v)
    return x + v


def mutation_around_print_break(x, log):
    log.append(x.sum())
    print("", end="")  # graph break
    log.append(x.shape[0])
    return x * 2


def mutation_in_callee(x, log):
    y = _helper_append(log, x)
    return _helper_append(log, y)


def mutation_in_callee_with_break(x, log):
    y = _helper_append(log, x)
    y = y * x.sum().item()  # graph break between two mutations
    return _helper_append(log, y)


def global_list(x):
    GLOBAL_LOG.append(x.sum())
    GLOBAL_LOG.append(len(GLOBAL_LOG))
    return x + 1


def global_dict(x):
    GLOBAL_STATE["n"] = GLOBAL_STATE.get("n", 0) + 1
    GLOBAL_STATE["t"] = x * 2
    return x


def tensor_into_arg_list(x, out):
    y = x.relu()
    out.append(y)
    out[0] = out[0] + y
    return out[-1]


def pop_then_index(x, xs):
    first = xs.pop(0)
    xs[0].append(first)  # xs[0] was xs[1] on entry
    return x


def aliased_arguments(x, a, b):
    a.append(1)
    b.append(2)
    return x * len(a)


def rolled_back_loop(x, log):
    for i in range(3):
        log.append(i)
        if x.sum() > 1000:  # data-dependent: the whole loop runs in Python
            break
    return x + len(log)


def rolled_back_loop_local(x):
    out = []
    for i in range(3):
        out.append(x * i)
        if x.sum() > 1000:
            break
    return out


def mutation_by_operator_function(x, log):
    import operator
    own = []
    operator.iadd(own, [x.sum()])  # runs in Python (a break), once
    operator.setitem(log, 0, x * 2)
    return own


def mutation_in_loop_with_break(x, log):
    for i in range(3):
        log.append(i)
        x = x * 2
        print("", end="")  # graph break in each iteration: the rest resumes
    return x


def mutation_around_data_dependent_if(x, log):
    log.append(1)
    if x.sum() > 0:  # the graph computes the condition, Python branches
        log.append(2)
    else:
        log.append(3)
    log.append(x.shape)
    return x


def _inner_with_break(log, x):
    log.append(0)
    v = x.sum().item()
    log.append(v)
    return x * v


def mutation_in_callee_around_its_break(x, log):
    y = _inner_with_break(log, x)
    log.append("after")
    return y


def mutation_under_no_grad_with_break(x, log):
    with torch.no_grad():
        log.append(x * 2)
        v = x.sum().item()
        log.append(v)
    return x


def mutation_stays_after_return(x, log):
    log.append(x)
    return log


CASES = {
    list_append: ([],),
    list_append_tensor: ([],),
    list_extend: ([0],),
    list_iadd: ([1],),
    list_insert: ([1, 2],),
    list_pop: ([1.5, 2.0, 3.0],),
    list_setitem: ([1, 2, 3],),
    list_delitem: ([1, 2, 3, 4],),
    list_remove_clear: ([1.0, 2.0, 3.0],),
    dict_setitem: ({"a": 1},),
    dict_update_pop: ({"a": 2.0, "b": 0},),
    dict_setdefault_del: ({"a": 1},),
    set_add: ({1, 2},),
    nested_containers: ({"inner": [0], "pair": (1, {"k": None})},),
    nested_replaced_then_mutated: ({"inner": [5]},),
    mutation_around_break: ([],),
    mutation_around_print_break: ([],),
    mutation_in_callee: ([],),
    mutation_in_callee_with_break: ([],),
    global_list: (),
    global_dict: (),
    tensor_into_arg_list: ([torch.ones(4, 3)],),
    pop_then_index: ([[1], [2], [3]],),
    rolled_back_loop: ([],),
    rolled_back_loop_local: (),
    mutation_stays_after_return: ([],),
    mutation_by_operator_function: ([0],),
    mutation_in_loop_with_break: ([],),
    mutation_around_data_dependent_if: ([],),
    mutation_in_callee_around_its_break: ([],),
    mutation_under_no_grad_with_break: ([],),
}


def _state(args):
    return clone_tree(list(args)), clone_tree(list(GLOBAL_LOG)), clone_tree(dict(GLOBAL_STATE))


def _run(fn, args, calls, inputs):
    """Runs `fn` `calls` times, each on new containers (the same as the first: the calls after
    it hit the cache); returns results and the containers after each call. The globals are
    not reset: their mutations accumulate."""
    _reset_globals([7])
    outs, states = [], []
    for x in inputs[:calls]:
        a = clone_tree(args)
        outs.append(fn(x, *a))
        states.append(_state(a))
    return outs, states


@pytest.mark.parametrize("fn", list(CASES), ids=lambda f: f.__name__)
def test_mutation_happens_once_as_in_eager(fn):
    calls = 3  # the second and third calls hit the cache: the mutations are made again
    inputs = [X.clone() for _ in range(calls)]
    args = CASES[fn]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, expected_state = _run(fn, args, calls, inputs)
        cf = fuselens.compile(fn)
        got, got_state = _run(cf, args, calls, inputs)
    assert not cf.disabled, cf.disabled
    if fn not in (global_list, global_dict):  # these read their global's contents (guarded)
        assert len(cf.entries) == 1, "a call on the same inputs recompiled"
    assert_same(got, expected)
    assert_same(got_state, expected_state)


def test_repeated_calls_hit_the_cache_and_replay():
    def f(x, d):
        d["acc"] = d["acc"] + x
        d["n"] += 1  # an int: guarded by value, one entry per count
        return x

    def g(x, log):
        log.pop(0)
        log.append(x.sum())  # same length each call: one cache entry
        return x

    d = {"acc": torch.zeros(4, 3), "n": 0}
    cf = fuselens.compile(f)
    for _ in range(3):
        cf(X, d)
    torch.testing.assert_close(d["acc"], X * 3)
    assert d["n"] == 3
    log = [X.sum(), X.sum()]
    cg = fuselens.compile(g)
    for _ in range(4):
        cg(X, log)
    assert len(cg.entries) == 1
    assert len(log) == 2 and all(isinstance(v, torch.Tensor) for v in log)


def test_stored_tensor_is_the_returned_object():
    def f(x, out):
        y = x * 2
        out.append(y)
        return y

    out = []
    y = fuselens.compile(f)(X, out)
    assert out[0] is y


def test_dynamic_sizes_appended_are_ints_of_this_call():
    log = []

    def f(x, log):
        log.append(x.shape[0])
        log.append(x.numel() * 2)
        log.append(x.shape)
        return x + 1

    cf = fuselens.compile(f)
    for n in (3, 4, 5, 6):
        log.clear()
        cf(torch.randn(n, 2), log)
        assert log == [n, n * 4, torch.Size([n, 2])]
        assert type(log[0]) is int and type(log[1]) is int
    assert len(cf.entries) == 2  # 3, then one dynamic entry for 4, 5, 6


def test_fstring_of_dynamic_shape_holds_this_calls_size(capsys):
    def f(x):
        GLOBAL_LOG.append(f"{x.shape}")
        return x + 1

    cf = fuselens.compile(f)
    for n in (3, 4, 5):
        _reset_globals()
        cf(torch.randn(n))
        assert GLOBAL_LOG == [f"{torch.Size([n])}"]


CALLS: list = []


def _fails_in_capture_global(x):
    CALLS.append(1)
    global _UNUSED
    return x + 1


def _fails_in_capture_internal(x):
    CALLS.append(1)
    return x + 1


@pytest.mark.parametrize("how", ["global statement", "internal error"])
def test_capture_failure_does_not_repeat_side_effect(how, monkeypatch):
    fn = _fails_in_capture_global if how == "global statement" else _fails_in_capture_internal
    if how == "internal error":
        from fuselens.capture import graph as G

        def boom(*a, **k):
            raise RuntimeError("capture failed")
        monkeypatch.setattr(G.GraphBuilder, "output", boom)
    CALLS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cf = fuselens.compile(fn)
        cf(X)
        assert CALLS == [1]
        cf(X)
    assert CALLS == [1, 1]


def test_explain_runs_the_side_effects_once():
    _reset_globals()
    global_list(X)
    expected = clone_tree(GLOBAL_LOG)
    _reset_globals()
    fuselens.explain(global_list, X)
    assert_same(GLOBAL_LOG, expected)


def test_aliased_then_distinct_arguments_recompile():
    a = []
    cf = fuselens.compile(aliased_arguments)
    cf(X, a, a)
    assert a == [1, 2]
    b, c = [], []
    cf(X, b, c)
    assert b == [1] and c == [2]


# -- attribute assignment on objects from outside -------------------------------------------------
class Holder:
    def __init__(self):
        self.count = 0
        self.items = []
        self.t = None


class WithProperty:
    def __init__(self):
        self.log = []

    @property
    def value(self):
        return len(self.log)

    @value.setter
    def value(self, v):  # runs in Python (a break): it is more than a store
        self.log.append(v)


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.calls = 0
        self.cache = None

    def forward(self, x):
        self.calls += 1
        self.cache = self.lin(x)
        return self.cache * self.calls


def attr_counter(x, o):
    o.count += 1
    return x * o.count


def attr_tensor_read_back(x, o):
    o.t = x * 2
    return o.t + 1


def attr_new_list_then_mutated(x, o):
    o.items = [x.sum()]
    o.items.append(1)
    return x


def attr_list_mutated(x, o):
    o.items.append(x.shape[0])
    return x


def attr_around_break(x, o):
    o.count = 5
    v = x.sum().item()  # graph break
    o.t = x * v
    o.count = o.count + 1
    return x


def attr_property_setter(x, o):
    o.value = 3
    return x * o.value


def attr_module(x, m):
    return m(x)


class WithMethod:
    def __init__(self):
        self.items = []

    def add(self, v):
        self.items.append(v)
        return len(self.items)


def attr_list_mutated_in_method(x, o):
    n = o.add(x * 2)
    return x * n


ATTR_CASES = {attr_counter: Holder, attr_tensor_read_back: Holder,
              attr_new_list_then_mutated: Holder, attr_list_mutated: Holder,
              attr_around_break: Holder, attr_property_setter: WithProperty,
              attr_module: Counting, attr_list_mutated_in_method: WithMethod}


def _attrs(o):
    return {k: v for k, v in vars(o).items() if not k.startswith("_")} | (
        {"lin": [p.detach() for p in o.lin.parameters()]} if isinstance(o, torch.nn.Module) else {})


@pytest.mark.parametrize("fn", list(ATTR_CASES), ids=lambda f: f.__name__)
def test_attribute_assignment_happens_as_in_eager(fn):
    make = ATTR_CASES[fn]
    oe, oc = make(), make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cf = fuselens.compile(fn)
        for _ in range(3):
            expected = fn(X.clone(), oe)
            got = cf(X.clone(), oc)
            assert_same(got.detach(), expected.detach())
            assert_same(clone_tree(_attrs(oc)), clone_tree(_attrs(oe)))
    assert not cf.disabled, cf.disabled
    if fn not in (attr_counter, attr_module, attr_property_setter,  # these read an int
                  attr_list_mutated_in_method):  # and this a growing list's length
        assert len(cf.entries) == 1, "a call on the same inputs recompiled"


def test_attribute_assignment_is_not_a_graph_break():
    ex = fuselens.explain(attr_tensor_read_back, X, Holder())
    assert len(ex.graphs) == 1 and not ex.graph_breaks, str(ex)


def own_list_stored_then_mutated_after_break(x, log):
    items = []
    log.append(items)
    v = x.sum().item()  # graph break: `items` lives on in the resume
    items.append(v)
    return log, items


def own_dict_shared_across_break(x):
    inner = {"a": x}
    outer = [inner, inner]
    v = x.sum().item()
    inner["b"] = v
    return outer


@pytest.mark.parametrize("fn", [own_list_stored_then_mutated_after_break,
                                own_dict_shared_across_break], ids=lambda f: f.__name__)
def test_own_container_is_one_object_across_a_break(fn):
    args = ([],) if fn is own_list_stored_then_mutated_after_break else ()
    expected = fn(X.clone(), *clone_tree(args))
    got = fuselens.compile(fn)(X.clone(), *clone_tree(args))
    assert_same(got, expected)
    if fn is own_list_stored_then_mutated_after_break:
        assert got[0][0] is got[1]  # log[0] is items
    else:
        assert got[0] is got[1]


TABLE = {"scale": 2.0, "other": [1, 2, 3]}
WORDS = ["a", "b", "c"]


def reads_one_key(x):
    return x * TABLE["scale"] + len(WORDS)


def test_reads_of_a_global_are_guarded():
    """A read of a modelled global guards what was read (the item, the length), so a change
    of it recompiles; a change elsewhere does not."""
    cf = fuselens.compile(reads_one_key)
    try:
        torch.testing.assert_close(cf(X), reads_one_key(X))
        TABLE["other"] = [4]  # not read: same entry
        torch.testing.assert_close(cf(X), reads_one_key(X))
        assert len(cf.entries) == 1
        TABLE["scale"] = 3.0
        WORDS.append("d")
        torch.testing.assert_close(cf(X), reads_one_key(X))
        assert len(cf.entries) == 2
    finally:
        TABLE.update(scale=2.0, other=[1, 2, 3])
        del WORDS[3:]


def _make_closure():
    acc = []

    def f(x):
        acc.append(x.sum())
        return x * 2
    return f, acc


def _with_default(x, acc=[]):  # noqa: B006 (the point: a default lives on with the function)
    acc.append(x.shape[0])
    return x + 1


def test_closure_and_default_containers():
    (fe, acc_e), (fc, acc_c) = _make_closure(), _make_closure()
    cf = fuselens.compile(fc)
    for _ in range(3):
        assert_same(cf(X), fe(X))
    assert_same(acc_c, acc_e)
    assert len(cf.entries) == 1
    cd = fuselens.compile(_with_default)
    for _ in range(3):
        cd(X)
    assert _with_default.__defaults__[0] == [4, 4, 4]
