"""Registry models quantized to int8 by onnxruntime's own tool, the files users hand cuvil.

    from cuvil.models.registry import quantize
    path = quantize.quantize("resnet18", config="ci", scheme="qdq-u8s8")    # cached .onnx file
    quantize.SCHEMES                                                          # name -> Scheme

The fp32 file is the registry's export (:func:`cuvil.models.registry.export`, dynamo by default).  It goes
through onnxruntime's pre-processing (``quant_pre_process``: symbolic and ONNX shape inference and
onnxruntime's basic graph optimisations, the step its documentation asks for before quantizing; the
QOperator scheme skips the optimisations, see :func:`_quantize_file`), then
through ``onnxruntime.quantization``:

- ``quantize_static`` with a calibration reader that feeds a few seeded batches drawn like the
  registry's own example inputs (:class:`Calibration`), MinMax ranges; the QDQ format with uint8 or
  int8 activations (onnxruntime's "U8S8" and its default "S8S8"), per tensor or per channel, and the
  QOperator format (QLinearConv, QLinearMatMul, com.microsoft QGemm / QLinearAdd ...);
- ``quantize_dynamic``: DynamicQuantizeLinear, MatMulInteger and ConvInteger, int8 weights.

Files are cached beside the fp32 export in ``$CUVIL_REGISTRY_DIR``, named by model, config, exporter
and scheme, under a key that hashes the fp32 file's own key, this file's source, the scheme and the
onnxruntime version.  Like the exports they are written into a temporary folder and moved into place.

This module imports neither torch nor onnxruntime until a file has to be made.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from cuvil.errors import CuvilError

__all__ = ["CALIBRATION_BATCHES", "Calibration", "QuantizeError", "SCHEMES", "Scheme", "calibration_batches",
           "compare_quantized", "get_scheme", "output_steps", "quantize"]

CALIBRATION_BATCHES = 4  # enough for MinMax ranges of random inputs; each batch is one onnxruntime run
CALIBRATION_SEED = 7


class QuantizeError(CuvilError):
    """onnxruntime's quantizer failed on a registry model, or an unknown scheme (the message names both)."""


@dataclass(frozen=True)
class Scheme:
    """One way of calling onnxruntime's quantizer.

    ``method`` is "static" (calibrated activations) or "dynamic" (activation ranges computed per call,
    DynamicQuantizeLinear); ``fmt`` "qdq" (QuantizeLinear / DequantizeLinear around fp32 ops) or
    "qoperator" (QLinear* ops); ``activation`` / ``weight`` the int8 types, "u8" or "s8"."""

    name: str
    method: str
    fmt: str
    activation: str
    weight: str
    per_channel: bool
    description: str


_SCHEMES = [
    Scheme("qdq-u8s8", "static", "qdq", "u8", "s8", False,
           "QDQ, uint8 activations, int8 weights, per tensor (onnxruntime's recommended U8S8 on x86)"),
    Scheme("qdq-s8s8", "static", "qdq", "s8", "s8", False,
           "QDQ, int8 activations and weights, per tensor (quantize_static's defaults)"),
    Scheme("qdq-u8s8-pc", "static", "qdq", "u8", "s8", True, "QDQ U8S8 with per-channel weight scales"),
    Scheme("qdq-s8s8-pc", "static", "qdq", "s8", "s8", True, "QDQ S8S8 with per-channel weight scales"),
    Scheme("qop-u8s8", "static", "qoperator", "u8", "s8", False,
           "QOperator format: QLinearConv, QLinearMatMul, com.microsoft QGemm / QLinearAdd / ..., U8S8"),
    Scheme("dynamic", "dynamic", "qdq", "u8", "s8", False,
           "quantize_dynamic: DynamicQuantizeLinear + MatMulInteger / ConvInteger, int8 weights"),
]

SCHEMES: dict[str, Scheme] = {s.name: s for s in _SCHEMES}


def get_scheme(name: str) -> Scheme:
    """The scheme called ``name``; a :class:`QuantizeError` listing the schemes for an unknown name."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise QuantizeError(f"unknown quantization scheme {name!r}; schemes: {', '.join(SCHEMES)}") from None


# -- calibration --------------------------------------------------------------------------------------------


def calibration_batches(example: Mapping[str, np.ndarray], n: int = CALIBRATION_BATCHES,
                        seed: int = CALIBRATION_SEED) -> list[dict[str, np.ndarray]]:
    """``n`` seeded batches like ``example`` (the registry's example inputs), the example first.

    Float inputs are redrawn from a standard normal (the registry's images are ``torch.randn``); token
    ids are redrawn uniformly below the example's largest id wherever the attention mask (if any) is 1,
    the padding and every other integer input (masks, token types) kept: valid values depend on the
    model, and these are the values it was built to take."""
    rng = np.random.default_rng(seed)
    mask = example.get("attention_mask")
    out = [dict(example)]
    for _ in range(n - 1):
        batch = {}
        for name, a in example.items():
            if a.dtype.kind == "f":
                batch[name] = rng.standard_normal(a.shape).astype(a.dtype)
            elif name == "input_ids" and a.size:
                ids = rng.integers(0, int(a.max()) + 1, a.shape).astype(a.dtype)
                keep = mask == 0 if mask is not None and mask.shape == a.shape else np.zeros(a.shape, bool)
                batch[name] = np.where(keep, a, ids)
            else:
                batch[name] = a
        out.append(batch)
    return out


class Calibration:
    """onnxruntime's ``CalibrationDataReader`` protocol over fixed batches: ``get_next`` returns each
    batch once, then None; ``rewind`` starts over (the quantizer may read twice).  Feeds whose names the
    model does not take are dropped (pre-processing can remove an unused input)."""

    def __init__(self, batches: list[dict[str, np.ndarray]], input_names: list[str] | None = None):
        names = set(input_names) if input_names is not None else None
        self.batches = [{k: v for k, v in b.items() if names is None or k in names} for b in batches]
        self._it: Iterator[dict[str, np.ndarray]] = iter(self.batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# -- cache ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _source_hash() -> str:
    with open(os.path.abspath(__file__), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def cache_key(fp32_path: str, scheme: Scheme) -> str:
    """The sha256 that names a quantized file: the fp32 file (its name carries its own content key),
    this module's source, the scheme, the calibration settings and the onnxruntime / onnx versions."""
    parts = [os.path.basename(fp32_path), _source_hash(), repr(scheme), str(CALIBRATION_BATCHES),
             str(CALIBRATION_SEED), f"onnxruntime={_version('onnxruntime')}", f"onnx={_version('onnx')}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# -- quantizing ----------------------------------------------------------------------------------------------


def _types(scheme: Scheme) -> dict[str, Any]:
    from onnxruntime.quantization import QuantFormat, QuantType

    qt = {"u8": QuantType.QUInt8, "s8": QuantType.QInt8}
    kw: dict[str, Any] = {"per_channel": scheme.per_channel, "weight_type": qt[scheme.weight]}
    if scheme.method == "static":
        kw["activation_type"] = qt[scheme.activation]
        kw["quant_format"] = QuantFormat.QDQ if scheme.fmt == "qdq" else QuantFormat.QOperator
    return kw


def _input_names(path: str) -> list[str]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _quantize_file(fp32: str, out: str, scheme: Scheme, example: Mapping[str, np.ndarray], work: str) -> None:
    """onnxruntime's pre-processing of ``fp32``, then its quantizer per ``scheme``, written to ``out``."""
    from onnxruntime.quantization import CalibrationMethod, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from cuvil.models.registry.export import quiet

    pre = os.path.join(work, "preprocessed.onnx")
    with quiet():
        # QOperator without onnxruntime's optimisations: its MatMul + Add -> Gemm fusion, on an export that
        # shares one zero bias between a LayerNorm and a Linear (BERT's), makes the QOperator quantizer
        # write a QGemm with a uint8 bias, a file onnxruntime itself refuses
        quant_pre_process(fp32, pre, skip_optimization=scheme.fmt == "qoperator")
        if scheme.method == "dynamic":
            quantize_dynamic(pre, out, **_types(scheme))
        else:
            reader = Calibration(calibration_batches(example), _input_names(pre))
            quantize_static(pre, out, reader, calibrate_method=CalibrationMethod.MinMax, **_types(scheme))
    _loads_in_onnxruntime(out)


def _loads_in_onnxruntime(path: str) -> None:
    """onnxruntime must load the file it wrote: its quantizer can write an invalid model (a QGemm bias of
    the wrong type, when one initializer is shared by two kinds of consumer), and such a file is no test of
    cuvil."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def quantize(name: str, config: str = "ci", scheme: str = "qdq-u8s8", exporter: str = "dynamo") -> str:
    """The path of registry model ``name`` at ``config``, exported by ``exporter`` and quantized by
    onnxruntime's tool as ``scheme`` says (a key of :data:`SCHEMES`), from the cache or made now.

    Raises :class:`QuantizeError` naming the model and scheme when onnxruntime's quantizer fails, and
    the registry's errors for an unknown model, config or exporter."""
    from cuvil.models import registry
    from cuvil.models.registry.export import cache_dir

    sch = get_scheme(scheme)
    fp32 = registry.export(name, config=config, exporter=exporter)
    d = cache_dir()
    stem = f"{name}-{config}-{exporter}-{sch.name}-{cache_key(fp32, sch)[:16]}"
    path = os.path.join(d, stem + ".onnx")
    if os.path.exists(path):
        return path
    example = registry.example_inputs(name, config=config)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=d)
    try:
        try:
            _quantize_file(fp32, os.path.join(tmp, stem + ".onnx"), sch, example, tmp)
        except Exception as exc:
            raise QuantizeError(f"onnxruntime's quantizer ({sch.name}: {sch.description}) failed on registry model "
                                f"{name!r} ({config}, {exporter}): {type(exc).__name__}: {exc}") from exc
        os.replace(os.path.join(tmp, stem + ".onnx"), path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# -- comparing two engines on a quantized file ---------------------------------------------------------------

# quantizing ops and the input index of the scale their output is quantized with (com.microsoft's included)
_OUT_SCALE = {"QuantizeLinear": 1, "QLinearConv": 6, "QLinearMatMul": 6, "QGemm": 7, "QLinearAdd": 6,
              "QLinearMul": 6, "QLinearGlobalAveragePool": 3, "QLinearAveragePool": 3, "QLinearSigmoid": 3,
              "QLinearLeakyRelu": 3, "QLinearSoftmax": 3, "QLinearConcat": 0, "QLinearReduceMean": 3}


def _step_tensors(model: Any) -> dict[str, str]:
    """Per graph output, the name of the scale of the quantization nearest it upstream (breadth first over
    the producers): a QuantizeLinear's ``y_scale``, a QLinear op's output scale, or the ``y_scale`` output of
    a DynamicQuantizeLinear (a value known only at run time).  Outputs with no quantization upstream are
    left out."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out: dict[str, str] = {}
    for g in model.graph.output:
        frontier, seen = [g.name], {g.name}
        while frontier and g.name not in out:
            nxt = []
            for t in frontier:
                n = producer.get(t)
                if n is None:
                    continue
                k = _OUT_SCALE.get(n.op_type)
                if k is not None and len(n.input) > k and n.input[k]:
                    out[g.name] = n.input[k]
                    break
                if n.op_type == "DynamicQuantizeLinear":
                    out[g.name] = n.output[1]
                    break
                nxt += [i for i in n.input if i and i not in seen]
                seen.update(n.input)
            frontier = nxt
    return out


def output_steps(path: str, feeds: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per graph output of the quantized file ``path``: one step of the last quantization before it (the
    largest element of its scale), for ``feeds``.  A scale computed at run time (DynamicQuantizeLinear) is
    read from onnxruntime, run with that tensor as an extra output."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    tensors = _step_tensors(model)
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    runtime = sorted({s for s in tensors.values() if s not in consts})
    if runtime:
        import onnxruntime as ort

        have = {o.name for o in model.graph.output}
        model.graph.output.extend(onnx.helper.make_tensor_value_info(s, onnx.TensorProto.FLOAT, None)
                                  for s in runtime if s not in have)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        consts.update(zip(runtime, sess.run(runtime, dict(feeds))))
    return {o: float(np.max(np.abs(consts[s]))) for o, s in tensors.items()}


def compare_quantized(got: list[np.ndarray], ref: list[np.ndarray], names: list[str], steps: Mapping[str, float],
                      within: float = 2.0) -> list[str]:
    """What differs between ``got`` (the engine under test) and ``ref`` (the reference: in the tests the
    file's QDQ semantics, onnxruntime with its graph optimisations off; see cuvil.models.registry.semantics) on the
    same quantized file, one line per problem; empty when they agree.

    Each float output with a step (:func:`output_steps`) must lie within ``within`` steps of ``ref``
    everywhere (a rounding tie broken the other way moves a quantized value by one step, and a flip
    upstream, carried through later quantizations, by about one more), and its argmax along the last axis
    must agree wherever ``ref``'s top-2 margin exceeds ``within`` steps (measured on every ci file of the
    set: exact integer contractions, cuvil's or onnxruntime's with VNNI, lie within 1 step of the QDQ
    semantics, except on GPT-2's QDQ files, 2.0 steps exactly: a softmax row of 10 equal values, 0.1 /
    float32(1 / 255) = 25.4999992, rounds either way in float32, and the flip carries to the logits);
    outputs without a step (no quantization upstream) within rtol 1e-3, atol 1e-4; integer outputs exactly."""
    problems = []
    if len(got) != len(ref):
        return [f"{len(got)} outputs, the reference has {len(ref)}"]
    for name, y, r in zip(names, got, ref):
        if y.shape != r.shape or y.dtype != r.dtype:
            problems.append(f"{name}: {y.shape} {y.dtype}, the reference {r.shape} {r.dtype}")
            continue
        if r.dtype.kind != "f":
            if not np.array_equal(y, r):
                problems.append(f"{name}: {int(np.sum(y != r))} of {r.size} integers differ")
            continue
        err = np.abs(y.astype(np.float64) - r.astype(np.float64))
        step = steps.get(name)
        if step is None:
            bad = int(np.sum(~np.isclose(y, r, rtol=1e-3, atol=1e-4)))
            if bad:
                problems.append(f"{name}: {bad} of {r.size} elements beyond rtol 1e-3 / atol 1e-4 "
                                f"(largest error {err.max():.3g}; no quantization upstream)")
            continue
        tol = within * step * (1 + 1e-5)  # a dequantized value is q * scale rounded to float32
        if not np.all(err <= tol):
            problems.append(f"{name}: {int(np.sum(~(err <= tol)))} of {r.size} elements beyond {within:g} steps "
                            f"({tol:.3g}; step {step:.3g}), largest error {np.nanmax(err):.3g} "
                            f"= {np.nanmax(err) / step:.1f} steps")
        if r.ndim and r.shape[-1] > 1:
            rows = r.reshape(-1, r.shape[-1]).astype(np.float64)
            top2 = np.sort(rows, axis=-1)[:, -2:]
            sure = top2[:, 1] - top2[:, 0] > tol
            flips = sure & (np.argmax(rows, -1) != np.argmax(y.reshape(rows.shape), -1))
            if flips.any():
                problems.append(f"{name}: argmax differs in {int(flips.sum())} of {int(sure.sum())} rows whose "
                                f"top-2 margin exceeds {within:g} steps")
    return problems
