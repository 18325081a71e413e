"""Classifiers of convolution families the first registry lacked, written in torch.nn from their
papers: RegNetY-400MF (grouped 3x3 convolutions with squeeze-excitation), SqueezeNet (fire modules),
ShuffleNetV2 1.0x (channel split and channel shuffle), an Inception network (GoogLeNet's four-branch
modules, with 1x7 / 7x1 asymmetric convolutions in its 14x14 stage) and R3D-18 (3-D convolutions over
video clips).

``"full"``: the published network at 1x3x224x224 with 1000 classes (R3D-18: 1x3x8x112x112, 400
classes).  ``"ci"``: every kind of block and op (strided and identity units, grouped / depthwise /
asymmetric convolutions, ceil-mode pools) with fewer repeats, narrower layers and a 64x64 input
(R3D-18: 1x3x4x32x32).  Weights are seeded; normalisation layers get seeded statistics
(:func:`cuvil.models.registry.common.finish`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuvil.models.registry.common import ConvBNAct, SqueezeExcite, finish, he_init, image, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


def _classifier(model: nn.Module, config: str) -> Built:
    size = 224 if config == "full" else 64
    return finish(model, image(3, size, batch=4, seed=99)), {"input": image(3, size)}, ["logits"]


# -- RegNetY (Radosavovic, Kosaraju, Girshick, He, Dollar: Designing Network Design Spaces, 2020) --------

class _YBlock(nn.Module):
    """The Y block: 1x1 conv, 3x3 group conv (groups of ``group_width`` channels, carrying the stride),
    squeeze-excitation (reduced to a quarter of the block's input width), 1x1 conv; residual (a
    strided 1x1 projection when the shape changes), ReLU.  Bottleneck ratio 1."""

    def __init__(self, cin: int, cout: int, stride: int, group_width: int):
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(cin, cout, 1), ConvBNAct(cout, cout, 3, stride, groups=cout // group_width),
                                  SqueezeExcite(cout, round(0.25 * cin), nn.ReLU, nn.Sigmoid),
                                  ConvBNAct(cout, cout, 1, act=None))
        self.down = None if stride == 1 and cin == cout else ConvBNAct(cin, cout, 1, stride, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return F.relu(self.body(x) + skip)


def regnety(config: str) -> Built:
    """RegNetY-400MF: stem 3x3/2 to 32, stages of [1,3,6,6] Y blocks at 48/104/208/440 channels (the
    quantised linear widths of w0=48, wa=27.89, wm=2.09, depth 16), group width 8, each stage's first
    block strided; pool, classifier (4.3 M parameters).  ci: [1,2,1,1] blocks at 16..64 channels."""
    seeded()
    full = config == "full"
    stem, depths, widths, classes = ((32, [1, 3, 6, 6], [48, 104, 208, 440], 1000) if full
                                     else (16, [1, 2, 1, 1], [16, 32, 48, 64], 10))
    layers: list[nn.Module] = [ConvBNAct(3, stem, 3, 2)]
    cin = stem
    for n, w in zip(depths, widths):
        for j in range(n):
            layers.append(_YBlock(cin, w, 2 if j == 0 else 1, 8))
            cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- SqueezeNet (Iandola, Han, Moskewicz, Ashraf, Dally, Keutzer: SqueezeNet, 2016) -----------------------

class _Fire(nn.Module):
    """A 1x1 "squeeze" convolution feeding parallel 1x1 and 3x3 "expand" convolutions, each with ReLU,
    concatenated over the channels."""

    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.e1 = nn.Conv2d(squeeze, expand, 1)
        self.e3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.e1(s)), F.relu(self.e3(s))], 1)


# (squeeze, expand) of fire2..fire9 in the paper's table 1; None: a 3x3/2 max pool
_FIRES: list[tuple[int, int] | None] = [(16, 64), (16, 64), (32, 128), None, (32, 128), (48, 192), (48, 192),
                                        (64, 256), None, (64, 256)]
_FIRES_CI: list[tuple[int, int] | None] = [(8, 16), (8, 16), None, (16, 32), None, (16, 48)]


def squeezenet(config: str) -> Built:
    """SqueezeNet v1.0 (no batch norm): conv 7x7/2 to 96, max pool, fire2-fire9 with max pools after
    fire4 and fire8, dropout, a 1x1 conv to the classes with ReLU, global average pool.  He-initialised
    (see :func:`~cuvil.models.registry.common.he_init`).  ci: stem 32, six fire modules of 8..48 channels."""
    seeded()
    full = config == "full"
    stem, fires, classes = (96, _FIRES, 1000) if full else (32, _FIRES_CI, 10)
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2)]
    cin = stem
    for f in fires:
        if f is None:
            layers.append(nn.MaxPool2d(3, 2))
        else:
            layers.append(_Fire(cin, *f))
            cin = 2 * f[1]
    layers += [nn.Dropout(0.5), nn.Conv2d(cin, classes, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return _classifier(he_init(nn.Sequential(*layers)), config)


# -- ShuffleNetV2 (Ma, Zhang, Zheng, Sun: ShuffleNet V2, 2018) --------------------------------------------

def _shuffle(x: torch.Tensor, groups: int = 2) -> torch.Tensor:
    """Channel shuffle: split the channels into ``groups``, interleave them (reshape, transpose, flatten)."""
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class _ShuffleUnit(nn.Module):
    """Figure 3(c) (stride 1): split the channels in half; the right half through 1x1, 3x3 depthwise,
    1x1; concatenate with the untouched left half; shuffle.  Figure 3(d) (stride 2): both branches
    take the whole input (left: 3x3/2 depthwise, 1x1; right: 1x1, 3x3/2 depthwise, 1x1), concatenated,
    shuffled."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        half = cout // 2
        self.stride = stride
        rin = cin if stride == 2 else half
        self.right = nn.Sequential(ConvBNAct(rin, half, 1), ConvBNAct(half, half, 3, stride, groups=half, act=None),
                                   ConvBNAct(half, half, 1))
        self.left = (nn.Sequential(ConvBNAct(cin, cin, 3, 2, groups=cin, act=None), ConvBNAct(cin, half, 1))
                     if stride == 2 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.left is None:
            a, b = x.chunk(2, 1)
            return _shuffle(torch.cat([a, self.right(b)], 1))
        return _shuffle(torch.cat([self.left(x), self.right(x)], 1))


def shufflenet_v2(config: str) -> Built:
    """ShuffleNetV2 1.0x (table 5): conv 3x3/2 to 24, max pool 3x3/2, stages of [4,8,4] units at
    116/232/464 channels (the first of each strided), 1x1 to 1024, pool, classifier.  ci: stem 16,
    [2,1,1] units at 32/64/128, conv5 256."""
    seeded()
    full = config == "full"
    stem, repeats, widths, last, classes = ((24, [4, 8, 4], [116, 232, 464], 1024, 1000) if full
                                            else (16, [2, 1, 1], [32, 64, 128], 256, 10))
    layers: list[nn.Module] = [ConvBNAct(3, stem, 3, 2), nn.MaxPool2d(3, 2, 1)]
    cin = stem
    for n, w in zip(repeats, widths):
        for j in range(n):
            layers.append(_ShuffleUnit(cin, w, 2 if j == 0 else 1))
            cin = w
    layers += [ConvBNAct(cin, last, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(last, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- Inception (Szegedy et al.: Going Deeper with Convolutions, 2014; the 1 x n / n x 1 factorisation of
#    Szegedy et al.: Rethinking the Inception Architecture for Computer Vision, 2016, figure 6) -----------

class _Conv(nn.Sequential):
    """A conv with a rectangular kernel ('same' padding), BatchNorm and ReLU."""

    def __init__(self, cin: int, cout: int, k: tuple[int, int]):
        super().__init__(nn.Conv2d(cin, cout, k, padding=(k[0] // 2, k[1] // 2), bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class _Inception(nn.Module):
    """Four branches concatenated: 1x1; 1x1 reduce then 3x3; 1x1 reduce then 5x5 (``asymmetric``: then
    1x7 and 7x1 instead); 3x3/1 max pool then a 1x1 projection.  Every conv with BatchNorm and ReLU."""

    def __init__(self, cin: int, c1: int, r3: int, c3: int, r5: int, c5: int, pool: int, asymmetric: bool):
        super().__init__()
        self.b1 = ConvBNAct(cin, c1, 1)
        self.b3 = nn.Sequential(ConvBNAct(cin, r3, 1), ConvBNAct(r3, c3, 3))
        if asymmetric:
            self.b5 = nn.Sequential(ConvBNAct(cin, r5, 1), _Conv(r5, c5, (1, 7)), _Conv(c5, c5, (7, 1)))
        else:
            self.b5 = nn.Sequential(ConvBNAct(cin, r5, 1), ConvBNAct(r5, c5, 5))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), ConvBNAct(cin, pool, 1))
        self.cout = c1 + c3 + c5 + pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


# (#1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj) of table 1; "M": a 3x3/2 max pool (ceil mode);
# the 14x14 stage (4a-4e) factorises its 5x5 branch
_GOOGLENET: list[tuple[int, ...] | str] = [
    (64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "M",
    (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
    (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "M",
    (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128)]
_GOOGLENET_CI: list[tuple[int, ...] | str] = [(16, 16, 24, 8, 8, 8), "M", (24, 16, 32, 8, 16, 8), "M",
                                              (32, 24, 48, 8, 16, 16)]


def inception(config: str) -> Built:
    """GoogLeNet with BatchNorm: conv 7x7/2 to 64, max pool, 1x1 64, 3x3 192, max pool, inception
    3a-3b, max pool, 4a-4e (5x5 branch as 1x7 + 7x1), max pool, 5a-5b, pool, dropout, classifier (no
    auxiliary heads: they are dropped at inference).  ci: stem 16 / 32, one module per stage."""
    seeded()
    full = config == "full"
    (s1, s2, s3), modules, classes = ((64, 64, 192), _GOOGLENET, 1000) if full else ((16, 16, 32), _GOOGLENET_CI, 10)
    layers: list[nn.Module] = [ConvBNAct(3, s1, 7, 2), nn.MaxPool2d(3, 2, ceil_mode=True), ConvBNAct(s1, s2, 1),
                               ConvBNAct(s2, s3, 3), nn.MaxPool2d(3, 2, ceil_mode=True)]
    cin, stage = s3, 3
    for m in modules:
        if m == "M":
            layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            stage += 1
            continue
        block = _Inception(cin, *m, asymmetric=stage == 4)
        layers.append(block)
        cin = block.cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.4), nn.Linear(cin, classes)]
    return _classifier(nn.Sequential(*layers), config)


# -- R3D (Tran, Wang, Torresani, Ray, LeCun, Paluri: A Closer Look at Spatiotemporal Convolutions for
#    Action Recognition, 2018): a ResNet of full 3x3x3 convolutions over video clips ------------------------

class _Basic3d(nn.Module):
    """Two 3x3x3 convolutions with BatchNorm3d (ReLU between), residual (a strided 1x1x1 projection when
    the shape changes), ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(),
                                  nn.Conv3d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm3d(cout))
        self.down = (None if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv3d(cin, cout, 1, stride, bias=False), nn.BatchNorm3d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


def r3d(config: str) -> Built:
    """R3D-18: a 3x7x7 stem (stride 1x2x2) to 64, stages of [2,2,2,2] 3-D basic blocks at 64..512 channels
    (stages 2-4 strided in time and space), global pool, 400 classes (Kinetics), a clip of 8 frames of
    112x112 (1x3x8x112x112, the paper's clips for comparing architectures; 41 GFLOP).  ci: one block per
    stage at 8..64 channels, 1x3x4x32x32."""
    seeded()
    full = config == "full"
    stem, widths, depths, classes, (t, s) = ((64, [64, 128, 256, 512], [2, 2, 2, 2], 400, (8, 112)) if full
                                             else (8, [8, 16, 32, 64], [1, 1, 1, 1], 10, (4, 32)))
    layers: list[nn.Module] = [nn.Conv3d(3, stem, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(stem),
                               nn.ReLU()]
    cin = stem
    for i, (n, w) in enumerate(zip(depths, widths)):
        for j in range(n):
            layers.append(_Basic3d(cin, w, 2 if j == 0 and i > 0 else 1))
            cin = w
    layers += [nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(cin, classes)]

    def clip(batch: int, seed: int) -> torch.Tensor:
        return torch.randn(batch, 3, t, s, s, generator=torch.Generator().manual_seed(seed))

    return finish(nn.Sequential(*layers), clip(2, 99)), {"clip": clip(1, 2)}, ["logits"]


# -- HRNet (Wang et al.: Deep High-Resolution Representation Learning for Visual Recognition, 2019) ---------

class _HRBasic(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(c, c, 3), ConvBNAct(c, c, 3, act=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


class _HRModule(nn.Module):
    """Parallel branches of basic blocks, one per resolution, then the exchange: each output branch
    sums every input branch brought to its resolution (lower: a 1x1 conv + BN and nearest upsampling;
    higher: a chain of 3x3/2 conv + BN, ReLU between), then ReLU."""

    def __init__(self, widths: list[int], blocks: int):
        super().__init__()
        self.branches = nn.ModuleList([nn.Sequential(*[_HRBasic(c) for _ in range(blocks)]) for c in widths])
        self.fuse = nn.ModuleList([nn.ModuleList([self._bridge(widths, j, i) for j in range(len(widths))])
                                   for i in range(len(widths))])

    @staticmethod
    def _bridge(widths: list[int], src: int, dst: int) -> nn.Module:
        if src == dst:
            return nn.Identity()
        if src > dst:
            return nn.Sequential(ConvBNAct(widths[src], widths[dst], 1, act=None),
                                 nn.Upsample(scale_factor=2 ** (src - dst), mode="nearest"))
        steps = [ConvBNAct(widths[src], widths[src], 3, 2) for _ in range(dst - src - 1)]
        return nn.Sequential(*steps, ConvBNAct(widths[src], widths[dst], 3, 2, act=None))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        xs = [branch(x) for branch, x in zip(self.branches, xs)]
        return [F.relu(sum(bridge(x) for bridge, x in zip(row, xs))) for row in self.fuse]


class _HRBottleneck(nn.Module):
    def __init__(self, cin: int, width: int):
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(cin, width, 1), ConvBNAct(width, width, 3),
                                  ConvBNAct(width, 4 * width, 1, act=None))
        self.down = None if cin == 4 * width else ConvBNAct(cin, 4 * width, 1, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.down is None else self.down(x)))


class HRNet(nn.Module):
    """HRNetV2 for segmentation: stem (two 3x3/2 convs), stage 1 (bottlenecks at stride 4), then stages
    of ``modules[i]`` HR modules over 2, 3, 4 branches (each new branch a 3x3/2 conv from the lowest);
    the head upsamples every branch bilinearly to stride 4, concatenates them, 1x1 conv + BN + ReLU, 1x1
    conv to the classes, and upsamples bilinearly to the input size."""

    def __init__(self, widths: list[int], stage1: tuple[int, int], modules: list[int], blocks: int, classes: int):
        super().__init__()
        c1, n1 = stage1
        self.stem = nn.Sequential(ConvBNAct(3, 64, 3, 2), ConvBNAct(64, 64, 3, 2))
        self.stage1 = nn.Sequential(*[_HRBottleneck(64 if j == 0 else 4 * c1, c1) for j in range(n1)])
        self.transitions = nn.ModuleList([ConvBNAct(4 * c1, widths[0], 3), ConvBNAct(4 * c1, widths[1], 3, 2)])
        # stage s (0-based) runs over s + 2 branches; from the second on, it opens a branch from the lowest
        self.branch = nn.ModuleList([ConvBNAct(widths[s], widths[s + 1], 3, 2) for s in range(1, len(modules))])
        self.stages = nn.ModuleList([nn.Sequential(*[_HRModule(widths[:s + 2], blocks) for _ in range(n)])
                                     for s, n in enumerate(modules)])
        total = sum(widths)
        self.head = nn.Sequential(ConvBNAct(total, total, 1), nn.Conv2d(total, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stage1(self.stem(x))
        xs = [t(y) for t in self.transitions]
        for s, stage in enumerate(self.stages):
            if s > 0:
                xs.append(self.branch[s - 1](xs[-1]))
            xs = stage(xs)
        size = xs[0].shape[2:]
        ups = [xs[0]] + [F.interpolate(t, size=size, mode="bilinear", align_corners=False) for t in xs[1:]]
        y = self.head(torch.cat(ups, 1))
        return F.interpolate(y, size=x.shape[2:], mode="bilinear", align_corners=False)


def hrnet(config: str) -> Built:
    """HRNetV2-W18-Small-v2 for segmentation: widths 18/36/72/144, stage 1 of 2 bottlenecks (64), then
    1, 3, 2 HR modules of 2 basic blocks per branch over 2, 3, 4 branches, 19 classes (Cityscapes),
    1x3x512x512.  ci: widths 8/16/32/64, stage 1 of one bottleneck (16), 1, 1, 1 modules of one block,
    5 classes, 1x3x64x64."""
    seeded()
    if config == "full":
        model, size = HRNet([18, 36, 72, 144], (64, 2), [1, 3, 2], 2, 19), 512
    else:
        model, size = HRNet([8, 16, 32, 64], (16, 1), [1, 1, 1], 1, 5), 64
    model = finish(model, image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["logits"]
