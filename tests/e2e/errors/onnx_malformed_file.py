"""Bytes that are not an ONNX model (a truncated or corrupted file).

needs: onnx
raises: ModelError
says: cannot load the ONNX model
"""

import cuvil.onnx

cuvil.onnx.InferenceSession(b"this is not an ONNX model")
