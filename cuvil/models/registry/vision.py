"""Image classifiers written in torch.nn from their papers: ResNet, MobileNetV2 / V3, EfficientNet-B0,
DenseNet-121, ConvNeXt-T and ViT-S/16.

Every builder takes a config: ``"full"`` is the published network at 1x3x224x224 with 1000 classes;
``"ci"`` keeps every kind of block (strided and identity residuals, SE, each activation) with fewer
repeats, narrower layers and a 64x64 input.  Weights are seeded; normalisation layers get seeded
statistics (:func:`cuvil.models.registry.common.finish`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuvil.models.registry.common import ConvBNAct, SqueezeExcite, finish, image, make_divisible, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


def _classifier(model: nn.Module, config: str) -> Built:
    size = 224 if config == "full" else 64
    return finish(model, image(3, size, batch=4, seed=99)), {"input": image(3, size)}, ["logits"]


# -- ResNet (He, Zhang, Ren, Sun: Deep Residual Learning for Image Recognition, 2015) ------------------

class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1 = ConvBNAct(cin, width, 3, stride)
        self.conv2 = ConvBNAct(width, width, 3, act=None)
        self.down = None if stride == 1 and cin == width else ConvBNAct(cin, width, 1, stride, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return F.relu(self.conv2(self.conv1(x)) + skip)


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride: "ResNet v1.5", as most published weights), 1x1 expand x4."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(ConvBNAct(cin, width, 1), ConvBNAct(width, width, 3, stride),
                                  ConvBNAct(width, cout, 1, act=None))
        self.down = None if stride == 1 and cin == cout else ConvBNAct(cin, cout, 1, stride, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return F.relu(self.body(x) + skip)


class ResNet(nn.Module):
    def __init__(self, block: type[_Basic] | type[_Bottleneck], depths: list[int], widths: list[int],
                 classes: int):
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, widths[0], 7, 2), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(depths, widths)):
            for j in range(n):
                layers.append(block(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet(config: str, depth: int) -> Built:
    """ResNet-18 (basic blocks [2,2,2,2]) or ResNet-50 (bottlenecks [3,4,6,3]), widths 64..512.
    ci: blocks [2,1,1,1], widths 16..128."""
    seeded()
    block = _Basic if depth == 18 else _Bottleneck
    if config == "full":
        depths = [2, 2, 2, 2] if depth == 18 else [3, 4, 6, 3]
        return _classifier(ResNet(block, depths, [64, 128, 256, 512], 1000), config)
    return _classifier(ResNet(block, [2, 1, 1, 1], [16, 32, 64, 128], 10), config)


# -- MobileNetV2 (Sandler, Howard, Zhu, Zhmoginov, Chen: Inverted Residuals and Linear Bottlenecks, 2018) --

class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = round(cin * expand)
        layers: list[nn.Module] = [ConvBNAct(cin, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
        layers += [ConvBNAct(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                   ConvBNAct(hidden, cout, 1, act=None)]  # the linear bottleneck
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


# (expansion t, channels c, repeats n, stride s) of the paper's table 2
_V2 = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
_V2_CI = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 1, 2), (6, 64, 1, 2)]  # t=1, strided and identity blocks


def mobilenet_v2(config: str) -> Built:
    """MobileNetV2 1.0: stem 32, the 17 inverted residuals of table 2, 1x1 to 1280, classifier.
    ci: width 0.5, the first 4 rows with 5 blocks, last conv 256."""
    seeded()
    full = config == "full"
    width, rows, last, classes = (1.0, _V2, 1280, 1000) if full else (0.5, _V2_CI, 256, 10)
    cin = make_divisible(32 * width)
    layers: list[nn.Module] = [ConvBNAct(3, cin, 3, 2, act=nn.ReLU6)]
    for t, c, n, s in rows:
        cout = make_divisible(c * width)
        for j in range(n):
            layers.append(_InvertedResidual(cin, cout, s if j == 0 else 1, t))
            cin = cout
    layers += [ConvBNAct(cin, last, 1, act=nn.ReLU6), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
               nn.Linear(last, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- MobileNetV3 (Howard et al.: Searching for MobileNetV3, 2019) ---------------------------------------

class _Bneck(nn.Module):
    def __init__(self, cin: int, k: int, exp: int, cout: int, se: bool, act: type[nn.Module], stride: int):
        super().__init__()
        layers: list[nn.Module] = [ConvBNAct(cin, exp, 1, act=act)] if exp != cin else []
        layers.append(ConvBNAct(exp, exp, k, stride, groups=exp, act=act))
        if se:
            layers.append(SqueezeExcite(exp, make_divisible(exp / 4), nn.ReLU, nn.Hardsigmoid))
        layers.append(ConvBNAct(exp, cout, 1, act=None))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


_RE, _HS = nn.ReLU, nn.Hardswish
# (kernel, expansion size, out channels, SE, activation, stride) of table 1 (MobileNetV3-Large)
_V3_LARGE = [(3, 16, 16, False, _RE, 1), (3, 64, 24, False, _RE, 2), (3, 72, 24, False, _RE, 1),
             (5, 72, 40, True, _RE, 2), (5, 120, 40, True, _RE, 1), (5, 120, 40, True, _RE, 1),
             (3, 240, 80, False, _HS, 2), (3, 200, 80, False, _HS, 1), (3, 184, 80, False, _HS, 1),
             (3, 184, 80, False, _HS, 1), (3, 480, 112, True, _HS, 1), (3, 672, 112, True, _HS, 1),
             (5, 672, 160, True, _HS, 2), (5, 960, 160, True, _HS, 1), (5, 960, 160, True, _HS, 1)]
# ci: a row of each kind (no expansion; plain / SE; ReLU / hard-swish; 3x3 / 5x5; strided / residual)
_V3_CI = [0, 1, 3, 4, 6, 10]


def mobilenet_v3_large(config: str) -> Built:
    """MobileNetV3-Large: stem 16 (hard-swish), the 15 bnecks of table 1, 1x1 to 960, pool, 1x1 to
    1280 (no BN, hard-swish), 1x1 to the classes.  ci: width 0.5, 6 of the 15 rows, head 256."""
    seeded()
    full = config == "full"
    width, rows, head, classes = (1.0, range(15), 1280, 1000) if full else (0.5, _V3_CI, 256, 10)
    cin = make_divisible(16 * width)
    layers: list[nn.Module] = [ConvBNAct(3, cin, 3, 2, act=_HS)]
    for i in rows:
        k, exp, c, se, act, s = _V3_LARGE[i]
        cout = make_divisible(c * width)
        layers.append(_Bneck(cin, k, make_divisible(exp * width), cout, se, act, s))
        cin = cout
    last = make_divisible(960 * width)
    layers += [ConvBNAct(cin, last, 1, act=_HS), nn.AdaptiveAvgPool2d(1), nn.Conv2d(last, head, 1), _HS(),
               nn.Dropout(0.2), nn.Conv2d(head, classes, 1), nn.Flatten()]
    return _classifier(nn.Sequential(*layers), config)


# -- EfficientNet (Tan, Le: Rethinking Model Scaling for Convolutional Neural Networks, 2019) -------------

class _MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [ConvBNAct(cin, hidden, 1, act=nn.SiLU)] if expand != 1 else []
        layers += [ConvBNAct(hidden, hidden, k, stride, groups=hidden, act=nn.SiLU),
                   SqueezeExcite(hidden, max(1, cin // 4), nn.SiLU, nn.Sigmoid),  # SE ratio 0.25 of the input
                   ConvBNAct(hidden, cout, 1, act=None)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout  # (stochastic depth is the identity in eval)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


# (expansion, kernel, stride, channels, repeats) of table 1 (EfficientNet-B0)
_B0 = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
       (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
_B0_CI = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 1)]  # no expansion; 3x3 and 5x5; strided, identity


def efficientnet_b0(config: str) -> Built:
    """EfficientNet-B0: stem 32 (SiLU), the 16 MBConv blocks of table 1, 1x1 to 1280, classifier.
    ci: width 0.5, the first 3 stages with 4 blocks, head 256."""
    seeded()
    full = config == "full"
    width, stages, head, classes = (1.0, _B0, 1280, 1000) if full else (0.5, _B0_CI, 256, 10)
    cin = make_divisible(32 * width)
    layers: list[nn.Module] = [ConvBNAct(3, cin, 3, 2, act=nn.SiLU)]
    for e, k, s, c, n in stages:
        cout = make_divisible(c * width)
        for j in range(n):
            layers.append(_MBConv(cin, cout, k, s if j == 0 else 1, e))
            cin = cout
    layers += [ConvBNAct(cin, head, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
               nn.Linear(head, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- DenseNet (Huang, Liu, van der Maaten, Weinberger: Densely Connected Convolutional Networks, 2017) ----

class _DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 (bottleneck to 4k) - BN-ReLU-Conv3x3 (k new maps), concatenated to the input."""

    def __init__(self, cin: int, growth: int, bn_size: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, bn_size * growth, 1, bias=False),
                                  nn.BatchNorm2d(bn_size * growth), nn.ReLU(),
                                  nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


def densenet121(config: str) -> Built:
    """DenseNet-121 (DenseNet-BC): stem 7x7/2 to 64 + max pool, dense blocks [6,12,24,16] with growth
    32 and bottleneck 4k, transitions (BN-ReLU-1x1 halving the channels, 2x2 average pool), final
    BN-ReLU, pool, classifier.  ci: blocks [2,2,2,2], growth 8, stem 16."""
    seeded()
    full = config == "full"
    blocks, growth, cin, classes = ((6, 12, 24, 16), 32, 64, 1000) if full else ((2, 2, 2, 2), 8, 16, 10)
    layers: list[nn.Module] = [ConvBNAct(3, cin, 7, 2), nn.MaxPool2d(3, 2, 1)]
    for i, n in enumerate(blocks):
        for _ in range(n):
            layers.append(_DenseLayer(cin, growth, 4))
            cin += growth
        if i < len(blocks) - 1:
            layers += [nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cin // 2, 1, bias=False), nn.AvgPool2d(2, 2)]
            cin //= 2
    layers += [nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- ConvNeXt (Liu, Mao, Wu, Feichtenhofer, Darrell, Xie: A ConvNet for the 2020s, 2022) -----------------

class _ChannelsLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permute to NHWC, normalise, permute back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _ConvNeXtBlock(nn.Module):
    """7x7 depthwise, LayerNorm, Linear 4x, GELU, Linear back, layer scale, residual.

    The layer scale starts at 1e-6 in training; here it is drawn at random (as trained weights are
    far from 1e-6), so each block's branch shows in the output."""

    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.rand(dim) * 0.5 + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + (self.gamma * self.mlp(y)).permute(0, 3, 1, 2)


def convnext_tiny(config: str) -> Built:
    """ConvNeXt-T: 4x4/4 stem + LayerNorm, stages of [3,3,9,3] blocks at 96/192/384/768 channels,
    LayerNorm + 2x2/2 conv between stages, pool, LayerNorm, classifier.  ci: [1,1,2,1] blocks at
    24..192 channels."""
    seeded()
    full = config == "full"
    depths, dims, classes = ([3, 3, 9, 3], [96, 192, 384, 768], 1000) if full else ([1, 1, 2, 1], [24, 48, 96, 192], 10)
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), _ChannelsLayerNorm(dims[0], eps=1e-6)]
    for i, (n, d) in enumerate(zip(depths, dims)):
        if i > 0:
            layers += [_ChannelsLayerNorm(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], d, 2, 2)]
        layers += [_ConvNeXtBlock(d) for _ in range(n)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- ViT (Dosovitskiy et al.: An Image is Worth 16x16 Words, 2020; the S size from DeiT, Touvron et al. 2021)

class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class _EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + MHSA(LN(x)), then x + MLP(LN(x)) with a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, size: int, patch: int, dim: int, depth: int, heads: int, classes: int):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[_EncoderBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit_small(config: str) -> Built:
    """ViT-S/16: 16x16 patches, class token, learned positions, 12 pre-norm blocks of dim 384 with 6
    heads and a 1536 MLP, LayerNorm, classifier on the class token.  ci: 64x64, 2 blocks of dim 64,
    2 heads."""
    seeded()
    if config == "full":
        return _classifier(ViT(224, 16, 384, 12, 6, 1000), config)
    return _classifier(ViT(64, 16, 64, 2, 2, 10), config)
