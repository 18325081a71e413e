"""Dense prediction networks written in torch.nn: a UNet and a YOLOv8n-style detector.

``"full"``: UNet with 4 levels from 32 channels at 1x3x256x256; the detector at the n scale
(width 0.25, depth 0.33) at 1x3x320x320 with 80 classes.  ``"ci"``: the same blocks with fewer
levels / channels at 32x32 and 64x64.
"""

from __future__ import annotations

import torch
from torch import nn

from cuvil.models.registry.common import ConvBNAct, finish, image, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


# -- UNet (Ronneberger, Fischer, Brox: U-Net: Convolutional Networks for Biomedical Image Segmentation, 2015)

def _double(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions, each with BatchNorm and ReLU ('same' padding, as most reimplementations)."""
    return nn.Sequential(ConvBNAct(cin, cout, 3), ConvBNAct(cout, cout, 3))


class UNet(nn.Module):
    """Contracting path of ``levels`` double convs with 2x2 max pools (channels doubling from ``base``),
    a bottleneck, and an expanding path: 2x2 stride-2 ConvTranspose2d halving the channels,
    concatenation with the skip of the same level, double conv; a 1x1 conv to the classes."""

    def __init__(self, base: int, levels: int, classes: int):
        super().__init__()
        widths = [base * 2 ** i for i in range(levels + 1)]
        self.down = nn.ModuleList([_double(3 if i == 0 else widths[i - 1], widths[i]) for i in range(levels)])
        self.pool = nn.MaxPool2d(2)
        self.bottom = _double(widths[levels - 1], widths[levels])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2) for i in reversed(range(levels))])
        self.merge = nn.ModuleList([_double(2 * widths[i], widths[i]) for i in reversed(range(levels))])
        self.head = nn.Conv2d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips)):
            x = merge(torch.cat([skip, up(x)], 1))
        return self.head(x)


def unet(config: str) -> Built:
    """UNet: 4 levels at 32/64/128/256 channels, bottleneck 512, 2 classes, 1x3x256x256.  ci: 2 levels
    from 8 channels, 1x3x32x32."""
    seeded()
    base, levels, size = (32, 4, 256) if config == "full" else (8, 2, 32)
    model = finish(UNet(base, levels, 2), image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["mask"]


# -- YOLOv8-style detector (the C2f / SPPF / decoupled-head design of Ultralytics' YOLOv8, 2023) ---------

def _conv(cin: int, cout: int, k: int = 1, stride: int = 1) -> ConvBNAct:
    return ConvBNAct(cin, cout, k, stride, act=nn.SiLU)


class _Bottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool):
        super().__init__()
        self.body = nn.Sequential(_conv(c, c, 3), _conv(c, c, 3))
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.shortcut else self.body(x)


class C2f(nn.Module):
    """1x1 conv to 2c channels, split in two halves; n bottlenecks chained on the second half, each
    output kept; all 2 + n pieces concatenated and mixed by a 1x1 conv."""

    def __init__(self, cin: int, cout: int, n: int, shortcut: bool):
        super().__init__()
        self.c = cout // 2
        self.cv1 = _conv(cin, 2 * self.c)
        self.blocks = nn.ModuleList([_Bottleneck(self.c, shortcut) for _ in range(n)])
        self.cv2 = _conv((2 + n) * self.c, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.cv1(x).split((self.c, self.c), 1))
        for block in self.blocks:
            parts.append(block(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: 1x1 conv to half, three chained 5x5 stride-1 max pools,
    concatenation of the four, 1x1 conv."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.cv1 = _conv(cin, cin // 2)
        self.pool = nn.MaxPool2d(5, 1, 2)
        self.cv2 = _conv(cin // 2 * 4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y0 = self.cv1(x)
        y1 = self.pool(y0)
        y2 = self.pool(y1)
        return self.cv2(torch.cat([y0, y1, y2, self.pool(y2)], 1))


class _Head(nn.Module):
    """Decoupled detection head over three levels: per level a box branch (two 3x3 convs, 1x1 to 4 x
    ``bins`` distance logits) and a class branch (two 3x3 convs, 1x1 to the classes).  Decoding: a
    softmax over the bins gives each side's expected distance (distribution focal loss), boxes are
    anchor point -/+ distances as centre-size, times the level's stride; classes through a sigmoid.
    Output: batch x (4 + classes) x anchors."""

    def __init__(self, channels: list[int], classes: int, strides: list[int], bins: int = 16):
        super().__init__()
        box_c, cls_c = max(16, channels[0] // 4, 4 * bins), max(channels[0], min(classes, 100))
        self.box = nn.ModuleList([nn.Sequential(_conv(c, box_c, 3), _conv(box_c, box_c, 3),
                                                nn.Conv2d(box_c, 4 * bins, 1)) for c in channels])
        self.cls = nn.ModuleList([nn.Sequential(_conv(c, cls_c, 3), _conv(cls_c, cls_c, 3),
                                                nn.Conv2d(cls_c, classes, 1)) for c in channels])
        self.bins, self.strides = bins, strides
        self.register_buffer("proj", torch.arange(bins, dtype=torch.float32), persistent=False)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        b = feats[0].shape[0]
        boxes, scores, points, scales = [], [], [], []
        for f, box, cls, stride in zip(feats, self.box, self.cls, self.strides):
            h, w = f.shape[2], f.shape[3]
            boxes.append(box(f).flatten(2))
            scores.append(cls(f).flatten(2))
            ys = torch.arange(h, dtype=torch.float32) + 0.5
            xs = torch.arange(w, dtype=torch.float32) + 0.5
            grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
            points.append(torch.stack([grid_x.flatten(), grid_y.flatten()], 0))
            scales.append(torch.full((1, h * w), float(stride)))
        box_logits = torch.cat(boxes, 2).view(b, 4, self.bins, -1)
        dist = (box_logits.softmax(2) * self.proj.view(1, 1, -1, 1)).sum(2)  # b x 4 x anchors
        anchor, scale = torch.cat(points, 1), torch.cat(scales, 1)
        lt, rb = dist[:, :2], dist[:, 2:]
        xy = (anchor + (rb - lt) / 2) * scale
        wh = (lt + rb) * scale
        return torch.cat([xy, wh, torch.cat(scores, 2).sigmoid()], 1)


class YOLOv8(nn.Module):
    """Backbone (strided convs and C2f blocks down to stride 32, SPPF), a PAN neck (top-down: nearest
    upsample, concat with the backbone level, C2f; bottom-up: strided conv, concat, C2f) and the head
    on the last ``levels`` pyramid levels (3: strides 8, 16, 32)."""

    def __init__(self, width: float, depth: float, classes: int, levels: int = 3):
        super().__init__()

        def ch(c: int) -> int:
            return max(8, int(c * width))

        def n(k: int) -> int:
            return max(1, round(k * depth))

        c1, c2, c3, c4, c5 = ch(64), ch(128), ch(256), ch(512), ch(1024)
        self.stem = nn.Sequential(_conv(3, c1, 3, 2), _conv(c1, c2, 3, 2), C2f(c2, c2, n(3), True))
        self.p3 = nn.Sequential(_conv(c2, c3, 3, 2), C2f(c3, c3, n(6), True))
        self.p4 = nn.Sequential(_conv(c3, c4, 3, 2), C2f(c4, c4, n(6), True))
        self.p5 = nn.Sequential(_conv(c4, c5, 3, 2), C2f(c5, c5, n(3), True), SPPF(c5, c5))
        self.levels = levels
        chans = [c3, c4, c5][-levels:]
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_down = nn.ModuleList([C2f(chans[i + 1] + chans[i], chans[i], n(3), False) for i in range(levels - 1)])
        self.down = nn.ModuleList([_conv(chans[i], chans[i], 3, 2) for i in range(levels - 1)])
        self.bottom_up = nn.ModuleList([C2f(chans[i] + chans[i + 1], chans[i + 1], n(3), False)
                                        for i in range(levels - 1)])
        self.head = _Head(chans, classes, [8, 16, 32][-levels:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        feats = [p3, p4, self.p5(p4)][-self.levels:]
        for i in reversed(range(self.levels - 1)):  # top-down: P5 -> P4 -> P3
            feats[i] = self.top_down[i](torch.cat([self.up(feats[i + 1]), feats[i]], 1))
        for i in range(self.levels - 1):  # bottom-up: P3 -> P4 -> P5
            feats[i + 1] = self.bottom_up[i](torch.cat([self.down[i](feats[i]), feats[i + 1]], 1))
        return self.head(feats)


def yolov8n(config: str) -> Built:
    """The n scale (width 0.25, depth 0.33: channels 16..256, one or two bottlenecks per C2f; 3.16 M
    parameters, as published), 80 classes, 1x3x320x320 (2100 anchors).  ci: width 0.125, one bottleneck
    per C2f, the neck and head on 2 levels (strides 16, 32), 8 classes, 1x3x64x64."""
    seeded()
    width, depth, classes, levels, size = (0.25, 1 / 3, 80, 3, 320) if config == "full" else (0.125, 0.2, 8, 2, 64)
    model = finish(YOLOv8(width, depth, classes, levels), image(3, size, batch=2, seed=99))
    return model, {"images": image(3, size)}, ["detections"]
