"""Run every benchmark: ``python benchmarks/run.py``.

For a fair numpy figure run it as
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/run.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = ["naive_c.py", "call_overhead.py", "matmul_schedule.py", "simd_kernel.py"]

if __name__ == "__main__":
    status = 0
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        status |= subprocess.call([sys.executable, os.path.join(HERE, name)])
    sys.exit(status)
