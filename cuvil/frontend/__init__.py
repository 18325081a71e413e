"""Model importers: ``cuvil.frontend.onnx`` turns an ONNX model into cuvil's graph IR and compiles it."""
