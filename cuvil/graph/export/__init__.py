"""Export: compiled graphs -> one shared library with a C entry point, and its header.

- :mod:`.signatures`  which input shapes each signature of a library has, and its symbolic sizes
- :mod:`.library`     :func:`export_graph`: the kernels' object files (compiled once, by the compile),
                      the C API around them, the constants, linked by ``cc`` into ``model.so``
- :mod:`.api`         where a run finds each buffer, and the LLVM IR of the C API
- :mod:`.header`      the C header (``model.h``)

docs/export.md shows the library from C; docs/graph.md where export sits in the graph compiler.
"""

from cuvil.graph.export.library import MODEL_ABI, SIZES_ABI, export_graph
from cuvil.graph.export.signatures import (
    SymbolicSize,
    check_given_shape,
    default_prefix,
    resolve_shapes,
    resolve_signatures,
)

__all__ = ["MODEL_ABI", "SIZES_ABI", "SymbolicSize", "check_given_shape", "default_prefix", "export_graph",
           "resolve_shapes", "resolve_signatures"]
