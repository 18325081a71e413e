"""Models of the production families outside images and text, written in torch.nn from their papers:
a point-cloud classifier (PointNet), a temporal convolutional network for time series (TCN) and a graph
convolutional network whose message passing is a scatter-add over an edge list (GCN).

``"full"``: the published sizes (PointNet on 1024 points, 40 classes; TCN of 8 levels x 64 channels
over 512 steps of 8 features; GCN on a Cora-sized graph).  ``"ci"``: the same blocks and ops,
narrower and shallower, on 128 points, 64 steps and a 64-node graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuvil.models.registry.common import SEED, finish, he_init, seeded

Built = tuple[nn.Module, dict[str, torch.Tensor], list[str]]


def _randn(*shape: int, seed: int = SEED + 2) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- PointNet (Qi, Su, Mo, Guibas: PointNet: Deep Learning on Point Sets for 3D Classification and
#    Segmentation, 2017) -------------------------------------------------------------------------------------

def _mlp1d(widths: list[int]) -> nn.Sequential:
    """A shared per-point MLP: 1x1 Conv1d + BatchNorm1d + ReLU for each step of ``widths``."""
    layers: list[nn.Module] = []
    for cin, cout in zip(widths, widths[1:]):
        layers += [nn.Conv1d(cin, cout, 1), nn.BatchNorm1d(cout), nn.ReLU()]
    return nn.Sequential(*layers)


def _fc(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for cin, cout in zip(widths, widths[1:]):
        layers += [nn.Linear(cin, cout), nn.BatchNorm1d(cout), nn.ReLU()]
    return nn.Sequential(*layers)


class _TNet(nn.Module):
    """The alignment network: a per-point MLP, a max over the points, fully connected layers to a
    ``k x k`` matrix, plus the identity.  The last layer starts near zero (the paper's starts at zero;
    training keeps the transforms near orthogonal), so the transforms stay near the identity and the
    logits well conditioned."""

    def __init__(self, k: int, mlp: list[int], fc: list[int]):
        super().__init__()
        self.k = k
        self.mlp = _mlp1d([k] + mlp)
        last = nn.Linear(fc[-1], k * k)
        with torch.no_grad():
            last.weight.mul_(0.1)
            last.bias.zero_()
        self.fc = nn.Sequential(_fc([mlp[-1]] + fc), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.fc(self.mlp(x).amax(2)).view(-1, self.k, self.k)
        return m + torch.eye(self.k, dtype=x.dtype)


class PointNet(nn.Module):
    """Classification network (figure 2): input transform (3x3, applied to every point by ``bmm``),
    MLP (64, 64), feature transform (64x64, by ``bmm``), MLP (64, 128, 1024), max over the points,
    fully connected 512, 256 (dropout 0.3), the classes."""

    def __init__(self, mlp1: list[int], mlp2: list[int], fc: list[int], classes: int):
        super().__init__()
        self.input_t = _TNet(3, mlp2, fc)
        self.mlp1 = _mlp1d([3] + mlp1)
        self.feature_t = _TNet(mlp1[-1], mlp2, fc)
        self.mlp2 = _mlp1d(mlp1[-1:] + mlp2)
        self.head = nn.Sequential(_fc([mlp2[-1]] + fc), nn.Dropout(0.3), nn.Linear(fc[-1], classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = torch.bmm(points.transpose(1, 2), self.input_t(points)).transpose(1, 2)
        x = self.mlp1(x)
        x = torch.bmm(x.transpose(1, 2), self.feature_t(x)).transpose(1, 2)
        return self.head(self.mlp2(x).amax(2))


def pointnet(config: str) -> Built:
    """PointNet classifier, T-Nets with MLP (64, 128, 1024) and FC (512, 256), 40 classes (ModelNet40),
    1x3x1024 points.  ci: MLPs (16, 16) and (16, 32, 128), FC (64, 32), 10 classes, 1x3x128."""
    seeded()
    if config == "full":
        model, n = PointNet([64, 64], [64, 128, 1024], [512, 256], 40), 1024
    else:
        model, n = PointNet([16, 16], [16, 32, 128], [64, 32], 10), 128
    model = finish(model, _randn(4, 3, n, seed=99))
    return model, {"points": _randn(1, 3, n)}, ["logits"]


# -- TCN (Bai, Kolter, Koltun: An Empirical Evaluation of Generic Convolutional and Recurrent Networks
#    for Sequence Modeling, 2018) ------------------------------------------------------------------------------

class _TemporalBlock(nn.Module):
    """Two weight-normalised dilated causal convolutions (left padding of ``(k - 1) * dilation``), each
    followed by ReLU (and dropout, the identity in eval); residual through a 1x1 conv when the channels
    change; ReLU."""

    def __init__(self, cin: int, cout: int, k: int, dilation: int):
        super().__init__()
        self.pad = (k - 1) * dilation
        self.conv1 = nn.Conv1d(cin, cout, k, dilation=dilation)
        self.conv2 = nn.Conv1d(cout, cout, k, dilation=dilation)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Conv1d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.relu(self.conv1(F.pad(x, (self.pad, 0)))))
        y = self.drop(F.relu(self.conv2(F.pad(y, (self.pad, 0)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class TCN(nn.Module):
    """Temporal blocks with dilations 1, 2, 4, ..., then a 1x1 conv to a forecast of every feature at
    every step (sequence to sequence)."""

    def __init__(self, features: int, channels: list[int], k: int):
        super().__init__()
        ins = [features] + channels[:-1]
        self.blocks = nn.Sequential(*[_TemporalBlock(c, d, k, 2 ** i) for i, (c, d) in enumerate(zip(ins, channels))])
        self.head = nn.Conv1d(channels[-1], features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def tcn(config: str) -> Built:
    """TCN: 8 temporal blocks of 64 channels, kernel 3 (dilations 1..128: a receptive field of 1021
    steps), over 1x8x512 (8 features, 512 steps), forecasting 1x8x512.  He-initialised, then weight
    normalisation (``torch.nn.utils.parametrizations.weight_norm``) on the dilated convs, as the
    paper's.  ci: 3 blocks of 16 channels over 1x4x64."""
    seeded()
    features, channels, steps = (8, [64] * 8, 512) if config == "full" else (4, [16] * 3, 64)
    model = he_init(TCN(features, channels, 3))
    for block in model.blocks:
        block.conv1 = nn.utils.parametrizations.weight_norm(block.conv1)
        block.conv2 = nn.utils.parametrizations.weight_norm(block.conv2)
    return model.eval(), {"series": _randn(1, features, steps)}, ["forecast"]


# -- GCN (Kipf, Welling: Semi-Supervised Classification with Graph Convolutional Networks, 2017) ---------

class _GraphConv(nn.Module):
    """``D^-1/2 (A + I) D^-1/2 X W + b`` as message passing: each edge carries its source node's
    ``X W`` row scaled by the edge's normalisation, and ``scatter_add`` over the destination index
    (broadcast along the features, as message-passing libraries write it) sums the messages into the
    destination nodes.  (``index_add`` says the same, but the TorchScript exporter refuses it when the
    index may repeat.)"""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.lin = nn.Linear(cin, cout, bias=False)
        self.bias = nn.Parameter(torch.randn(cout) * 0.1)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        messages = h[src] * norm.unsqueeze(1)
        return torch.zeros_like(h).scatter_add(0, dst.unsqueeze(1).expand_as(messages), messages) + self.bias


class GCN(nn.Module):
    """Two graph convolutions (ReLU and dropout between), log-softmax over the classes.  Self loops are
    added to the edge list and the degrees counted with ``scatter_add`` inside the model, as
    message-passing libraries do."""

    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.conv1 = _GraphConv(features, hidden)
        self.conv2 = _GraphConv(hidden, classes)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        loops = torch.arange(x.shape[0], dtype=edge_index.dtype)
        src, dst = torch.cat([edge_index[0], loops]), torch.cat([edge_index[1], loops])
        deg = torch.zeros(x.shape[0], dtype=x.dtype).scatter_add(0, dst, torch.ones(dst.shape[0], dtype=x.dtype))
        inv = deg.rsqrt()
        norm = inv[src] * inv[dst]
        y = self.drop(F.relu(self.conv1(x, src, dst, norm)))
        return F.log_softmax(self.conv2(y, src, dst, norm), 1)


def _graph(nodes: int, pairs: int, seed: int) -> torch.Tensor:
    """A seeded random undirected graph as a ``2 x (2 pairs)`` edge list (each pair in both directions,
    no self loops)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, nodes, (pairs,), generator=gen)
    b = (a + torch.randint(1, nodes, (pairs,), generator=gen)) % nodes
    return torch.stack([torch.cat([a, b]), torch.cat([b, a])])


def gcn(config: str) -> Built:
    """GCN on a Cora-sized graph: 2708 nodes of 1433 features, 5278 undirected edges (10556 directed,
    plus self loops), hidden 16, 7 classes.  He-initialised.  ci: 64 nodes of 32 features, 128 edges,
    hidden 8, 4 classes."""
    seeded()
    nodes, features, pairs, hidden, classes = (2708, 1433, 5278, 16, 7) if config == "full" else (64, 32, 128, 8, 4)
    model = he_init(GCN(features, hidden, classes)).eval()
    return model, {"x": _randn(nodes, features), "edge_index": _graph(nodes, pairs, SEED + 4)}, ["log_probs"]


# -- DLRM (Naumov et al.: Deep Learning Recommendation Model for Personalization and Recommendation
#    Systems, 2019) --------------------------------------------------------------------------------------------

def _mlp(widths: list[int], last_act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(cin, cout))
        if last_act or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Dense features through the bottom MLP; each categorical feature a multi-hot bag of ids, summed by
    ``nn.EmbeddingBag(mode="sum")`` over ``offsets``; the pairwise dot products of the bottom MLP's
    output and the embeddings (the strict upper triangle), concatenated with the bottom output, through
    the top MLP to a click probability."""

    def __init__(self, dense: int, rows: list[int], dim: int, bottom: list[int], top: list[int]):
        super().__init__()
        self.bottom = _mlp([dense] + bottom + [dim])
        self.tables = nn.ModuleList([nn.EmbeddingBag(n, dim, mode="sum") for n in rows])
        pairs = (len(rows) + 1) * len(rows) // 2
        self.top = _mlp([dim + pairs] + top + [1], last_act=False)
        self.register_buffer("upper", torch.triu_indices(len(rows) + 1, len(rows) + 1, 1), persistent=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [t(ids[i], offsets[i]) for i, t in enumerate(self.tables)], 1)  # b x f x d
        dots = torch.bmm(feats, feats.transpose(1, 2))[:, self.upper[0], self.upper[1]]
        return torch.sigmoid(self.top(torch.cat([x, dots], 1)))


def _bags(tables: int, rows: int, batch: int, ids: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded multi-hot inputs: per table ``ids`` ids split into ``batch`` non-empty bags of random sizes
    (``tables x ids`` ids, ``tables x batch`` offsets)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (tables, ids), generator=gen)
    cuts = torch.stack([torch.randperm(ids - 1, generator=gen)[:batch - 1].sort().values + 1 for _ in range(tables)])
    return index, torch.cat([torch.zeros(tables, 1, dtype=torch.int64), cuts], 1)


def dlrm(config: str) -> Built:
    """DLRM with the Criteo layout: 13 dense features, 26 categorical features of 10,000 hashed rows each
    (the published tables hold up to 10 million), embedding dim 16, bottom MLP 512-256-16, top MLP
    512-256-1, a batch of 128 requests averaging 4 ids per bag.  ci: 4 categorical features of 100
    rows, dim 8, MLPs 32-8 and 32-1, a batch of 8 with 24 ids per feature."""
    seeded()
    full = config == "full"
    tables, rows, dim, bottom, top, batch, ids = ((26, 10_000, 16, [512, 256], [512, 256], 128, 512) if full
                                                  else (4, 100, 8, [32], [32], 8, 24))
    model = DLRM(13, [rows] * tables, dim, bottom, top).eval()
    index, offsets = _bags(tables, rows, batch, ids, SEED + 5)
    return model, {"dense": _randn(batch, 13), "ids": index, "offsets": offsets}, ["click"]
