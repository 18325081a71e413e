"""Pieces every torch.nn model of the registry shares: seeding, trained-looking norms, the image input.

Imported only when a model is built (it imports torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    norms = [m for m in model.modules()
             if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm))]
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


class SqueezeExcite(nn.Module):
    """Global average pool, 1x1 down, activation, 1x1 up, gate, scale (Hu et al. 2018)."""

    def __init__(self, channels: int, squeezed: int, act: type[nn.Module], gate: type[nn.Module]):
        super().__init__()
        self.down = nn.Conv2d(channels, squeezed, 1)
        self.up = nn.Conv2d(squeezed, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.up(self.act(self.down(s))))


def he_init(model: nn.Module) -> nn.Module:
    """Re-draw every convolution and linear weight from He et al.'s normal (fan in, ReLU gain) and
    its bias from N(0, 0.1), seeded, for networks without normalisation layers (SqueezeNet, TCN, GCN):
    PyTorch's default initialisation shrinks activations about 2.4x per ReLU layer, so a deep
    unnormalised model's outputs would sink under the tests' absolute tolerance."""
    gen = torch.Generator().manual_seed(SEED + 3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
    return model
