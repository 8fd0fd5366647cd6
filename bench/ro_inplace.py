"""mode="reduce-overhead" when only some inputs move: a small MLP (64x64, fp32; weights passed as
plain tensors) called back to back, us a call (host time, one synchronize at the end, 5 rounds).
A replay copies only the inputs seen elsewhere since its recording: with x fresh each call and
the weights in place, one copy instead of five (what every input moving costs).

    PYTHONPATH=compiler python bench/ro_inplace.py
"""
import torch
import torch.nn.functional as F

import run as bench

import fuselens


def mlp(x, w1, b1, w2, b2):
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


def inputs():
    r = lambda *shape: torch.randn(*shape, device="cuda")
    return [r(64, 64), r(64, 64), r(64), r(64, 64), r(64)]


def alternate(fn, sets):
    """A call of `fn` on each of the two input sets in turn."""
    turn = [0]

    def call():
        turn[0] ^= 1
        return fn(*sets[turn[0]])
    return call


def main():
    bench.ROUNDS = 5
    fixed, other = inputs(), inputs()
    variants = {"eager": (mlp, ()), "default": (fuselens.compile(mlp), ()),
                "reduce-overhead, nothing moves": (fuselens.compile(mlp, mode="reduce-overhead"), ()),
                "reduce-overhead, x moves": (fuselens.compile(mlp, mode="reduce-overhead"), (0,)),
                "reduce-overhead, every input moves": (fuselens.compile(mlp, mode="reduce-overhead"), range(5))}
    calls = {}
    for name, (fn, moving) in variants.items():
        sets = [fixed, [o if i in moving else f for i, (f, o) in enumerate(zip(fixed, other))]]
        calls[name] = alternate(fn, sets)
        for _ in range(50):  # past recordings and the replay-or-launch trial
            calls[name]()
        for s in sets:  # both input sets give eager's results
            torch.testing.assert_close(fn(*s).clone(), mlp(*s), msg=name)
    for name, seconds in bench.in_rounds(calls, bench.host_time).items():
        print(f"{name:40} {seconds * 1e6:6.1f} us a call")


if __name__ == "__main__":
    main()
