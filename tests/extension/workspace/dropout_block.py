import torch
import torch.nn as nn


class Block(nn.Module):
    """A training-mode block with dropout: its compiled output cannot equal eager's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.1)

    # fuselens: example(x=float32[32, 64])
    def forward(self, x):
        return self.drop(torch.relu(self.lin(x))) + x


block = torch.compile(Block())
