"""A session run fed under a name the model has no input for.

needs: onnx
raises: ArgumentError
says: unknown input(s) 'input'; the model's inputs are x
"""

import numpy as np
from onnx import TensorProto, helper

import cuvil.onnx

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
sess = cuvil.onnx.InferenceSession(model.SerializeToString())
sess.run(None, {"input": np.zeros((2, 3), np.float32)})
