"""Segmentation networks written in torch.nn from their papers: a SegFormer-B0 (hierarchical vision
transformer with spatial-reduction attention and an all-MLP decoder), DeepLabv3's atrous spatial
pyramid on a dilated ResNet-18, and a feature pyramid (FPN) with Panoptic FPN's semantic branch.

``"full"``: SegFormer-B0 with 150 classes (ADE20K) at 1x3x512x512; DeepLabv3 with 21 classes (VOC)
at its 513x513 crop; the FPN at the published widths at 1x3x384x384.  ``"ci"``: the same blocks, one
per stage, narrower, at 64x64 (DeepLabv3: 129x129).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuvil.models.registry.common import ConvBNAct, finish, image, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


# -- SegFormer (Xie, Wang, Yu, Anandkumar, Alvarez, Luo: SegFormer: Simple and Efficient Design for
#    Semantic Segmentation with Transformers, 2021) -------------------------------------------------------

class _PatchEmbed(nn.Module):
    """Overlapping patch embedding: a k x k conv with stride s and padding k // 2, flattened to tokens,
    LayerNorm."""

    def __init__(self, cin: int, dim: int, k: int, stride: int):
        super().__init__()
        self.proj = nn.Conv2d(cin, dim, k, stride, k // 2)
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(x)
        h, w = x.shape[2], x.shape[3]
        return self.norm(x.flatten(2).transpose(1, 2)), h, w


def _grid(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Tokens ``b x (h w) x c`` back to an image ``b x c x h x w``."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], h, w)


class _ReducedAttention(nn.Module):
    """Efficient self-attention: queries from every token; keys and values from the tokens reduced by
    an ``sr`` x ``sr`` conv of stride ``sr`` (then LayerNorm), so the sequence the queries attend over
    is ``sr ** 2`` times shorter.  Written as matmul, scale, softmax, matmul."""

    def __init__(self, dim: int, heads: int, sr: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.sr = nn.Conv2d(dim, dim, sr, sr) if sr > 1 else None
        self.norm = nn.LayerNorm(dim, eps=1e-6) if sr > 1 else None

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
        src = x if self.sr is None else self.norm(self.sr(_grid(x, h, w)).flatten(2).transpose(1, 2))
        k, v = self.kv(src).reshape(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class _MixFFN(nn.Module):
    """Linear up 4x, a 3x3 depthwise conv over the token grid (the positional information), GELU,
    Linear down."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.dw = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        y = self.dw(_grid(self.fc1(x), h, w)).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(y))


class _MiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, sr: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = _ReducedAttention(dim, heads, sr)
        self.ffn = _MixFFN(dim, 4 * dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), h, w)
        return x + self.ffn(self.norm2(x), h, w)


class SegFormer(nn.Module):
    """Mix Transformer encoder (4 stages: overlapping patch embedding with 7x7/4 then 3x3/2 convs,
    blocks, LayerNorm) and the all-MLP decoder: each stage's features through a Linear to ``dec``
    channels, bilinearly upsampled (align_corners=False) to the first stage's 1/4 resolution,
    concatenated, fused by a 1x1 conv + BatchNorm + ReLU, a 1x1 conv to the classes."""

    def __init__(self, dims: list[int], depths: list[int], heads: list[int], srs: list[int], dec: int, classes: int):
        super().__init__()
        ins = [3] + dims[:-1]
        self.embeds = nn.ModuleList([_PatchEmbed(c, d, 7 if i == 0 else 3, 4 if i == 0 else 2)
                                     for i, (c, d) in enumerate(zip(ins, dims))])
        self.stages = nn.ModuleList([nn.ModuleList([_MiTBlock(d, hd, sr) for _ in range(n)])
                                     for d, n, hd, sr in zip(dims, depths, heads, srs)])
        self.norms = nn.ModuleList([nn.LayerNorm(d, eps=1e-6) for d in dims])
        self.linears = nn.ModuleList([nn.Linear(d, dec) for d in dims])
        self.fuse = ConvBNAct(4 * dec, dec, 1)
        self.classify = nn.Sequential(nn.Dropout(0.1), nn.Conv2d(dec, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for embed, blocks, norm, linear in zip(self.embeds, self.stages, self.norms, self.linears):
            t, h, w = embed(x)
            for block in blocks:
                t = block(t, h, w)
            t = norm(t)
            x = _grid(t, h, w)
            outs.append(_grid(linear(t), h, w))
        size = outs[0].shape[2:]
        ups = [outs[0]] + [F.interpolate(o, size=size, mode="bilinear", align_corners=False) for o in outs[1:]]
        return self.classify(self.fuse(torch.cat(ups[::-1], 1)))


def segformer_b0(config: str) -> Built:
    """SegFormer-B0 (MiT-B0: dims 32/64/160/256, 2 blocks per stage, heads 1/2/5/8, reduction ratios
    8/4/2/1; decoder 256 channels), 150 classes, 1x3x512x512 -> 1x150x128x128.  ci: dims 16/32/48/64,
    one block per stage, heads 1/2/2/4, decoder 32, 10 classes, 1x3x64x64."""
    seeded()
    if config == "full":
        model, size = SegFormer([32, 64, 160, 256], [2, 2, 2, 2], [1, 2, 5, 8], [8, 4, 2, 1], 256, 150), 512
    else:
        model, size = SegFormer([16, 32, 48, 64], [1, 1, 1, 1], [1, 2, 2, 4], [8, 4, 2, 1], 32, 10), 64
    model = finish(model, image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["logits"]


# -- DeepLabv3 (Chen, Papandreou, Schroff, Adam: Rethinking Atrous Convolution for Semantic Image
#    Segmentation, 2017) -----------------------------------------------------------------------------------

class _Basic(nn.Module):
    """ResNet's basic block with a dilation for its 3x3 convolutions."""

    def __init__(self, cin: int, cout: int, stride: int, dilation: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, dilation, dilation, bias=False),
                                   nn.BatchNorm2d(cout), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, dilation, dilation, bias=False), nn.BatchNorm2d(cout))
        self.down = None if stride == 1 and cin == cout else ConvBNAct(cin, cout, 1, stride, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return F.relu(self.conv2(self.conv1(x)) + skip)


class _ASPP(nn.Module):
    """Atrous spatial pyramid pooling: a 1x1 conv, three 3x3 convs at dilations ``rates``, and image
    pooling (global average, 1x1 conv, bilinear upsampling back to the grid), each with BatchNorm and
    ReLU; concatenated, projected by a 1x1 conv + BatchNorm + ReLU."""

    def __init__(self, cin: int, cout: int, rates: tuple[int, ...]):
        super().__init__()
        self.branches = nn.ModuleList(
            [ConvBNAct(cin, cout, 1)]
            + [nn.Sequential(nn.Conv2d(cin, cout, 3, padding=r, dilation=r, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU()) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), ConvBNAct(cin, cout, 1))
        self.project = ConvBNAct((len(rates) + 2) * cout, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.interpolate(self.pool(x), size=x.shape[2:], mode="bilinear", align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], 1))


class DeepLabV3(nn.Module):
    """A ResNet-18 at output stride 16 (its last stage not strided but dilated by 2), the ASPP at
    rates 6/12/18, a 1x1 conv to the classes, bilinear upsampling to the input size
    (align_corners=False)."""

    def __init__(self, widths: list[int], depths: list[int], aspp: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, widths[0], 7, 2), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(depths, widths)):
            for j in range(n):
                stride = 2 if j == 0 and i in (1, 2) else 1
                layers.append(_Basic(cin, w, stride, 2 if i == 3 else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.aspp = _ASPP(cin, aspp, (6, 12, 18))
        self.classify = nn.Conv2d(aspp, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.classify(self.aspp(self.layers(self.stem(x))))
        return F.interpolate(y, size=x.shape[2:], mode="bilinear", align_corners=False)


def deeplab_aspp(config: str) -> Built:
    """DeepLabv3, ResNet-18 backbone (blocks [2,2,2,2], widths 64..512) at output stride 16, ASPP of
    256 channels, 21 classes, 1x3x513x513 (a 33x33 grid).  ci: blocks [1,1,1,1], widths 8..64, ASPP
    32, 5 classes, 1x3x129x129 (a 9x9 grid)."""
    seeded()
    if config == "full":
        model, size = DeepLabV3([64, 128, 256, 512], [2, 2, 2, 2], 256, 21), 513
    else:
        model, size = DeepLabV3([8, 16, 32, 64], [1, 1, 1, 1], 32, 5), 129
    model = finish(model, image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["logits"]


# -- FPN (Lin, Dollar, Girshick, He, Hariharan, Belongie: Feature Pyramid Networks for Object Detection,
#    2017) with the semantic segmentation branch of Panoptic FPN (Kirillov, Girshick, He, Dollar, 2019) ----

class _Backbone(nn.Module):
    """ResNet-18 (basic blocks, widths ``widths``), returning the outputs of its four stages (strides 4,
    8, 16, 32: C2..C5)."""

    def __init__(self, widths: list[int], depths: list[int]):
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, widths[0], 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(depths, widths)):
            stages.append(nn.Sequential(*[_Basic(cin if j == 0 else w, w, 2 if j == 0 and i > 0 else 1, 1)
                                          for j in range(n)]))
            cin = w
        self.stages = nn.ModuleList(stages)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x, outs = self.stem(x), []
        for stage in self.stages:
            x = stage(x)
            outs.append(x)
        return outs


class _Upsampler(nn.Sequential):
    """One step of the semantic branch: 3x3 conv, GroupNorm (32 groups), ReLU, and (``up``) a 2x
    bilinear upsampling with align_corners=True."""

    def __init__(self, cin: int, cout: int, up: bool):
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(32, cout), nn.ReLU()]
        if up:
            layers.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True))
        super().__init__(*layers)


class FPNSegmenter(nn.Module):
    """A ResNet-18, the feature pyramid (1x1 laterals; top-down 2x nearest upsampling added to each;
    3x3 output convs: P2..P5) and the semantic branch: each level brought to 1/4 scale by
    conv-GroupNorm-ReLU-upsample steps (P5: three, P2: one conv and no upsampling), summed, 1x1 to the
    classes, 4x bilinear upsampling (align_corners=True) to the input size."""

    def __init__(self, widths: list[int], depths: list[int], dim: int, head: int, classes: int):
        super().__init__()
        self.backbone = _Backbone(widths, depths)
        self.lateral = nn.ModuleList([nn.Conv2d(w, dim, 1) for w in widths])
        self.output = nn.ModuleList([nn.Conv2d(dim, dim, 3, padding=1) for _ in widths])
        self.semantic = nn.ModuleList([nn.Sequential(*[_Upsampler(dim if j == 0 else head, head, k > 0)
                                                       for j in range(max(1, k))]) for k in range(len(widths))])
        self.classify = nn.Conv2d(head, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [lat(c) for lat, c in zip(self.lateral, self.backbone(x))]
        for i in reversed(range(len(feats) - 1)):  # top-down: P5 -> P2
            feats[i] = feats[i] + F.interpolate(feats[i + 1], scale_factor=2.0, mode="nearest")
        pyramid = [out(p) for out, p in zip(self.output, feats)]
        y = sum(branch(p) for branch, p in zip(self.semantic, pyramid))
        return F.interpolate(self.classify(y), scale_factor=4.0, mode="bilinear", align_corners=True)


def fpn_semantic(config: str) -> Built:
    """Panoptic FPN's semantic branch: ResNet-18 backbone, a 256-channel pyramid P2..P5, a 128-channel
    branch, 54 classes (COCO stuff + 1), 1x3x384x384.  ci: widths 8..64, one block per stage, a
    32-channel pyramid, a 64-channel branch, 5 classes, 1x3x64x64."""
    seeded()
    if config == "full":
        model, size = FPNSegmenter([64, 128, 256, 512], [2, 2, 2, 2], 256, 128, 54), 384
    else:
        model, size = FPNSegmenter([8, 16, 32, 64], [1, 1, 1, 1], 32, 64, 5), 64
    model = finish(model, image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["logits"]


# -- DETR (Carion, Massa, Synnaeve, Usunier, Kirillov, Zagoruyko: End-to-End Object Detection with
#    Transformers, 2020) ----------------------------------------------------------------------------------------

class _MHA(nn.Module):
    """Multi-head attention with separate query, key and value inputs (scaled dot products, softmax)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, d = q.shape
        h = self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, -1, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(q)), split(self.k(k)), split(self.v(v)))
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class _DetrLayer(nn.Module):
    """A post-norm transformer layer: self-attention (positions added to queries and keys), for the
    decoder a cross-attention to the encoder's memory, and a ReLU FFN; each residual, then LayerNorm."""

    def __init__(self, dim: int, heads: int, ffn: int, cross: bool):
        super().__init__()
        self.self_attn = _MHA(dim, heads)
        self.cross_attn = _MHA(dim, heads) if cross else None
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(), nn.Linear(ffn, dim))
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(3 if cross else 2)])

    def forward(self, x: torch.Tensor, pos: torch.Tensor, memory: torch.Tensor | None = None,
                memory_pos: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norms[0](x + self.self_attn(x + pos, x + pos, x))
        if self.cross_attn is not None:
            x = self.norms[1](x + self.cross_attn(x + pos, memory + memory_pos, memory))
        return self.norms[-1](x + self.ffn(x))


def _sine_positions(h: int, w: int, dim: int) -> torch.Tensor:
    """DETR's 2-D sine positional encoding of an ``h x w`` grid (normalised coordinates, temperature
    10000, half the channels for y, half for x): ``(h w) x dim``."""
    half = dim // 2
    freq = 10000 ** (2 * (torch.arange(half) // 2) / half)
    ys = (torch.arange(1, h + 1, dtype=torch.float32) / h * 2 * torch.pi)[:, None] / freq
    xs = (torch.arange(1, w + 1, dtype=torch.float32) / w * 2 * torch.pi)[:, None] / freq
    ys = torch.stack([ys[:, 0::2].sin(), ys[:, 1::2].cos()], 2).flatten(1)
    xs = torch.stack([xs[:, 0::2].sin(), xs[:, 1::2].cos()], 2).flatten(1)
    return torch.cat([ys[:, None].expand(h, w, half), xs[None].expand(h, w, half)], 2).reshape(h * w, dim)


class DETR(nn.Module):
    """A ResNet backbone's last stage (stride 32), a 1x1 projection to ``dim``, the sine positions, a
    transformer encoder over the grid, a decoder of ``queries`` learned object queries attending to
    it, a final LayerNorm; per query class logits (plus "no object") and a 3-layer MLP to a sigmoid
    box (centre, size)."""

    def __init__(self, widths: list[int], depths: list[int], size: int, dim: int, heads: int, layers: int,
                 queries: int, classes: int):
        super().__init__()
        self.backbone = _Backbone(widths, depths)
        self.proj = nn.Conv2d(widths[-1], dim, 1)
        self.register_buffer("pos", _sine_positions(size // 32, size // 32, dim)[None], persistent=False)
        self.encoder = nn.ModuleList([_DetrLayer(dim, heads, 8 * dim, False) for _ in range(layers)])
        self.decoder = nn.ModuleList([_DetrLayer(dim, heads, 8 * dim, True) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.queries = nn.Parameter(torch.randn(1, queries, dim))
        self.classify = nn.Linear(dim, classes + 1)
        self.box = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self.proj(self.backbone(x)[-1]).flatten(2).transpose(1, 2)
        for layer in self.encoder:
            memory = layer(memory, self.pos)
        query_pos = self.queries.expand(x.shape[0], -1, -1)
        tgt = torch.zeros_like(query_pos)
        for layer in self.decoder:
            tgt = layer(tgt, query_pos, memory, self.pos)
        tgt = self.norm(tgt)
        return self.classify(tgt), self.box(tgt).sigmoid()


def detr(config: str) -> Built:
    """DETR with a ResNet-18 backbone (the paper's is a ResNet-50), dim 256, 8 heads, FFN 2048, 6 encoder
    and 6 decoder layers, 100 queries, 91 classes (COCO), 1x3x512x512 (a 16x16 grid).  ci: widths
    8..64, one block per stage, dim 32, 2 heads, 1 + 1 layers, 10 queries, 5 classes, 1x3x128x128."""
    seeded()
    if config == "full":
        model, size = DETR([64, 128, 256, 512], [2, 2, 2, 2], 512, 256, 8, 6, 100, 91), 512
    else:
        model, size = DETR([8, 16, 32, 64], [1, 1, 1, 1], 128, 32, 2, 1, 10, 5), 128
    model = finish(model, image(3, size, batch=2, seed=99))
    return model, {"input": image(3, size)}, ["class_logits", "boxes"]


# -- ESPCN (Shi et al.: Real-Time Single Image and Video Super-Resolution Using an Efficient Sub-Pixel
#    Convolutional Neural Network, 2016), with a bicubic global skip ------------------------------------------

class ESPCN(nn.Module):
    """5x5 conv to 64, 3x3 to 32 (tanh after each), 3x3 to ``3 r^2`` channels rearranged to an ``r``
    times larger image by ``nn.PixelShuffle`` (sub-pixel convolution), added to the bicubic upsampling
    of the input (align_corners=True): the network learns the residual."""

    def __init__(self, scale: int, c1: int, c2: int):
        super().__init__()
        self.scale = scale
        self.body = nn.Sequential(nn.Conv2d(3, c1, 5, padding=2), nn.Tanh(), nn.Conv2d(c1, c2, 3, padding=1),
                                  nn.Tanh(), nn.Conv2d(c2, 3 * scale ** 2, 3, padding=1), nn.PixelShuffle(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = F.interpolate(x, scale_factor=float(self.scale), mode="bicubic", align_corners=True)
        return skip + self.body(x)


def espcn(config: str) -> Built:
    """ESPCN x4 (64 / 32 channels, as published) on a 1x3x128x128 tile -> 1x3x512x512.  ci: 16 / 8
    channels, x2, 1x3x32x32."""
    seeded()
    model, size = (ESPCN(4, 64, 32), 128) if config == "full" else (ESPCN(2, 16, 8), 32)
    return model.eval(), {"input": image(3, size)}, ["upscaled"]
