"""pytest plugin: every program the end-to-end tests build is also compiled for CUDA and checked by ptxas.

Used by tests/codegen/test_cuda_suite.py, which runs the tests/e2e/test_e2e_*.py files in a subprocess with
``-p cuda_ptx_plugin`` and few hypothesis examples.  For each program that ``reference.build``
compiles for the CPU, the plugin builds it for ``cuda -arch=sm_90`` twice (the default schedule and
``auto_schedule``), assembles the PTX with ``ptxas -arch=sm_90``, and appends one JSON line per
build to the file named by ``CUVIL_PTX_REPORT``.

With ``CUVIL_GPU_RUN=1`` (benchmarks/gpu_check.py, on a machine with a GPU) every call of such a
program also runs the auto-scheduled CUDA module on copies of the arguments and compares its outputs
with the CPU module's (which the test itself compares with numpy): one JSON line per call.
"""

from __future__ import annotations

import json
import os
import traceback

import numpy as np
from hypothesis import settings

TARGET = "cuda -arch=sm_90"


def pytest_configure(config):
    settings.register_profile("ptx", parent=settings.get_profile("ci"), max_examples=int(
        os.environ.get("CUVIL_PTX_EXAMPLES", "2")))
    settings.load_profile("ptx")
    import reference

    import cuvil
    from cuvil import te

    original = reference.build
    report = os.environ["CUVIL_PTX_REPORT"]

    def build(outputs, args):
        mod = original(outputs, args)
        gpu_mods = []
        outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        for how in ("default", "auto"):
            rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "schedule": how,
                   "outputs": [t.name for t in outs]}
            try:
                s = te.create_schedule(outs) if how == "default" else cuvil.auto_schedule(list(args), target=TARGET)
                m = cuvil.build(s, list(args), target=TARGET)
                info = m.check_ptx()
                if how == "auto":
                    gpu_mods.append(m)
                rec.update(ok=True, kernels=len(m.program.kernels), bound="threadIdx" in m.get_source("cuda"),
                           shared="ld.shared" in m.ptx, regs=[ln.split("Used ")[1].split(",")[0]
                                                              for ln in info.splitlines() if "Used " in ln])
            except Exception as exc:  # recorded: the outer test reports every failure at once
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:3000],
                           where=traceback.format_exc()[-1500:])
            with open(report, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if os.environ.get("CUVIL_GPU_RUN") == "1" and gpu_mods:
            return _Both(mod, gpu_mods[0], report)
        return mod

    reference.build = build


class _Both:
    """A CPU module that also runs its CUDA twin on copies of the arguments and records the comparison."""

    def __init__(self, cpu, gpu, report):
        self.cpu, self.gpu, self.report = cpu, gpu, report

    def __getattr__(self, name):
        return getattr(self.cpu, name)

    def __call__(self, *args):
        copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "schedule": "gpu-run"}
        try:
            self.gpu(*copies)
        except Exception as exc:
            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            copies = None
        self.cpu(*args)
        if copies is not None:
            bad = []
            for slot in self.cpu.plan.outputs:
                pos = self.cpu.plan.buffers[slot][0]
                got, want = copies[pos], args[pos]
                if got.dtype.kind == "f":
                    g, w = got.astype(np.float64), want.astype(np.float64)
                    tol = {2: 2e-2, 4: 2e-4, 8: 1e-9}[got.dtype.itemsize]
                    same_nan = np.array_equal(np.isnan(g), np.isnan(w))
                    fin = ~np.isnan(w)
                    close = np.allclose(g[fin], w[fin], rtol=tol, atol=tol * max(1.0, np.abs(w[fin]).max(initial=0)))
                    if not (same_nan and close):
                        bad.append(f"output {pos}: max diff {np.nanmax(np.abs(g - w), initial=0)}")
                elif not np.array_equal(got, want):
                    bad.append(f"output {pos}: {int((got != want).sum())} elements differ")
            rec.update(ok=not bad, error="; ".join(bad))
        with open(self.report, "a") as f:
            f.write(json.dumps(rec) + "\n")
