"""One registry model through one cuvil entry point, in a process of its own: the per-call cost of
torch.compile(backend="cuvil") with dynamo's default guards and with the two settings docs/torch.md
gives (torch's use_recursive_dict_tags_for_guards and cuvil.torch.backend.skip_weight_guards), beside
cuvil.torch.compile and cuvil's ONNX path.

    python benchmarks/torch_compile_settings.py mobilenetv2 default|lean|aot|onnx [calls, default 30]

Prints the median process CPU time per call at 1 thread, full-size model. Run the modes one after the
other (each in its own process: engines in one process disturb each other's CPU time).
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> None:
    import torch

    import cuvil.onnx
    import cuvil.torch
    from cuvil.models import registry
    from cuvil.torch.backend import skip_weight_guards

    name, mode = sys.argv[1], sys.argv[2]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    torch.set_num_threads(1)
    if mode == "onnx":
        session = cuvil.onnx.InferenceSession(registry.export(name, "full"), num_threads=1)
        feeds = registry.example_inputs(name, "full")

        def call() -> None:
            session.run(None, feeds)
    else:
        model, inputs, _ = registry.MODELS[name].build("full")
        args = tuple(inputs.values())
        if mode == "aot":
            fn = cuvil.torch.compile(model, args, num_threads=1)
        elif mode == "lean":
            torch._dynamo.config.use_recursive_dict_tags_for_guards = True
            fn = torch.compile(model, backend="cuvil", options={"guard_filter_fn": skip_weight_guards,
                                                                "num_threads": 1})
        else:
            fn = torch.compile(model, backend="cuvil", options={"num_threads": 1})

        def call() -> None:
            with torch.inference_mode():
                fn(*args)
    call()
    times = []
    for _ in range(calls):
        c = time.process_time()
        call()
        times.append(time.process_time() - c)
    print(f"{name} {mode}: {np.median(times) * 1e3:.2f} ms CPU per call (median of {calls}, 1 thread)")


if __name__ == "__main__":
    main()
