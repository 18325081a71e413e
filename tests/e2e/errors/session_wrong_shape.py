"""A session run with an input of another shape than the model declares.

needs: onnx
raises: ShapeError
says: input 'x': dimension 0 must be 2, got 3 (shape [3, 2])
"""

import numpy as np
from onnx import TensorProto, helper

import cuvil.onnx

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
sess = cuvil.onnx.InferenceSession(model.SerializeToString())
sess.run(None, {"x": np.zeros((3, 2), np.float32)})
