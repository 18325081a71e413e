"""Where cuvil stands on the registry of real models: export, compile, check against onnxruntime.

    python benchmarks/registry_status.py [--config ci|full] [--exporter dynamo,torchscript]
        [--only resnet18,bert-base] [--timeout 300] [--ops]

For every registry entry and exporter: export (cached in ``$CUVIL_REGISTRY_DIR``), then in a fresh
process (so one model's crash, hang or memory costs only its row) compile with
``cuvil.onnx.InferenceSession``, run on the entry's seeded inputs and compare every output with
onnxruntime (rtol 1e-3, atol 1e-4).  One row each: model, exporter, export seconds (0 when cached),
compile seconds (the session's construction and first run: a model whose shapes depend on its inputs
compiles on the first run), and "ok (max abs err)", "MISMATCH (max abs err)" or the error's first
line.  A compile that runs past ``--timeout`` seconds (default 300) is killed and the row says so.  ``--ops``
also prints the set of ONNX op types of each export.  Needs torch, transformers, onnxscript
(``pip install -e '.[torch]'``) and onnxruntime.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:160]


def export(name: str, config: str, exporter: str) -> dict:
    """Export one model (or find it in the cache); a JSON-able row with the path and the time."""
    from cuvil.models import registry

    t = time.perf_counter()
    try:
        path = registry.export(name, config, exporter)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"result": "export failed: " + _first_line(exc)}
    return {"path": path, "export_s": time.perf_counter() - t}


def check(name: str, config: str, path: str) -> dict:
    """Compile one exported model with cuvil, run it and compare with onnxruntime; a JSON-able row."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    import cuvil.onnx
    from cuvil.models import registry

    model = onnx.load(path, load_external_data=False)
    row: dict = {"ops": sorted({n.op_type for n in model.graph.node}), "nodes": len(model.graph.node)}
    feeds = registry.example_inputs(name, config)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    t = time.perf_counter()
    try:
        got = cuvil.onnx.InferenceSession(path).run(None, feeds)
        row["compile_s"] = time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row["compile_s"] = time.perf_counter() - t
        row["result"] = _first_line(exc)
        return row
    err = max(float(np.max(np.abs(g.astype(np.float64) - r))) if g.size else 0.0 for g, r in zip(got, ref))
    ok = len(got) == len(ref) and all(g.shape == r.shape and np.allclose(g, r, rtol=1e-3, atol=1e-4)
                                      for g, r in zip(got, ref))
    row["result"] = f"{'ok' if ok else 'MISMATCH'} (max abs err {err:.1e})"
    return row


def main(argv: list[str] | None = None) -> int:
    from cuvil.models import registry

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=registry.CONFIGS, default="ci")
    ap.add_argument("--exporter", default=",".join(registry.EXPORTERS))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per model and exporter")
    ap.add_argument("--ops", action="store_true", help="print each export's ONNX op types")
    ap.add_argument("--check", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check:
        print("ROW " + json.dumps(check(args.check[0], args.config, args.check[1])), flush=True)
        return 0
    names = [n for n in args.only.split(",") if n] or registry.names()
    exporters = [e for e in args.exporter.split(",") if e]
    print(f"config {args.config}; compile s = cuvil InferenceSession + first run (fresh process, --timeout "
          f"{args.timeout:.0f} s); check = onnxruntime, rtol 1e-3 atol 1e-4", flush=True)
    print(f"{'model':22} {'exporter':12} {'export s':>9} {'compile s':>10}  result", flush=True)
    for name in names:
        for exporter in exporters:
            row = export(name, args.config, exporter)
            if "path" in row:
                cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--check", name,
                       row["path"]]
                t = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
                    if rows:
                        row.update(json.loads(rows[-1]))
                    else:
                        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                        row["result"] = f"crashed: {tail[:140]}"
                except subprocess.TimeoutExpired:
                    row["result"] = f"skipped: still compiling after {time.perf_counter() - t:.0f} s"
            ex = f"{row['export_s']:9.1f}" if "export_s" in row else f"{'-':>9}"
            co = f"{row['compile_s']:10.1f}" if "compile_s" in row else f"{'-':>10}"
            print(f"{name:22} {exporter:12} {ex} {co}  {row['result']}", flush=True)
            if args.ops and "ops" in row:
                print(f"{'':22} ops ({row['nodes']} nodes): {' '.join(row['ops'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
