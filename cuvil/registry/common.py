"""Pieces every torch.nn model of the registry shares: seeding, trained-looking norms, the image input.

Imported only when a model is built (it imports torch).
"""

from __future__ import annotations

import torch
from torch import nn

SEED = 0


def seeded() -> torch.Generator:
    """Seed torch's global generator (weights) and return it."""
    return torch.manual_seed(SEED)


def finish(model: nn.Module, *calibration: torch.Tensor) -> nn.Module:
    """Make a freshly initialised model look trained, then switch it to eval mode.

    Normalisation layers get seeded affine parameters away from the identity (a new BatchNorm is
    ``x / sqrt(1 + eps)``, which would hide a wrong folding).  With ``calibration`` inputs, every
    BatchNorm's running statistics are then measured on them (one forward pass in training mode,
    cumulative averages), as training leaves them: activations stay near unit scale at any depth,
    so outputs are neither vanishing nor huge."""
    gen = torch.Generator().manual_seed(SEED + 1)
    norms = [m for m in model.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm))]
    with torch.no_grad():
        for m in norms:
            if getattr(m, "weight", None) is not None:
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
        bns = [m for m in norms if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if calibration and bns:
            for m in bns:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average over the calibration pass
            model.train()
            model(*calibration)
            for m in bns:
                m.momentum = 0.1
    return model.eval()


def image(channels: int, size: int, batch: int = 1, seed: int = SEED + 2) -> torch.Tensor:
    """A seeded random image batch, ``batch x channels x size x size``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, size, size, generator=gen)


def make_divisible(v: float, divisor: int = 8) -> int:
    """The channel count nearest ``v`` that ``divisor`` divides, never more than 10% below ``v`` (the
    rounding MobileNetV2/V3 and EfficientNet publish for width multipliers)."""
    n = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return n + divisor if n < 0.9 * v else n


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + an activation (or none); 'same' padding for odd kernels."""

    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1,
                 act: type[nn.Module] | None = nn.ReLU):
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                                   nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)
