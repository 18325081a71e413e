"""Vision models that mix convolutions with attention over unfolded patches, or drop both for MLPs,
written in torch.nn from their papers: MobileViT-XXS (a mobile convolution / transformer hybrid whose
attention runs over pixels unfolded from 2x2 patches and folded back) and MLP-Mixer S/16 (all-MLP).

``"full"``: the published networks with 1000 classes, MobileViT-XXS at 1x3x256x256 and Mixer-S/16
at 1x3x224x224.  ``"ci"``: the same blocks, fewer and narrower, at 64x64.
"""

from __future__ import annotations

import torch
from torch import nn

from cuvil.models.registry.common import ConvBNAct, finish, image, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


# -- MobileViT (Mehta, Rastegari: MobileViT: Light-weight, General-purpose, and Mobile-friendly Vision
#    Transformer, 2021) --------------------------------------------------------------------------------------

class _MV2(nn.Module):
    """MobileNetV2's inverted residual with SiLU: 1x1 expand, 3x3 depthwise (carrying the stride), 1x1
    linear projection; residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.body = nn.Sequential(ConvBNAct(cin, hidden, 1, act=nn.SiLU),
                                  ConvBNAct(hidden, hidden, 3, stride, groups=hidden, act=nn.SiLU),
                                  ConvBNAct(hidden, cout, 1, act=None))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class _Attention(nn.Module):
    """Multi-head self-attention: one qkv Linear, softmax(q k^T / sqrt(head dim)) v, an output Linear.
    (Not ``nn.MultiheadAttention``: in eval under no_grad it takes a fused fast path that the TorchScript
    exporter refuses, ``aten::_native_multi_head_attention``.)"""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, d))


class _Transformer(nn.Module):
    """Pre-norm encoder layer: multi-head self-attention, an MLP with SiLU."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _MobileViTBlock(nn.Module):
    """Local representation (3x3 conv, 1x1 to ``dim``); unfold into 2x2 patches, so that each of the 4
    pixel positions of a patch is a sequence over the patches; ``depth`` transformer layers over each
    sequence; LayerNorm; fold back; 1x1 conv back to the channels; concatenation with the block's input
    and a 3x3 fusion conv."""

    def __init__(self, channels: int, dim: int, depth: int, heads: int):
        super().__init__()
        self.local = nn.Sequential(ConvBNAct(channels, channels, 3, act=nn.SiLU),
                                   nn.Conv2d(channels, dim, 1, bias=False))
        self.transformers = nn.Sequential(*[_Transformer(dim, heads, 2 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.project = ConvBNAct(dim, channels, 1, act=nn.SiLU)
        self.fuse = ConvBNAct(2 * channels, channels, 3, act=nn.SiLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        b, d, h, w = y.shape
        # unfold: b x d x (h/2 x 2) x (w/2 x 2) -> (b x 4 pixels) x (h/2 x w/2 patches) x d
        p = y.reshape(b, d, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1).reshape(b * 4, h * w // 4, d)
        p = self.norm(self.transformers(p))
        # fold: the inverse permutation
        y = p.reshape(b, 2, 2, h // 2, w // 2, d).permute(0, 5, 3, 1, 4, 2).reshape(b, d, h, w)
        return self.fuse(torch.cat([x, self.project(y)], 1))


def mobilevit_xxs(config: str) -> Built:
    """MobileViT-XXS (table 4): conv 3x3/2 to 16; MV2 blocks (expansion 2) to 16, 24 (x3); then per
    stage a strided MV2 and a MobileViT block: 48 channels with d=64 (2 layers), 64 with d=80 (4), 80
    with d=96 (3); 1x1 to 320, pool, classifier (1.3 M parameters), 1x3x256x256.  4 heads.  ci: 8..40
    channels, d=16/24/32, one layer per MobileViT block, 2 heads, 1x3x64x64."""
    seeded()
    full = config == "full"
    if full:
        chans, dims, depths, heads, last, classes, size = [16, 16, 24, 48, 64, 80], [64, 80, 96], [2, 4, 3], 4, \
            320, 1000, 256
    else:
        chans, dims, depths, heads, last, classes, size = [8, 8, 16, 24, 32, 40], [16, 24, 32], [1, 1, 1], 2, \
            64, 10, 64
    layers: list[nn.Module] = [ConvBNAct(3, chans[0], 3, 2, act=nn.SiLU), _MV2(chans[0], chans[1], 1, 2),
                               _MV2(chans[1], chans[2], 2, 2)]
    layers += [_MV2(chans[2], chans[2], 1, 2) for _ in range(2 if full else 1)]
    for i in range(3):
        layers += [_MV2(chans[2 + i], chans[3 + i], 2, 2), _MobileViTBlock(chans[3 + i], dims[i], depths[i], heads)]
    layers += [ConvBNAct(chans[5], last, 1, act=nn.SiLU), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(last, classes)]
    model = finish(nn.Sequential(*layers), image(3, size, batch=4, seed=99))
    return model, {"input": image(3, size)}, ["logits"]


# -- MLP-Mixer (Tolstikhin et al.: MLP-Mixer: An all-MLP Architecture for Vision, 2021) --------------------

class _MixerLayer(nn.Module):
    """Token mixing (LayerNorm, an MLP across the patches, applied on the transposed tokens) and channel
    mixing (LayerNorm, an MLP across the channels), each residual, GELU in both."""

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.tokens = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.channels = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, size: int, patch: int, dim: int, depth: int, token_hidden: int, channel_hidden: int,
                 classes: int):
        super().__init__()
        tokens = (size // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, patch)
        self.layers = nn.Sequential(*[_MixerLayer(tokens, dim, token_hidden, channel_hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.layers(self.stem(x).flatten(2).transpose(1, 2)))
        return self.head(x.mean(1))


def mixer_s16(config: str) -> Built:
    """Mixer-S/16: 16x16 patches (196 tokens), 8 layers of hidden 512, token MLP 256, channel MLP 2048,
    global average over the tokens, classifier (18.5 M parameters), 1x3x224x224.  ci: 64x64 (16 tokens),
    2 layers of 64, MLPs 32 and 128."""
    seeded()
    if config == "full":
        model, size = Mixer(224, 16, 512, 8, 256, 2048, 1000), 224
    else:
        model, size = Mixer(64, 16, 64, 2, 32, 128, 10), 64
    model = finish(model, image(3, size, batch=4, seed=99))
    return model, {"input": image(3, size)}, ["logits"]
