"""pytest plugin: every program the end-to-end tests build is also compiled for CUDA and checked by ptxas.

Used by tests/test_cuda_suite.py, which runs the tests/test_e2e_*.py files in a subprocess with
``-p cuda_ptx_plugin`` and few hypothesis examples.  For each program that ``reference.build``
compiles for the CPU, the plugin builds it for ``cuda -arch=sm_90`` twice (the default schedule and
``auto_schedule``), assembles the PTX with ``ptxas -arch=sm_90``, and appends one JSON line per
build to the file named by ``CUVIL_PTX_REPORT``.
"""

from __future__ import annotations

import json
import os
import traceback

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
        outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        for how in ("default", "auto"):
            rec = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "schedule": how,
                   "outputs": [t.name for t in outs]}
            try:
                s = te.create_schedule(outs) if how == "default" else cuvil.auto_schedule(list(args), target=TARGET)
                m = cuvil.build(s, list(args), target=TARGET)
                info = m.check_ptx()
                rec.update(ok=True, kernels=len(m.program.kernels), bound="threadIdx" in m.get_source("cuda"),
                           shared="ld.shared" in m.ptx, regs=[ln.split("Used ")[1].split(",")[0]
                                                              for ln in info.splitlines() if "Used " in ln])
            except Exception as exc:  # recorded: the outer test reports every failure at once
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:3000],
                           where=traceback.format_exc()[-1500:])
            with open(report, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return mod

    reference.build = build
