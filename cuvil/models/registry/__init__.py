"""A registry of real models, written in torch.nn from their papers or built with Hugging Face
``transformers`` from configs, and exported to ONNX the way users export them.

    from cuvil.models import registry
    registry.names()                                    # ["resnet18", "resnet50", ...]
    path = registry.export("resnet18", config="ci", exporter="dynamo")     # cached .onnx file
    feeds = registry.example_inputs("resnet18", config="ci")               # {name: numpy array}
    model, inputs, output_names = registry.MODELS["resnet18"].build("full")  # eval-mode torch module

Each entry has two configs: ``"full"``, the published size, and ``"ci"``, the same blocks and ops
with fewer repeats and smaller width / resolution, so one compile and run takes seconds.  Weights and
integer inputs are seeded (``torch.manual_seed``), so every build is the same; nothing is downloaded.
Exports are cached (see :mod:`cuvil.models.registry.export`).

``import cuvil`` does not import this package, and this package does not import torch: the model
modules (``vision``, ``detect``, ``sequence``, ``hf``, ``families``, ``hybrids``, ``heads``, ``domains``)
import it when a model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuvil.errors import CuvilError
from cuvil.models.registry.export import CONFIGS, EXPORTERS, ExportError

__all__ = ["CONFIGS", "EXPORTERS", "Entry", "ExportError", "MODELS", "RegistryError", "example_inputs", "export",
           "names"]


class RegistryError(CuvilError, ValueError):
    """An unknown model, config or exporter."""


@dataclass(frozen=True)
class Entry:
    """One registry model.

    ``build(config)`` returns ``(module, inputs, output_names)``: a ``torch.nn.Module`` in eval mode,
    its example inputs (input name -> tensor, in the order ``forward`` takes them) and the names of
    its outputs.  ``dynamic_axes`` (input name -> {axis: name}) are the axes a ``dynamic=True``
    export leaves open; None means axis 0 (batch) of every input.
    """

    name: str
    family: str
    build: Callable[[str], tuple[Any, dict[str, Any], list[str]]]
    description: str
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None


def _lazy(module: str, func: str, **kwargs: Any) -> Callable[[str], tuple[Any, dict[str, Any], list[str]]]:
    """A builder that imports ``cuvil.models.registry.<module>`` (and so torch) only when called."""

    def build(config: str) -> tuple[Any, dict[str, Any], list[str]]:
        if config not in CONFIGS:
            raise RegistryError(f"unknown config {config!r}; configs: {', '.join(CONFIGS)}")
        fn = getattr(importlib.import_module(f"cuvil.models.registry.{module}"), func)
        return fn(config, **kwargs)

    build.__qualname__ = build.__name__ = f"{module}.{func}"
    return build


_TEXT = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
_BERT = {**_TEXT, "token_type_ids": {0: "batch", 1: "sequence"}}
_DECODE = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"},
           **{f"past_{kv}_{i}": {0: "batch", 2: "past"} for i in range(12) for kv in ("key", "value")}}

_ENTRIES = [
    Entry("resnet18", "vision", _lazy("vision", "resnet", depth=18),
          "ResNet-18 (He et al. 2015), basic blocks [2,2,2,2], 1x3x224x224"),
    Entry("resnet50", "vision", _lazy("vision", "resnet", depth=50),
          "ResNet-50 (He et al. 2015; stride on the 3x3, v1.5), bottlenecks [3,4,6,3], 1x3x224x224"),
    Entry("mobilenetv2", "vision", _lazy("vision", "mobilenet_v2"),
          "MobileNetV2 (Sandler et al. 2018), inverted residuals, ReLU6, width 1.0, 1x3x224x224"),
    Entry("mobilenetv3-large", "vision", _lazy("vision", "mobilenet_v3_large"),
          "MobileNetV3-Large (Howard et al. 2019, table 1), SE + hard-swish, 1x3x224x224"),
    Entry("efficientnet-b0", "vision", _lazy("vision", "efficientnet_b0"),
          "EfficientNet-B0 (Tan & Le 2019, table 1), MBConv + SE + SiLU, 1x3x224x224"),
    Entry("densenet121", "vision", _lazy("vision", "densenet121"),
          "DenseNet-121 (Huang et al. 2017), growth 32, blocks [6,12,24,16], 1x3x224x224"),
    Entry("convnext-t", "vision", _lazy("vision", "convnext_tiny"),
          "ConvNeXt-T (Liu et al. 2022), depths [3,3,9,3], dims 96..768, 7x7 depthwise + LayerNorm, 1x3x224x224"),
    Entry("vit-s16", "vision", _lazy("vision", "vit_small"),
          "ViT-S/16 (Dosovitskiy et al. 2020; DeiT-S size), 12 layers, dim 384, 6 heads, 1x3x224x224"),
    Entry("unet", "detect", _lazy("detect", "unet"),
          "UNet (Ronneberger et al. 2015), 4 levels from 32 channels, ConvTranspose2d ups + concat, 1x3x256x256"),
    Entry("yolov8n", "detect", _lazy("detect", "yolov8n"),
          "YOLOv8n-style detector: C2f backbone, SPPF, upsample + concat neck, DFL heads, 1x3x320x320"),
    Entry("lstm", "sequence", _lazy("sequence", "recurrent", cell="lstm"),
          "LSTM classifier: nn.LSTM 2 layers x 512, batch_first, 64 steps of 128, Linear head on the last step"),
    Entry("gru", "sequence", _lazy("sequence", "recurrent", cell="gru"),
          "GRU classifier: nn.GRU 2 layers x 512, batch_first, 64 steps of 128, Linear head on the last step"),
    Entry("bert-base", "text", _lazy("hf", "bert"),
          "transformers BertModel, BERT-base (12 layers, 768, 12 heads), ids + mask + token types, seq 128",
          _BERT),
    Entry("distilbert", "text", _lazy("hf", "distilbert"),
          "transformers DistilBertModel (6 layers, 768, 12 heads), ids + mask, seq 128", _TEXT),
    Entry("gpt2", "text", _lazy("hf", "gpt2"),
          "transformers GPT2LMHeadModel, GPT-2 small (12 layers, 768), ids + mask -> logits, seq 128", _TEXT),
    Entry("llama", "text", _lazy("hf", "llama"),
          "transformers LlamaForCausalLM (8 layers, hidden 1024, 16 heads / 4 KV heads), ids + mask -> logits, "
          "seq 128", _TEXT),
    Entry("t5-small-encoder", "text", _lazy("hf", "t5_encoder"),
          "transformers T5EncoderModel, t5-small (6 layers, 512, 8 heads, relative positions), ids + mask, seq 128",
          _TEXT),
    Entry("whisper-tiny-encoder", "audio", _lazy("hf", "whisper_encoder"),
          "transformers WhisperEncoder, whisper-tiny (4 layers, 384, 6 heads), log-mel 1x80x3000",
          {"input_features": {0: "batch"}}),
    Entry("gpt2-decode", "text", _lazy("hf", "gpt2_decode"),
          "transformers GPT2LMHeadModel, one decode step: 1 new token, past keys/values of 127 tokens as inputs, "
          "logits + present keys/values out", _DECODE),
    # -- the widened registry (issue 29): families users bring that the first 19 lacked
    Entry("regnety-400mf", "vision", _lazy("families", "regnety"),
          "RegNetY-400MF (Radosavovic et al. 2020): grouped 3x3 convs (group width 8) + squeeze-excitation, "
          "the RegNet / ResNeXt family, 1x3x224x224"),
    Entry("squeezenet", "vision", _lazy("families", "squeezenet"),
          "SqueezeNet v1.0 (Iandola et al. 2016): fire modules, a 1x1 squeeze feeding parallel 1x1 and 3x3 "
          "expands, concatenated; no batch norm, 1x3x224x224"),
    Entry("shufflenetv2", "vision", _lazy("families", "shufflenet_v2"),
          "ShuffleNetV2 1.0x (Ma et al. 2018): channel split, depthwise 3x3, concat + channel shuffle "
          "(reshape-transpose), 1x3x224x224"),
    Entry("inception", "vision", _lazy("families", "inception"),
          "GoogLeNet (Szegedy et al. 2014) with BatchNorm: 1x1 / 3x3 / 5x5 / pool branches concatenated, "
          "ceil-mode pools; the 14x14 stage's 5x5 as 1x7 + 7x1 (Inception-v3), 1x3x224x224"),
    Entry("mobilevit-xxs", "vision", _lazy("hybrids", "mobilevit_xxs"),
          "MobileViT-XXS (Mehta & Rastegari 2021): MV2 blocks + transformers over pixels unfolded from 2x2 "
          "patches and folded back; a mobile conv / attention hybrid, 1x3x256x256"),
    Entry("mixer-s16", "vision", _lazy("hybrids", "mixer_s16"),
          "MLP-Mixer S/16 (Tolstikhin et al. 2021): token-mixing MLPs over transposed patches + channel MLPs; "
          "all-MLP, 1x3x224x224"),
    Entry("dinov2-s14", "vision", _lazy("hf", "dinov2"),
          "transformers Dinov2Model, DINOv2-S/14 (12 layers, 384, layer scale) at 224 where it was trained at "
          "518: bicubic resampling of the positions in the model (TorchScript keeps it; dynamo folds it), 1x3x224x224"),
    Entry("hrnet-w18s", "detect", _lazy("families", "hrnet"),
          "HRNetV2-W18-Small-v2 (Wang et al. 2019) segmentation: 2-4 parallel resolutions exchanged by strided "
          "convs and nearest upsampling, bilinear head; multi-resolution, 1x3x512x512"),
    Entry("segformer-b0", "detect", _lazy("heads", "segformer_b0"),
          "SegFormer-B0 (Xie et al. 2021): hierarchical ViT, spatial-reduction attention (strided-conv keys / "
          "values), Mix-FFN (depthwise 3x3), all-MLP decoder upsampling every stage bilinearly, 1x3x512x512"),
    Entry("deeplab-aspp", "detect", _lazy("heads", "deeplab_aspp"),
          "DeepLabv3 (Chen et al. 2017): dilated ResNet-18 at output stride 16, atrous pyramid (rates 6/12/18 + "
          "image pooling), bilinear upsampling (align_corners=False), 1x3x513x513"),
    Entry("fpn", "detect", _lazy("heads", "fpn_semantic"),
          "FPN (Lin et al. 2017) on ResNet-18 with Panoptic FPN's semantic branch: laterals + 2x nearest top-down, "
          "GroupNorm, bilinear upsampling with align_corners=True, 1x3x384x384"),
    Entry("detr", "detect", _lazy("heads", "detr"),
          "DETR (Carion et al. 2020) with a ResNet-18: 6 + 6 post-norm transformer layers, 100 object queries "
          "cross-attending to the 16x16 grid, class + box heads; a set-prediction decoder, 1x3x512x512"),
    Entry("espcn", "detect", _lazy("heads", "espcn"),
          "ESPCN x4 (Shi et al. 2016) super-resolution: sub-pixel conv (PixelShuffle) + a bicubic skip with "
          "align_corners=True, 1x3x128x128 -> 512x512"),
    Entry("r3d-18", "video", _lazy("families", "r3d"),
          "R3D-18 (Tran et al. 2018): a ResNet of 3x3x3 Conv3d + BatchNorm3d over video clips; 3-D convolutions, "
          "1x3x8x112x112"),
    Entry("wav2vec2-base", "audio", _lazy("hf", "wav2vec2"),
          "transformers Wav2Vec2Model, wav2vec 2.0 base (12 layers, 768): Conv1d feature encoder with GroupNorm "
          "over the raw waveform, grouped positional conv (kernel 128); speech, 1x16000",
          {"input_values": {0: "batch", 1: "samples"}}),
    Entry("pointnet", "points", _lazy("domains", "pointnet"),
          "PointNet (Qi et al. 2017) classifier: per-point MLPs as 1x1 Conv1d, 3x3 and 64x64 transforms by bmm, "
          "max over the points; point clouds, 1x3x1024"),
    Entry("tcn", "sequence", _lazy("domains", "tcn"),
          "TCN (Bai et al. 2018): weight-normalised dilated causal Conv1d blocks (dilations 1..128); time-series "
          "forecasting, 1x8x512"),
    Entry("gcn", "graph", _lazy("domains", "gcn"),
          "GCN (Kipf & Welling 2017), 2 layers on a Cora-sized graph: message passing by scatter_add over an "
          "edge list (ScatterElements, reduction add; 2708 nodes x 1433, 10556 edges)",
          {"x": {0: "nodes"}, "edge_index": {1: "edges"}}),
    Entry("dlrm", "recommend", _lazy("domains", "dlrm"),
          "DLRM (Naumov et al. 2019), Criteo layout: nn.EmbeddingBag sums over offsets (26 tables x 10k x 16), "
          "bottom / top MLPs, pairwise dot interaction; recommendation, a batch of 128",
          {"dense": {0: "batch"}, "ids": {1: "ids"}, "offsets": {1: "batch"}}),
]

MODELS: dict[str, Entry] = {e.name: e for e in _ENTRIES}

# the entries issue 29 added, families the first 19 lacked (docs/models.md, "The widened registry"): CI checks
# their ci configs once per run, natively; the second, AVX2-narrowed pass over the fast lane keeps to the first 19
WIDENED = frozenset(e.name for e in _ENTRIES[19:])


def names() -> list[str]:
    """The registry's model names, in table order."""
    return list(MODELS)


def _entry(name: str) -> Entry:
    try:
        return MODELS[name]
    except KeyError:
        raise RegistryError(f"no registry model {name!r}; models: {', '.join(MODELS)}") from None


def export(name: str, config: str = "ci", exporter: str = "dynamo", dynamic: bool = False) -> str:
    """The path of model ``name`` exported to ONNX by ``exporter`` ("dynamo": opset 18, the default
    ``torch.onnx.export``; "torchscript": ``dynamo=False``, opset 17), from the cache or exported now.

    ``dynamic=True`` leaves the batch axis (and the sequence axis of text models) symbolic.  Raises
    :class:`ExportError` (a :class:`~cuvil.errors.CuvilError`) naming the model and exporter when the
    exporter fails."""
    from cuvil.models.registry.export import export_entry

    entry = _entry(name)
    if config not in CONFIGS:
        raise RegistryError(f"unknown config {config!r}; configs: {', '.join(CONFIGS)}")
    if exporter not in EXPORTERS:
        raise RegistryError(f"unknown exporter {exporter!r}; exporters: {', '.join(EXPORTERS)}")
    return export_entry(entry, config, exporter, bool(dynamic))


def example_inputs(name: str, config: str = "ci") -> dict[str, np.ndarray]:
    """Model ``name``'s seeded example inputs at ``config`` as numpy arrays (batch 1), by input name."""
    from cuvil.models.registry.export import example_inputs as _inputs

    if config not in CONFIGS:
        raise RegistryError(f"unknown config {config!r}; configs: {', '.join(CONFIGS)}")
    return _inputs(_entry(name), config)
