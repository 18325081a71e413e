"""Recurrent classifiers: ``nn.LSTM`` / ``nn.GRU`` (2 layers, batch_first) and a Linear head on the
last step's output.  Both exporters write the ONNX ``LSTM`` / ``GRU`` ops for these.

``"full"``: 2 layers x 512 hidden over 64 steps of 128 features (input 1x64x128), 10 classes.
``"ci"``: 2 layers x 32 hidden over 8 steps of 16 features.
"""

from __future__ import annotations

import torch
from torch import nn

from cuvil.models.registry.common import SEED, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


class RecurrentClassifier(nn.Module):
    def __init__(self, cell: str, features: int, hidden: int, layers: int, classes: int):
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def recurrent(config: str, cell: str) -> Built:
    """An ``nn.LSTM`` or ``nn.GRU`` classifier (PyTorch's default uniform(-1/sqrt(hidden)) weights)."""
    seeded()
    steps, features, hidden = (64, 128, 512) if config == "full" else (8, 16, 32)
    model = RecurrentClassifier(cell, features, hidden, 2, 10).eval()
    x = torch.randn(1, steps, features, generator=torch.Generator().manual_seed(SEED + 2))
    return model, {"input": x}, ["logits"]
