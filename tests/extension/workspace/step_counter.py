import torch

STEPS = [0]


# fuselens: example(x=float32[32, 64])
def train_step(x):
    """A step counter kept in a global list: a constant to the compiler, so each call's new count
    recompiles the function (torch.compile's too), until the recompile limit."""
    STEPS[0] += 1
    scale = 0.5 if STEPS[0] > 1_000_000 else 1.0  # a schedule that has not started
    return torch.tanh(x) * scale


step = torch.compile(train_step)
