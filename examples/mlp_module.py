"""A small nn.Module (Linear + ReLU), compiled as `fuselens.compile(mod)` and decorated."""
import torch
import torch.nn as nn

import fuselens


class LinearReLU(nn.Module):
    def __init__(self, d_in=32, d_out=16):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class DecoratedLinearReLU(nn.Module):
    def __init__(self, d_in=32, d_out=16):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    @fuselens.compile
    def forward(self, x):
        return torch.relu(self.fc(x))


torch.manual_seed(0)
model = fuselens.compile(LinearReLU())
decorated = DecoratedLinearReLU()

EXAMPLE_INPUTS = {
    "LinearReLU.forward": lambda: (model, torch.randn(8, 32)),
    "DecoratedLinearReLU.forward": lambda: (decorated, torch.randn(8, 32)),
}

if __name__ == "__main__":
    print(model(torch.randn(2, 32)).shape, decorated(torch.randn(2, 32)).shape)
