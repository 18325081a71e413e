"""Every program of the end-to-end test suite (tests/e2e/test_e2e_*.py) compiles to PTX that ptxas accepts.

The e2e files run in a subprocess with the cuda_ptx_plugin: each program they build for the CPU
(and check against numpy there) is also built for ``cuda -arch=sm_90`` with its default schedule and
with ``auto_schedule``, and each PTX goes through ``ptxas -arch=sm_90``.  A few hypothesis examples
per property keep this to a couple of minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from toolchain import missing

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E_DIR = os.path.join(TESTS, "e2e")
E2E = ["test_e2e_elementwise.py", "test_e2e_index.py", "test_e2e_nn.py", "test_e2e_reductions.py"]


@pytest.mark.slow
def test_every_e2e_program_gets_valid_ptx(tmp_path):
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        missing('cuda-python is not installed (pip install -e ".[cuda]")')
    from cuvil.codegen.nvrtc import find_ptxas

    if find_ptxas() is None:
        missing("ptxas not found (the nvidia-cuda-nvcc wheel of the cuda extra provides it)")
    report = tmp_path / "ptx.jsonl"
    # the CPU side in the te order only: the plugin builds the te order and auto_schedule for CUDA itself
    env = dict(os.environ, CUVIL_PTX_REPORT=str(report), CUVIL_PTX_EXAMPLES="1", CUVIL_E2E_SCHEDULES="te",
               PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "support"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cuda_ptx_plugin", "-p", "no:cacheprovider",
                           *E2E], cwd=E2E_DIR, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in report.read_text().splitlines()]
    bad = [r for r in recs if not r["ok"]]
    assert not bad, "\n".join(f"{r['test']} ({r['schedule']}): {r['error']}" for r in bad[:10])
    tests = {r["test"] for r in recs}
    assert len(recs) >= 150 and len(tests) >= 40, (len(recs), len(tests))
    auto = [r for r in recs if r["schedule"] == "auto"]
    assert sum(r["bound"] for r in auto) >= 0.8 * len(auto)  # mapped to blocks and threads
    print(f"{len(recs)} CUDA builds of {len(tests)} e2e tests: all pass ptxas -arch=sm_90")
