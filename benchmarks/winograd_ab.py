"""Winograd convolutions on vs off on one registry model's ONNX path: the same session compiled twice
(``CompileOptions(winograd=True)`` / ``winograd=False``), outputs compared, then timed call by call in alternation.

    python benchmarks/winograd_ab.py resnet18 [rounds, default 15]

Prints each compile's time (the first one pays for the kernels both share), the largest difference of
the outputs and the median process CPU time per call at 1 thread of each, with their ratio.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    import cuvil.onnx
    from cuvil.models import registry
    from cuvil.options import CompileOptions

    name = sys.argv[1] if len(sys.argv) > 1 else "resnet18"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    path = registry.export(name, "full")
    feeds = registry.example_inputs(name, "full")
    sessions, outputs = {}, {}
    for on in (True, False):
        t = time.time()
        sessions[on] = cuvil.onnx.InferenceSession(path, num_threads=1, options=CompileOptions(winograd=on))
        outputs[on] = sessions[on].run(None, feeds)
        print(f"winograd {'on' if on else 'off'}: compile and first run {time.time() - t:.1f} s", flush=True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(outputs[True], outputs[False]))
    print(f"largest |on - off| over the outputs: {diff:.3g}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            c = time.process_time()
            sessions[on].run(None, feeds)
            times[on].append(time.process_time() - c)
    a, b = np.median(times[True]), np.median(times[False])
    print(f"{name}: winograd on {a * 1e3:.1f} ms, off {b * 1e3:.1f} ms, on / off {a / b:.3f} "
          f"(median of {rounds} interleaved rounds, process CPU time, 1 thread)")


if __name__ == "__main__":
    main()
