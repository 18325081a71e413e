"""torch.compile(backend="cuvil")'s per-call cost outside cuvil's program: dynamo's guards and
aot_autograd's wrappers over a module's parameter inputs, with the compiled program replaced by one
that does nothing, timed with warm caches and with 64 MB written between calls (as a real run's
weights and activations do).

    python benchmarks/torch_dynamo_overhead.py [registry model, default mobilenetv2] [--config full|ci]

Prints the median process CPU time per call (1 thread), beside it dynamo alone (a backend that returns
the no-op program itself: no aot_autograd, no cuvil) and the same model's cuvil.torch.compile module
around the same no-op program.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    import torch

    import cuvil.torch
    import cuvil.torch.backend as backend
    from cuvil.models import registry

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="mobilenetv2")
    p.add_argument("--config", default="full", choices=["full", "ci"])
    p.add_argument("--calls", type=int, default=100)
    a = p.parse_args()
    torch.set_num_threads(1)
    model, inputs, _ = registry.MODELS[a.model].build(a.config)
    args = tuple(inputs.values())
    with torch.no_grad():
        out = model(*args)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def nothing(*_: object) -> tuple:  # what the backend's program returns, computed by nobody
        return tuple(torch.empty_like(o) for o in outs)

    backend._split_and_compile = lambda aten, consts, opts, name: nothing  # the program, as a no-op
    compiled = torch.compile(model, backend="cuvil")
    bare = torch.compile(model, backend=lambda gm, example: nothing)  # dynamo alone: no aot_autograd, no cuvil
    cm = cuvil.torch.compile(model, args)
    cm.session.run = lambda names, feeds: [o.numpy() for o in nothing()]  # the same no-op in the AOT module
    n_weights = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    big = np.ones(64 << 18, np.float32)  # 64 MB
    with torch.no_grad():
        compiled(*args)
        bare(*args)
        for label, fn in (("torch.compile(backend='cuvil')", lambda: compiled(*args)),
                          ("torch.compile, a backend that returns the no-op (dynamo alone)", lambda: bare(*args)),
                          ("cuvil.torch.compile", lambda: cm(*args))):
            for evict in (False, True):
                ts = []
                for _ in range(a.calls):
                    if evict:
                        big += 1.0
                    c = time.process_time()
                    fn()
                    ts.append(time.process_time() - c)
                print(f"{a.model} ({n_weights} parameter and buffer tensors), {label}, "
                      f"{'64 MB written between calls' if evict else 'warm caches'}: "
                      f"{np.median(ts) * 1e6:.0f} us CPU per call")


if __name__ == "__main__":
    main()
