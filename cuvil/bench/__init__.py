"""cuvil's benchmarks, each behind a ``cuvil bench`` flag (:mod:`cuvil.cli.bench` picks one):

- :mod:`~cuvil.bench.ops`: operators beside numpy and onnxruntime (``--ops``); its timing helpers
  (``median_time``, ``interleaved``) serve the others;
- :mod:`~cuvil.bench.demo`: ``cuvil demo``, an auto-scheduled matmul and conv2d+relu;
- :mod:`~cuvil.bench.models`: whole ONNX models (files, zoo names) beside onnxruntime (the default);
- :mod:`~cuvil.bench.registry`: the registry's real models beside onnxruntime (``--registry``), and the
  engine protocol the next two share;
- :mod:`~cuvil.bench.quant`: int8 files beside onnxruntime and cuvil's fp32 (``--registry --quant``);
- :mod:`~cuvil.bench.torch`: torch eager, Inductor and cuvil.torch (``--registry --torch``);
- :mod:`~cuvil.bench.mca`: llvm-mca's view of a kernel's hottest loop (``benchmarks/arm_mca.py``).

The LLM benchmark (``--llm``) is :mod:`cuvil.llm.bench`: it runs the LLM anchors' protocol
(:mod:`cuvil.llm.anchors`) and shares its child-process plumbing.  Every model comes through
:mod:`cuvil.models`; compiling one goes through the same driver an InferenceSession uses
(:class:`cuvil.graph.driver.ModelCompiler`).  This ``__init__`` imports nothing.
"""
